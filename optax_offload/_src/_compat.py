"""Non-public names of JAX, jaxlib and optax that optax_offload relies on, in one place.

Each entry says what it is for and since/until which version it is known to hold. When a JAX
release moves one of them, this is the only file to change.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Literal
from optax.tree_utils._state_utils import _ParamsPlaceholder as ParamsPlaceholder

# --- optax (checked with 0.2.8) ------------------------------------------------------------------
# `ParamsPlaceholder`: what `optax.tree_utils.tree_map_params` passes to `init` to learn where a
# state holds parameter-shaped subtrees (optax 0.2.x: private, in `optax.tree_utils._state_utils`).

try:  # optax 0.2.x keeps the message of its "params are required" error in `optax._src.base`.
  from optax._src.base import NO_PARAMS_MSG
except ImportError:  # pragma: no cover - a later optax moved it
  NO_PARAMS_MSG = "You are using a transformation that requires the current value of parameters"

# --- jax (checked with 0.10.2) --------------------------------------------------------------------
# `ClosedJaxpr`, `Literal`: jaxpr types for replaying a function's equations (host_compute); public
# in `jax.extend.core` since jax 0.4.3x.

Tracer = jax.core.Tracer

__all__ = ["ClosedJaxpr", "Literal", "NO_PARAMS_MSG", "ParamsPlaceholder", "Tracer"]

SUPPORTED_JAX = ((0, 10, 2), (0, 11, 0))
"""Range of jax versions whose private entry points below were checked: [low, high)."""


def jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def check_gpu_compile_support() -> None:
  """Raises a clear error when compiling for a GPU target cannot work in this environment."""
  low, high = SUPPORTED_JAX
  version = jax_version()
  if not low <= version < high:
    raise RuntimeError(
      f"optax_offload's compile-for-GPU harness was written against jax "
      f"{'.'.join(map(str, low))} to <{'.'.join(map(str, high))}; this is jax {jax.__version__}. "
      "Its non-public entry points live in optax_offload/_src/_compat.py: check them against this "
      "release."
    )
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise RuntimeError(
      "Compiling for an NVIDIA target needs the CUDA PJRT plugin of the installed jax (no GPU, "
      f"driver or nvidia-* wheels needed): pip install 'jax-cuda12-plugin=={jax.__version__}' "
      f"'jax-cuda12-pjrt=={jax.__version__}' (or pip install 'optax-offload[gpu-compile]')."
    )


@contextlib.contextmanager
def lowering_backend(client: Any):
  """Lowers with `client` as the backend of a CUDA lowering done on a machine without a GPU.

  Lowering a host callback (``io_callback``, the NVMe tier's) asks the module's backend for its
  platform; lowering for CUDA from CPU arrays has the CPU client there and fails. The callback's
  lowering only needs the platform, so a compile-only client of the target answers. Replaces
  jax 0.10.2's private ``mlir.ModuleContext.get_backend`` for the duration.
  """
  from jax._src.interpreters import mlir

  original = mlir.ModuleContext.get_backend

  def get_backend(self, optional: bool = False):
    if tuple(self.platforms) == ("cuda",):
      return client
    return original(self, optional)

  mlir.ModuleContext.get_backend = get_backend
  try:
    yield
  finally:
    mlir.ModuleContext.get_backend = original


def compile_for_topology(lowered: jax.stages.Lowered, device: Any, env_overrides=()) -> Any:
  """Compiles a lowered computation for one compile-only device of a topology.

  jax 0.10's public ``Lowered.compile()`` compiles with the backend the arrays were on (the CPU);
  compiling for a topology's device needs its client. Checked for jax 0.10.2.

  Args:
    lowered: ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``.
    device: a device of ``jax.experimental.topologies.get_topology_desc(...)``.
    env_overrides: ``(name, value)`` pairs of XLA debug options, values typed as XLA expects
      (bool, int or str), e.g. ``("xla_gpu_enable_latency_hiding_scheduler", True)``.

  Returns:
    The loaded executable (``get_compiled_memory_stats()``, ``hlo_modules()``).
  """
  from jax._src.lib import _jax  # DeviceList: jaxlib-private since 0.4.3x
  from jax._src.lib import xla_client  # CompileOptions

  options = xla_client.CompileOptions()
  if env_overrides:
    options.env_option_overrides = [(str(k), v) for k, v in env_overrides]
  return device.client.compile(
    lowered.compiler_ir("stablehlo"),
    executable_devices=_jax.DeviceList((device,)),
    compile_options=options,
  )
