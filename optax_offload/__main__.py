"""``python -m optax_offload``: see `optax_offload._src.cli`."""

import sys

from optax_offload._src.cli import main

if __name__ == "__main__":
  sys.exit(main())
