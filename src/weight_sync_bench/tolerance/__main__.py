"""``python -m weight_sync_bench.tolerance``: the measuring command line (``cli.measure``)."""

import sys

from weight_sync_bench.cli.measure import main

sys.exit(main())
