"""The NVMe tier of `offload`: which state arrays live in the store, and how an update moves them.

See ``README.md`` in this directory for the design and the modules. The rest of the library uses
the names below: `NvmeTier` (made by `tree_setup`, used eagerly by offload's init, checkpoints and
inspection), `TracedTier` (the update's callbacks, used by `stream`), `lookup` (a state's tier).
"""

from optax_offload._src.nvme_tier.callbacks import TracedTier
from optax_offload._src.nvme_tier.registry import lookup
from optax_offload._src.nvme_tier.tier import NvmeTier
from optax_offload._src.nvme_tier.tier import placeholder
from optax_offload._src.nvme_tier.tier import process_directory

__all__ = (
  "NvmeTier",
  "TracedTier",
  "lookup",
  "placeholder",
  "process_directory",
)
