"""``python -m weight_sync_bench.tolerance [KIND] ...``: ``wsb floor KIND ...``, with ``phase``
the kind where none is named (``python -m weight_sync_bench.tolerance --phase 1b`` reads as
it always did)."""

import sys

from weight_sync_bench.cli.floor import as_floor_argv
from weight_sync_bench.cli.main import main

sys.exit(main(as_floor_argv(sys.argv[1:])))
