import sys

from weight_sync_bench.cli.main import main

sys.exit(main())
