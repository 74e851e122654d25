"""Run by ``torchrun`` in tests/cli/test_torchrun_options.py: ``wsb`` with options that
differ by rank, as a launch script that templates its command line per rank would give.

    torchrun --standalone --nproc-per-node 2 tests/cli/torchrun_per_rank.py \\
        '{"1": ["--seed", "7"]}' sync --launcher torchrun ...

The first argument maps a rank (``RANK``) to the options appended to its command line (a
later option wins in argparse); the rest is every rank's command line. Exits with ``wsb``'s
exit status.
"""

from __future__ import annotations

import json
import os
import sys

from weight_sync_bench.cli.main import main

if __name__ == "__main__":
    extra = json.loads(sys.argv[1]).get(os.environ["RANK"], [])
    sys.exit(main([*sys.argv[2:], *extra]))
