"""``python -m weight_sync_bench.fuzz.floor replicated-kv ...``: ``wsb floor replicated-kv ...``
(``wsb floor`` names the kind: ``random``, ``replicated-kv``, ...)."""

import sys

from weight_sync_bench.cli.main import main

sys.exit(main(["floor", *sys.argv[1:]]))
