"""``wsb`` and its subcommands: the only package that prints.
"""

from weight_sync_bench.cli.main import main

__all__ = ["main"]
