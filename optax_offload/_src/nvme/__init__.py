"""The NVMe tier's store: generations of arrays on local disk, crash-safe, with prefetch and write-behind.

See ``README.md`` in this directory for the protocol and the layout of the modules. The rest of the
library uses the names below.
"""

from optax_offload._src.nvme.buffers import ReadBuffers
from optax_offload._src.nvme.errors import NvmeCorruptionError
from optax_offload._src.nvme.errors import NvmeError
from optax_offload._src.nvme.errors import NvmeWriteError
from optax_offload._src.nvme.errors import StaleGenerationError
from optax_offload._src.nvme.files import fsync_path
from optax_offload._src.nvme.files import write_json_atomic
from optax_offload._src.nvme.format import LeafSpec
from optax_offload._src.nvme.format import round_up
from optax_offload._src.nvme.format import stored_groups
from optax_offload._src.nvme.format import ts_context
from optax_offload._src.nvme.format import zarr3_read_spec
from optax_offload._src.nvme.leaf_io import read_region
from optax_offload._src.nvme.options import NvmeOptions
from optax_offload._src.nvme.store import NvmeStore

__all__ = (
  "LeafSpec",
  "NvmeCorruptionError",
  "NvmeError",
  "NvmeOptions",
  "NvmeStore",
  "NvmeWriteError",
  "ReadBuffers",
  "StaleGenerationError",
  "fsync_path",
  "read_region",
  "round_up",
  "stored_groups",
  "ts_context",
  "write_json_atomic",
  "zarr3_read_spec",
)
