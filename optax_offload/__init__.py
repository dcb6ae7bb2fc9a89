"""optax_offload: optimizer state in pinned host memory and on NVMe, streamed through a bounded window.

Examples:
  >>> import jax.numpy as jnp, optax
  >>> import optax_offload as oo
  >>> tx = oo.offload(optax.adamw(1e-3))
  >>> state = tx.init({"w": jnp.zeros((128, 64))})
  >>> oo.footprint(state)["host"]
  65536
"""

from optax_offload._src.apply import init
from optax_offload._src.apply import update_and_apply
from optax_offload._src.checkpoint import OffloadCheckpointHandler
from optax_offload._src.checkpoint import OffloadRestore
from optax_offload._src.checkpoint import OffloadSave
from optax_offload._src.compress import with_moment_dtype
from optax_offload._src.estimate import Estimate
from optax_offload._src.estimate import estimate
from optax_offload._src.gpu_program import GpuProgram
from optax_offload._src.gpu_program import compile_for_gpu
from optax_offload._src.host_grads import value_and_grad_to_host
from optax_offload._src.inspection import close_nvme
from optax_offload._src.inspection import footprint
from optax_offload._src.inspection import master_params
from optax_offload._src.inspection import sync_nvme
from optax_offload._src.inspection import tiers
from optax_offload._src.inspection import to_inner
from optax_offload._src.measure import Bandwidths
from optax_offload._src.measure import measure_bandwidths
from optax_offload._src.memory import to_pinned_host
from optax_offload._src.nvme import NvmeCorruptionError
from optax_offload._src.nvme import NvmeError
from optax_offload._src.nvme import NvmeOptions
from optax_offload._src.nvme import NvmeWriteError
from optax_offload._src.nvme_stack import NvmeStackLeaf
from optax_offload._src.nvme_stack import close_nvme_stack
from optax_offload._src.nvme_stack import copy_nvme_stack
from optax_offload._src.nvme_stack import open_nvme_stack
from optax_offload._src.nvme_stack import read_nvme_stack
from optax_offload._src.nvme_stack import write_nvme_stack
from optax_offload._src.offload import abstract_state
from optax_offload._src.offload import offload
from optax_offload._src.offloaded_scan import STREAM_XLA_OPTIONS
from optax_offload._src.offloaded_scan import offloaded_layers
from optax_offload._src.offloaded_scan import offloaded_scan
from optax_offload._src.plan import LeafInfo
from optax_offload._src.plan import Piece
from optax_offload._src.plan import Plan
from optax_offload._src.plan import Tier
from optax_offload._src.plan import describe_plan
from optax_offload._src.plan import make_plan
from optax_offload._src.state import OffloadState
from optax_offload._src.step_time import Hardware
from optax_offload._src.step_time import KernelCost
from optax_offload._src.step_time import Timeline
from optax_offload._src.step_time import hardware
from optax_offload._src.step_time import timeline
from optax_offload._src.units import format_bytes
from optax_offload._src.units import parse_bytes
from optax_offload._src.value_and_update import value_and_update

__version__ = "0.1.0"


def __getattr__(name: str):
  # `oo.nnx` and `oo.linen` import Flax, an optional dependency: only when first used.
  if name in ("nnx", "linen"):
    import importlib

    return importlib.import_module(f"optax_offload.{name}")
  raise AttributeError(f"module 'optax_offload' has no attribute {name!r}")


__all__ = (
  "Bandwidths",
  "Estimate",
  "GpuProgram",
  "Hardware",
  "KernelCost",
  "LeafInfo",
  "NvmeCorruptionError",
  "NvmeError",
  "NvmeOptions",
  "NvmeStackLeaf",
  "NvmeWriteError",
  "OffloadCheckpointHandler",
  "OffloadRestore",
  "OffloadSave",
  "OffloadState",
  "Piece",
  "Plan",
  "STREAM_XLA_OPTIONS",
  "Tier",
  "Timeline",
  "abstract_state",
  "close_nvme",
  "close_nvme_stack",
  "copy_nvme_stack",
  "compile_for_gpu",
  "describe_plan",
  "estimate",
  "footprint",
  "format_bytes",
  "hardware",
  "init",
  "make_plan",
  "master_params",
  "measure_bandwidths",
  "offload",
  "offloaded_layers",
  "offloaded_scan",
  "open_nvme_stack",
  "parse_bytes",
  "read_nvme_stack",
  "sync_nvme",
  "tiers",
  "timeline",
  "to_inner",
  "to_pinned_host",
  "update_and_apply",
  "value_and_grad_to_host",
  "value_and_update",
  "with_moment_dtype",
  "write_nvme_stack",
)
