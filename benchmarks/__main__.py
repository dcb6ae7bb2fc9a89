"""``python -m benchmarks``: see `benchmarks.report`."""

import sys

from benchmarks.report import main

if __name__ == "__main__":
  sys.exit(main())
