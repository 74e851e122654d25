import sys

from weight_sync_bench.cli import main

sys.exit(main())
