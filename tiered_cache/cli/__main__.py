"""``python -m tiered_cache.cli``."""

import sys

from tiered_cache.cli import main

if __name__ == "__main__":
    sys.exit(main())
