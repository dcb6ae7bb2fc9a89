"""Estimates for `offload` before a run: bytes per tier, whether they fit, and a step-time bound.

Like DeepSpeed's memory estimators, plus time. Pure arithmetic on a parameter count or on parameter
shapes (no array is allocated); `measure_bandwidths` is the one function that touches hardware. The
``python -m optax_offload plan`` command prints `estimate`'s report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import layout as layout_lib
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src.plan import format_bytes
from optax_offload._src.plan import parse_bytes

DEFAULT_LINK_BANDWIDTH = 25e9
"""Host<->device bytes per second, one direction at a time: about PCIe 4.0 x16 (32 GB/s raw)."""

DEFAULT_NVME_READ_BANDWIDTH = 3e9
"""NVMe sequential read, bytes per second: a PCIe 3.0 x4 / entry PCIe 4.0 drive."""

DEFAULT_NVME_WRITE_BANDWIDTH = 2e9
"""NVMe sequential write with an fsync per step, bytes per second."""

DEFAULT_HOST_MEMORY_BANDWIDTH = 40e9
"""Host memory bytes per second that a CPU optimizer update streams (``update_on="host"``)."""

NVME_DISK_FACTOR = 4
"""Disk space per byte of NVMe-tier state: the store keeps the last two committed generations and
writes up to two more (see `NvmeStore`); 3 suffices when commits keep up with writes."""

NVME_BUFFER_GROUPS = 3
"""Host buffers of the NVMe tier, in groups: one prefetched, one written behind, one in flight."""

_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

_DTYPES = {
  "fp32": "float32",
  "f32": "float32",
  "float32": "float32",
  "bf16": "bfloat16",
  "bfloat16": "bfloat16",
  "fp16": "float16",
  "f16": "float16",
  "float16": "float16",
  "fp64": "float64",
  "f64": "float64",
  "float64": "float64",
  "fp8": "float8_e4m3fn",
}
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclasses.dataclass(frozen=True)
class _Optimizer:
  factory: Callable[[], optax.GradientTransformation]
  slots: int  # parameter-shaped state arrays per parameter leaf
  state: str  # what the slots are, for the report


OPTIMIZERS: dict[str, _Optimizer] = {
  "sgd": _Optimizer(lambda: optax.sgd(1e-3), 0, "no state"),
  "sgd-momentum": _Optimizer(lambda: optax.sgd(1e-3, momentum=0.9), 1, "momentum"),
  "adam": _Optimizer(lambda: optax.adam(1e-3), 2, "mu, nu"),
  "adamw": _Optimizer(lambda: optax.adamw(1e-3), 2, "mu, nu"),
  "nadam": _Optimizer(lambda: optax.nadam(1e-3), 2, "mu, nu"),
  "nadamw": _Optimizer(lambda: optax.nadamw(1e-3), 2, "mu, nu"),
  "adamax": _Optimizer(lambda: optax.adamax(1e-3), 2, "mu, nu"),
  "amsgrad": _Optimizer(lambda: optax.amsgrad(1e-3), 3, "mu, nu, nu_max"),
  "adabelief": _Optimizer(lambda: optax.adabelief(1e-3), 2, "mu, nu"),
  "lamb": _Optimizer(lambda: optax.lamb(1e-3), 2, "mu, nu"),
  "lion": _Optimizer(lambda: optax.lion(1e-3), 1, "mu"),
  "rmsprop": _Optimizer(lambda: optax.rmsprop(1e-3), 1, "nu"),
  "adagrad": _Optimizer(lambda: optax.adagrad(1e-3), 1, "sum of squares"),
  "lars": _Optimizer(lambda: optax.lars(1e-3), 1, "momentum"),
  # Factored second moments: a row and a column vector per matrix. Counted as no per-parameter
  # state for a bare count; pass shapes for the exact bytes.
  "adafactor": _Optimizer(lambda: optax.adafactor(1e-3), 0, "factored second moments"),
}
"""Optimizers known by name: optax's alias and its parameter-shaped state arrays per parameter."""


def parse_count(value: int | float | str, name: str = "params") -> int:
  """Parses a parameter count such as ``7e9``, ``"7B"``, ``"1.3b"`` or ``"350M"``.

  Suffixes are decimal: K (thousand), M (million), B or G (billion), T (trillion). ``B`` means
  billions of parameters here, not bytes.

  Args:
    value: an int, a float or a string.
    name: the argument's name, for error messages.

  Returns:
    The count, at least 1.

  Raises:
    ValueError: for an unparseable or non-positive count.

  Examples:
    >>> parse_count("7B"), parse_count("350M"), parse_count(1.3e9), parse_count("7_000")
    (7000000000, 350000000, 1300000000, 7000)
  """
  if isinstance(value, bool) or not isinstance(value, int | float | str):
    raise ValueError(f"{name} must be a parameter count like 7e9 or '7B', got {value!r}.")
  if isinstance(value, str):
    match = _COUNT_RE.match(value.replace("_", "").replace(",", ""))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _COUNT_UNITS:
      raise ValueError(
        f"Could not parse {name}={value!r}: use a parameter count such as 7e9, 7B, 1.3B or 350M "
        "(K, M, B/G, T are thousands, millions, billions, trillions of parameters)."
      )
    value = float(match.group(1)) * _COUNT_UNITS[unit]
  count = round(value)
  if not math.isfinite(value) or count < 1:
    raise ValueError(f"{name} must be a positive parameter count, got {value!r}.")
  return count


def parse_dtype(value: Any, name: str = "param_dtype") -> np.dtype:
  """Parses a dtype given as ``"bf16"``, ``"fp32"``, ``jnp.bfloat16``, ... .

  Examples:
    >>> parse_dtype("bf16"), parse_dtype(jnp.float32)
    (dtype(bfloat16), dtype('float32'))
  """
  if isinstance(value, str):
    value = _DTYPES.get(value.lower(), value)
  try:
    return jnp.dtype(value)
  except TypeError:
    raise ValueError(
      f"Unknown {name} {value!r}: use one of {', '.join(sorted(set(_DTYPES)))} or a numpy dtype name."
    ) from None


def _dtype_name(dtype: np.dtype) -> str:
  return _SHORT_DTYPE.get(dtype.name, dtype.name)


@dataclasses.dataclass(frozen=True)
class Bandwidths:
  """Bytes per second of the links a step uses.

  Attributes:
    link: host<->device, one direction at a time (``--measure`` times a copy each way).
    nvme_read: NVMe sequential read.
    nvme_write: NVMe sequential write, made durable (fsync) once per step.
    host_memory: host memory streamed by a CPU-side update (``update_on="host"``).
    measured: the fields that were measured (the others are defaults or given).
    note: where the measured numbers come from.
  """

  link: float = DEFAULT_LINK_BANDWIDTH
  nvme_read: float = DEFAULT_NVME_READ_BANDWIDTH
  nvme_write: float = DEFAULT_NVME_WRITE_BANDWIDTH
  host_memory: float = DEFAULT_HOST_MEMORY_BANDWIDTH
  measured: tuple[str, ...] = ()
  note: str = ""

  def __post_init__(self):
    for f in ("link", "nvme_read", "nvme_write", "host_memory"):
      v = getattr(self, f)
      if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
        raise ValueError(
          f"Bandwidths.{f} must be a positive number of bytes per second, got {v!r}."
        )


@dataclasses.dataclass(frozen=True)
class Shortfall:
  """A tier that does not fit.

  Attributes:
    tier: ``"device"``, ``"host"`` or ``"nvme"``.
    needed: bytes the tier needs.
    available: bytes it has.
    advice: which setting to change.
  """

  tier: str
  needed: int
  available: int
  advice: str

  @property
  def missing(self) -> int:
    """Bytes missing."""
    return self.needed - self.available


@dataclasses.dataclass(frozen=True)
class Estimate:
  """What `offload` will put where, whether it fits, and the fastest a step can be.

  All sizes are bytes per process, unsharded. ``str(estimate)`` is the report that
  ``python -m optax_offload plan`` prints.

  Attributes:
    params: number of parameters.
    param_dtype: parameter (and gradient) dtype; ``"mixed"`` for a tree of several dtypes.
    optimizer: the optimizer's name.
    state_dtype: dtype of the optimizer's state (the master dtype when there is a master copy).
    master_dtype: dtype of the offloaded master copy of the parameters, or None.
    update_on: ``"device"`` or ``"host"``.
    device_memory: device memory given, or None (not checked).
    host_limit: pinned-host budget given, or None (no limit).
    nvme: whether an NVMe tier is available.
    nvme_capacity: disk bytes available to the NVMe tier, or None (not checked).
    window_bytes: the window `offload` would use.
    param_bytes: bytes of the parameters, on the device.
    grad_bytes: bytes of the gradients, on the device.
    device_state_bytes: optimizer state that stays on the device (small leaves, step count).
    window_peak: offloaded state resident on the device at once during the update.
    activation_bytes: activations and workspace, as given (not estimated).
    master_bytes: bytes of the master copy (part of the offloaded state).
    host_bytes: offloaded state in pinned host memory.
    nvme_bytes: offloaded state on NVMe (one generation).
    nvme_buffer_bytes: host RAM the NVMe tier uses for staging (prefetch and write-behind).
    link_bytes: bytes that cross the host<->device link per step.
    bandwidths: the bandwidths the step time uses.
    leaves: per-leaf infos when shapes were given, else None.
    plan: `make_plan`'s plan when shapes were given, else None.
  """

  params: int
  param_dtype: str
  optimizer: str
  state_dtype: str
  master_dtype: str | None
  update_on: str
  device_memory: int | None
  host_limit: int | None
  nvme: bool
  nvme_capacity: int | None
  window_bytes: int
  param_bytes: int
  grad_bytes: int
  device_state_bytes: int
  window_peak: int
  activation_bytes: int
  master_bytes: int
  host_bytes: int
  nvme_bytes: int
  nvme_buffer_bytes: int
  link_bytes: int
  bandwidths: Bandwidths
  leaves: tuple[plan_lib.LeafInfo, ...] | None = dataclasses.field(default=None, repr=False)
  plan: plan_lib.Plan | None = dataclasses.field(default=None, repr=False)

  @property
  def offloaded_bytes(self) -> int:
    """Optimizer state (and master copy) off the device: host plus NVMe."""
    return self.host_bytes + self.nvme_bytes

  @property
  def device_bytes(self) -> int:
    """Peak device memory: params, grads, on-device state, the window and activations."""
    return (
      self.param_bytes
      + self.grad_bytes
      + self.device_state_bytes
      + self.window_peak
      + self.activation_bytes
    )

  @property
  def nvme_disk_bytes(self) -> int:
    """Disk space the NVMe tier needs: `NVME_DISK_FACTOR` generations."""
    return NVME_DISK_FACTOR * self.nvme_bytes

  @property
  def bytes_per_tier(self) -> dict[str, int]:
    """``{"device": ..., "host": ..., "nvme": ...}``, like `footprint` (device: peak, all of it)."""
    return {"device": self.device_bytes, "host": self.host_bytes, "nvme": self.nvme_bytes}

  @property
  def shortfalls(self) -> tuple[Shortfall, ...]:
    """The tiers that do not fit, with the bytes missing and what to change."""
    out = []
    if self.device_memory is not None and self.device_bytes > self.device_memory:
      out.append(Shortfall("device", self.device_bytes, self.device_memory, self._device_advice()))
    if self.host_limit is not None and not self.nvme and self.host_bytes > self.host_limit:
      out.append(
        Shortfall(
          "host",
          self.host_bytes,
          self.host_limit,
          f"raise host_limit (--host-limit) to at least {format_bytes(self.host_bytes)}, or give "
          "an NVMe tier (--nvme-dir) for the rest.",
        )
      )
    if self.nvme_capacity is not None and self.nvme_disk_bytes > self.nvme_capacity:
      out.append(
        Shortfall(
          "nvme",
          self.nvme_disk_bytes,
          self.nvme_capacity,
          f"the NVMe tier keeps up to {NVME_DISK_FACTOR} generations of "
          f"{format_bytes(self.nvme_bytes)}: free disk space, point --nvme-dir at a larger disk "
          "(or pass a larger --nvme-size), or raise --host-limit.",
        )
      )
    return tuple(out)

  @property
  def fits(self) -> bool:
    """Whether every checked tier fits."""
    return not self.shortfalls

  def _device_advice(self) -> str:
    missing = self.device_bytes - (self.device_memory or 0)
    fixed = self.device_bytes - self.window_peak
    if self.window_peak > missing and fixed < (self.device_memory or 0):
      return (
        f"lower window_bytes (--window-bytes) to at most {format_bytes(self.window_peak - missing)}"
        " (more, smaller groups: the same bytes move, in more transfers)."
      )
    what = (
      "params, grads, activations and on-device state"
      if self.activation_bytes
      else ("params, grads and on-device state")
    )
    return (
      f"{what} alone take {format_bytes(fixed)}, and optax_offload moves only optimizer state off "
      f"the device: use a device with more than that plus a window (e.g. {format_bytes(fixed + (1 << 30))}"
      " with --window-bytes 1GiB) (--device-memory), shard the params over more devices, or train "
      "fewer parameters."
    )

  @property
  def step_times(self) -> dict[str, float]:
    """Seconds per step that each resource needs at its bandwidth, forward and backward excluded."""
    bw = self.bandwidths
    host_s = 0.0
    if self.update_on == "host":
      host_s = (2 * self.offloaded_bytes + self.link_bytes) / bw.host_memory
    return {
      "link": self.link_bytes / bw.link,
      "nvme_read": self.nvme_bytes / bw.nvme_read,
      "nvme_write": self.nvme_bytes / bw.nvme_write,
      "host_update": host_s,
    }

  @property
  def step_time_lower_bound(self) -> float:
    """Seconds: the busiest resource, assuming transfers, disk and update overlap perfectly.

    The disk reads and writes share one drive, so they add up.
    """
    t = self.step_times
    return max(t["link"], t["nvme_read"] + t["nvme_write"], t["host_update"])

  @property
  def bottleneck(self) -> str:
    """The resource that sets `step_time_lower_bound`."""
    t = self.step_times
    candidates = {
      "host<->device link": t["link"],
      "NVMe": t["nvme_read"] + t["nvme_write"],
      "host update": t["host_update"],
    }
    return max(candidates, key=candidates.get)

  def to_dict(self) -> dict[str, Any]:
    """A JSON-ready dict of every number in the report."""
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("leaves", "plan", "bandwidths")
    }
    out.update(
      offloaded_bytes=self.offloaded_bytes,
      device_bytes=self.device_bytes,
      nvme_disk_bytes=self.nvme_disk_bytes,
      bytes_per_tier=self.bytes_per_tier,
      fits=self.fits,
      shortfalls=[dict(dataclasses.asdict(s), missing=s.missing) for s in self.shortfalls],
      step_times=self.step_times,
      step_time_lower_bound=self.step_time_lower_bound,
      bottleneck=self.bottleneck,
      bandwidths=dataclasses.asdict(self.bandwidths),
      groups=None if self.plan is None else len(self.plan.groups),
    )
    return out

  def __str__(self) -> str:
    return _report(self)


def _gbps(x: float) -> str:
  return f"{x / 1e9:.1f} GB/s"


def _report(e: Estimate) -> str:
  fmt = format_bytes
  master = f", {e.master_dtype} master copy" if e.master_dtype else ""
  shapes = "" if e.plan is None else f" in {len(e.leaves)} leaves"
  lines = [
    f"optax_offload plan: {e.params:,} params ({e.param_dtype}){shapes}, {e.optimizer} with "
    f"{e.state_dtype} state{master}, update on {e.update_on}",
    "",
  ]
  if e.plan is None:
    opt = OPTIMIZERS.get(e.optimizer)
    state_per = (e.offloaded_bytes - e.master_bytes) / e.params
    parts = [f"{e.master_bytes / e.params:g} B master"] if e.master_bytes else []
    parts.append(f"{state_per:g} B {e.optimizer}" + (f" ({opt.state})" if opt else ""))
    lines.append(
      f"per parameter: {e.param_bytes / e.params:g} B param + {e.grad_bytes / e.params:g} B grad on "
      f"device; {e.offloaded_bytes / e.params:g} B offloaded: {' + '.join(parts)}"
    )
  lines += ["", f"{'tier':<8}{'bytes':>12}  holds"]
  device_parts = [f"params {fmt(e.param_bytes)}", f"grads {fmt(e.grad_bytes)}"]
  if e.window_peak:
    device_parts.append(f"window {fmt(e.window_peak)} (window_bytes {fmt(e.window_bytes)})")
  if e.device_state_bytes:
    device_parts.append(f"small-leaf state {fmt(e.device_state_bytes)}")
  if e.activation_bytes:
    device_parts.append(f"activations {fmt(e.activation_bytes)}")
  else:
    device_parts.append("activations not included")
  limit = "(no --host-limit)" if e.host_limit is None else f"up to --host-limit {fmt(e.host_limit)}"
  host_note = f"offloaded state {limit}"
  if e.nvme_buffer_bytes:
    host_note += f"; plus {fmt(e.nvme_buffer_bytes)} of NVMe staging buffers"
  if e.nvme:
    nvme_note = (
      f"offloaded state beyond the host limit; disk needed {fmt(e.nvme_disk_bytes)} "
      f"({NVME_DISK_FACTOR} generations)"
    )
  else:
    nvme_note = "no NVMe tier (--nvme-dir / --nvme-size)"
  for tier, nbytes, note in (
    ("device", e.device_bytes, " + ".join(device_parts)),
    ("host", e.host_bytes, host_note),
    ("nvme", e.nvme_bytes, nvme_note),
  ):
    lines.append(f"{tier:<8}{fmt(nbytes):>12}  {note}")
  master_note = f", incl. the master copy ({fmt(e.master_bytes)})" if e.master_bytes else ""
  lines.append(f"offloaded in all: {fmt(e.offloaded_bytes)}{master_note}")
  if e.plan is not None:
    counts = {t.value: sum(t is u for u in e.plan.tiers) for t in plan_lib.Tier}
    lines.append(
      f"leaves: {counts['device']} on device (< min_size), {counts['host']} host, "
      f"{counts['nvme']} nvme; {len(e.plan.groups)} groups"
    )
  warning = plan_lib.pinned_pool_warning(e.host_bytes)
  if warning:
    lines.append(f"on GPU (one device): {warning}")
  lines.append("")
  checks = []
  if e.device_memory is None:
    checks.append("device not checked (pass --device-memory)")
  if e.nvme and e.nvme_capacity is None:
    checks.append("disk space not checked (pass --nvme-size)")
  if e.fits:
    lines.append("fits: yes" + (f" ({'; '.join(checks)})" if checks else ""))
    if e.device_memory is not None:
      lines.append(f"  device: {fmt(e.device_bytes)} of {fmt(e.device_memory)}")
  else:
    lines.append("fits: NO" + (f" ({'; '.join(checks)})" if checks else ""))
    for s in e.shortfalls:
      lines.append(
        f"  {s.tier}: needs {fmt(s.needed)} but has {fmt(s.available)}: "
        f"{fmt(s.missing)} ({s.missing} bytes) missing; {s.advice}"
      )
  t, bw = e.step_times, e.bandwidths
  lines += [
    "",
    f"step time lower bound: {e.step_time_lower_bound:.3f} s ({e.bottleneck}; forward and backward "
    "excluded, transfers overlapped perfectly)",
  ]
  if e.update_on == "device":
    link_what = "each offloaded byte to the device and back"
  else:
    link_what = "grads to the host, updates back"
  lines.append(
    f"  link       {fmt(e.link_bytes):>12} / {_gbps(bw.link)} = {t['link']:.3f} s  ({link_what})"
  )
  if e.nvme_bytes:
    lines.append(
      f"  nvme read  {fmt(e.nvme_bytes):>12} / {_gbps(bw.nvme_read)} = {t['nvme_read']:.3f} s"
    )
    lines.append(
      f"  nvme write {fmt(e.nvme_bytes):>12} / {_gbps(bw.nvme_write)} = {t['nvme_write']:.3f} s"
    )
  if e.update_on == "host":
    touched = 2 * e.offloaded_bytes + e.link_bytes
    lines.append(
      f"  host update {fmt(touched):>11} / {_gbps(bw.host_memory)} = {t['host_update']:.3f} s "
      "(state read and written, grads read, updates written)"
    )
  if bw.measured:
    lines.append(f"  measured: {', '.join(bw.measured)}" + (f" ({bw.note})" if bw.note else ""))
  else:
    lines.append("  bandwidths: defaults or given; --measure times this machine")
  return "\n".join(lines)


def _free_disk(path: str | os.PathLike) -> int:
  """Free bytes on the file system of `path`, or of its nearest existing parent."""
  p = os.path.abspath(os.fspath(path))
  while not os.path.exists(p):
    parent = os.path.dirname(p)
    if parent == p:
      break
    p = parent
  return shutil.disk_usage(p).free


def _param_tree(params: Any) -> Any:
  """The parameter tree of `params`: a Flax NNX module's `nnx.Param` state, or `params` itself."""
  module = type(params).__module__
  if module.startswith("flax"):
    from flax import nnx

    if isinstance(params, nnx.Module):
      return nnx.state(params, nnx.Param)
  return params


def _nbytes(x: Any) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def estimate(
  params: Any,
  *,
  optimizer: str | optax.GradientTransformation = "adamw",
  param_dtype: Any = "fp32",
  master_dtype: Any = None,
  update_on: str = "device",
  device_memory: int | str | None = None,
  host_limit: int | str | None = None,
  nvme_dir: str | os.PathLike | None = None,
  nvme_size: int | str | None = None,
  min_size: int = 4096,
  window_bytes: int | str | None = None,
  activation_bytes: int | str = 0,
  bandwidths: Bandwidths | None = None,
) -> Estimate:
  """Estimates the bytes per tier and the step time of `offload` for a model, without running it.

  The device keeps the parameters and gradients (in ``param_dtype``), the state of leaves smaller
  than `min_size`, and during the update up to `window_bytes` of offloaded state. The rest of the
  optimizer state, and the master copy when ``master_dtype`` is set and wider than the parameter
  dtype, is offloaded: to pinned host memory up to `host_limit`, the rest to NVMe.

  For a bare parameter count the model is one aggregate: every parameter is in a leaf of at least
  `min_size` elements (in a transformer, LayerNorm scales and biases are well under 0.1% of the
  parameters) and the host takes exactly `host_limit` bytes, the NVMe tier the rest; `make_plan`
  assigns whole leaves, so a real plan puts up to one leaf more on NVMe. Given shapes (a tree of
  arrays or `jax.ShapeDtypeStruct`, or a Flax NNX module), the optimizer's state is built abstractly
  with `jax.eval_shape` and each leaf placed by `make_plan`, exactly as `offload` does.

  Step time: with ``update_on="device"`` every offloaded byte crosses the host<->device link twice
  per step (to the device and back); with ``"host"`` the gradients go to the host and the updates
  (in ``master_dtype`` when set) come back, and the CPU streams the state through memory. NVMe-tier bytes are read and
  written once per step. The lower bound is the busiest resource with everything overlapped;
  the forward and backward passes are not included.

  Args:
    params: a parameter count (``7e9``, ``"7B"``), a tree of arrays or `jax.ShapeDtypeStruct`, or a
      Flax NNX module (its `nnx.Param` state; for Linen pass ``variables["params"]``, e.g. from
      ``jax.eval_shape(model.init, ...)``).
    optimizer: a name in `OPTIMIZERS` (``"adamw"``, ``"sgd-momentum"``, ``"lion"``, ...) or, with
      shapes, any optax transformation.
    param_dtype: dtype of parameters and gradients for a bare count (``"bf16"``, ``"fp32"``, ...);
      a tree's leaves carry their own.
    master_dtype: dtype of an offloaded master copy of lower-precision parameters (``"fp32"``), or
      None. The optimizer's state then has this dtype.
    update_on: ``"device"`` or ``"host"``, as in `offload`.
    device_memory: device memory available to JAX (bytes or ``"24GiB"``), or None not to check it.
      On GPU, JAX preallocates 75% of the card unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says
      otherwise.
    host_limit: pinned-host budget for the offloaded state, or None for no limit.
    nvme_dir: directory of the NVMe tier, or None; its free disk space is checked unless
      `nvme_size` is given.
    nvme_size: disk bytes for the NVMe tier; gives an NVMe tier even without `nvme_dir`.
    min_size: leaves with fewer elements keep their state on the device.
    window_bytes: the update window; default, as in `offload`: 10% of `device_memory`, else 1 GiB.
    activation_bytes: activations and workspace to add to the device total (not estimated).
    bandwidths: link and disk bandwidths; default `Bandwidths()` (see `measure_bandwidths`).

  Returns:
    An `Estimate`; ``print(estimate)`` shows the report.

  Raises:
    ValueError: for a bad argument.

  Examples:
    >>> import optax_offload as oo
    >>> e = oo.estimate("7B", param_dtype="bf16", optimizer="adamw", master_dtype="fp32",
    ...                 host_limit="64GiB", nvme_size="1TB")
    >>> e.host_bytes, e.nvme_bytes  # 12 bytes per param: fp32 master, mu and nu
    (68719476736, 15280523264)
    >>> round(e.step_time_lower_bound, 2), e.bottleneck  # 15.3 GB read at 3 GB/s, written at 2
    (12.73, 'NVMe')

    With shapes, every leaf is placed by `make_plan`:

    >>> import jax, jax.numpy as jnp
    >>> shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    >>> e = oo.estimate(shapes, optimizer="adam")
    >>> e.host_bytes, e.device_state_bytes  # mu and nu of w; b's state (and the count) on device
    (8388608, 8196)
  """
  if update_on not in ("device", "host"):
    raise ValueError(f"update_on must be 'device' or 'host', got {update_on!r}.")
  if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f"min_size must be an int >= 0 (number of elements), got {min_size!r}.")
  device_memory = parse_bytes(device_memory, "device_memory")
  host_limit = parse_bytes(host_limit, "host_limit")
  nvme_size = parse_bytes(nvme_size, "nvme_size")
  window = parse_bytes(window_bytes, "window_bytes")
  activations = parse_bytes(activation_bytes, "activation_bytes") or 0
  if window == 0:
    raise ValueError("window_bytes must be > 0; pass None for the default.")
  if window is None:
    window = (
      int(device_memory * plan_lib.DEFAULT_WINDOW_FRACTION)
      if device_memory
      else plan_lib.FALLBACK_WINDOW_BYTES
    )
  master = None if master_dtype is None else parse_dtype(master_dtype, "master_dtype")
  if master is not None and not jnp.issubdtype(master, jnp.floating):
    raise ValueError(f"master_dtype must be a floating dtype, got {master}.")
  nvme = nvme_dir is not None or nvme_size is not None
  capacity = nvme_size
  if capacity is None and nvme_dir is not None:
    capacity = _free_disk(nvme_dir)
  if bandwidths is None:
    bandwidths = Bandwidths()

  if isinstance(optimizer, str):
    key = optimizer.lower().replace("_", "-")
    key = {"momentum": "sgd-momentum"}.get(key, key)
    if key not in OPTIMIZERS:
      raise ValueError(f"Unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}.")
    opt_name, opt = key, OPTIMIZERS[key]
  elif isinstance(optimizer, optax.GradientTransformation):
    opt_name, opt = "custom", None
  else:
    raise ValueError(
      f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or an optax transformation, got "
      f"{type(optimizer).__name__}."
    )

  common = dict(
    optimizer=opt_name,
    master_dtype=None if master is None else _dtype_name(master),
    update_on=update_on,
    device_memory=device_memory,
    host_limit=host_limit,
    nvme=nvme,
    nvme_capacity=capacity,
    window_bytes=window,
    activation_bytes=activations,
    bandwidths=bandwidths,
  )
  if isinstance(params, int | float | str) and not isinstance(params, bool):
    if opt is None:
      raise ValueError(
        "A custom optax transformation needs parameter shapes: pass a tree of arrays or "
        "jax.ShapeDtypeStruct, or an optimizer name for a bare count."
      )
    return _estimate_count(parse_count(params), parse_dtype(param_dtype), master, opt, common)
  tx = optimizer if opt is None else opt.factory()
  return _estimate_tree(_param_tree(params), tx, master, min_size, common)


def _needs_master(dtype: np.dtype, master: np.dtype) -> bool:
  """Whether `offload` keeps a master copy of a param of `dtype` (it is narrower than `master`)."""
  if not jnp.issubdtype(dtype, jnp.floating):
    return False
  if jnp.finfo(dtype).bits > jnp.finfo(master).bits:
    raise ValueError(
      f"master_dtype={master.name} is narrower than the params ({dtype.name}): a master copy must be "
      "at least as wide as the params, e.g. --master-dtype fp32 with bf16 params."
    )
  return jnp.finfo(dtype).bits < jnp.finfo(master).bits


def _estimate_count(n: int, dtype: np.dtype, master, opt: _Optimizer, common) -> Estimate:
  use_master = master is not None and _needs_master(dtype, master)
  state_dtype = master if use_master else dtype
  master_bytes = n * master.itemsize if use_master else 0
  offloaded = master_bytes + n * opt.slots * state_dtype.itemsize
  host_limit, window = common["host_limit"], common["window_bytes"]
  host, nvme = offloaded, 0
  if host_limit is not None and offloaded > host_limit and common["nvme"]:
    host, nvme = host_limit, offloaded - host_limit
  on_device = common["update_on"] == "device"
  param_bytes = n * dtype.itemsize
  return Estimate(
    params=n,
    param_dtype=_dtype_name(dtype),
    state_dtype=_dtype_name(state_dtype),
    param_bytes=param_bytes,
    grad_bytes=param_bytes,
    device_state_bytes=0,
    window_peak=min(window, offloaded) if on_device else 0,
    master_bytes=master_bytes,
    host_bytes=host,
    nvme_bytes=nvme,
    nvme_buffer_bytes=NVME_BUFFER_GROUPS * min(window // 2, nvme),
    # update_on="host": grads go to the host, updates (in the master dtype, if any) come back.
    link_bytes=2 * offloaded if on_device else param_bytes + n * state_dtype.itemsize,
    **common,
  )


def _estimate_tree(tree: Any, tx, master, min_size: int, common) -> Estimate:
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if not flat:
    raise ValueError("params has no leaves: pass a parameter count or a non-empty tree of shapes.")
  for path, x in flat:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(
        f"params leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array or "
        "jax.ShapeDtypeStruct."
      )
  paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in flat]
  dtypes = [jnp.dtype(x.dtype) for _, x in flat]
  sizes = [math.prod(x.shape) for _, x in flat]
  has_master = [master is not None and _needs_master(d, master) for d in dtypes]
  inner_avals = [
    jax.ShapeDtypeStruct(tuple(x.shape), master if m else d)
    for (_, x), d, m in zip(flat, dtypes, has_master)
  ]
  try:
    layout = layout_lib.StateLayout(tx, treedef)
    shared, per_leaf = layout.split(jax.eval_shape(tx.init, treedef.unflatten(inner_avals)))
  except TypeError as e:
    raise ValueError(f"Cannot estimate this optimizer's state per leaf: {e}") from e
  small = sum(_nbytes(x) for x in jax.tree.leaves(shared))
  # Which leaves `offload` may stream in row slices (the same probe it runs).
  dims = [separable.shared_dims(part, aval.shape) for part, aval in zip(per_leaf, inner_avals)]
  rows = separable.splittable(
    optax.with_extra_args_support(tx), inner_avals, per_leaf, dims, min_size, axis=0
  )
  leaves = []
  for path, size, part, aval, m, n in zip(paths, sizes, per_leaf, inner_avals, has_master, rows):
    arrays = jax.tree.leaves(part) + ([aval] if m else [])
    offloadable = sum(_nbytes(x) for x in arrays if math.prod(x.shape) >= min_size)
    small += sum(_nbytes(x) for x in arrays if math.prod(x.shape) < min_size)
    leaves.append(plan_lib.LeafInfo(path, size, offloadable, rows=n))
  kwargs = dict(min_size=min_size, window_bytes=common["window_bytes"])
  try:
    plan = plan_lib.make_plan(
      leaves, host_limit=common["host_limit"], nvme=common["nvme"], **kwargs
    )
  except ValueError:  # over host_limit without NVMe: report the shortfall instead
    plan = plan_lib.make_plan(leaves, host_limit=None, nvme=False, **kwargs)
  group_bytes = plan.group_bytes(leaves)
  pairs = [a + b for a, b in zip(group_bytes, group_bytes[1:])] or group_bytes
  nvme_groups = [
    sum(leaves[i].state_bytes for i in g if plan.tiers[i] is plan_lib.Tier.NVME)
    for g in plan.groups
  ]
  offloaded = [plan.tiers[i] is not plan_lib.Tier.DEVICE for i in range(len(leaves))]
  param_bytes = sum(s * d.itemsize for s, d in zip(sizes, dtypes))
  # update_on="host": grads go to the host, updates (in the master dtype, if any) come back.
  host_link_bytes = sum(
    s * (d.itemsize + (master.itemsize if m else d.itemsize))
    for s, d, m, o in zip(sizes, dtypes, has_master, offloaded)
    if o
  )
  on_device = common["update_on"] == "device"
  state_dtypes = {jnp.dtype(x.dtype) for part in per_leaf for x in jax.tree.leaves(part)} or set(
    a.dtype for a in inner_avals
  )
  return Estimate(
    params=sum(sizes),
    param_dtype=_dtype_name(dtypes[0]) if len(set(dtypes)) == 1 else "mixed",
    state_dtype=_dtype_name(state_dtypes.pop()) if len(state_dtypes) == 1 else "mixed",
    param_bytes=param_bytes,
    grad_bytes=param_bytes,
    device_state_bytes=small + plan.bytes_per_tier["device"],
    window_peak=max(pairs, default=0) if on_device else 0,
    master_bytes=sum(
      s * master.itemsize for s, m, o in zip(sizes, has_master, offloaded) if m and o
    ),
    host_bytes=plan.bytes_per_tier["host"],
    nvme_bytes=plan.bytes_per_tier["nvme"],
    nvme_buffer_bytes=NVME_BUFFER_GROUPS * max(nvme_groups, default=0),
    link_bytes=(
      2 * (plan.bytes_per_tier["host"] + plan.bytes_per_tier["nvme"])
      if on_device
      else host_link_bytes
    ),
    leaves=tuple(leaves),
    plan=plan,
    **common,
  )


def measure_bandwidths(
  nvme_dir: str | os.PathLike | None = None,
  *,
  nbytes: int | str = "256MiB",
  repeats: int = 3,
  base: Bandwidths | None = None,
) -> Bandwidths:
  """Times this machine's host<->device link and, given a directory, its disk.

  Link: `jax.device_put` of an ``nbytes`` array from device memory to ``pinned_host`` and back, on
  the first device, best of `repeats`. On the CPU backend this is a memory copy, not a PCIe link.
  Disk: writes an ``nbytes`` temporary file in `nvme_dir` and fsyncs it, drops it from the page
  cache (``posix_fadvise``), reads it back, and deletes it. A file system that keeps the data in
  memory (tmpfs) reports memory speed.

  Args:
    nvme_dir: the NVMe tier's directory (created if missing), or None to measure the link only.
    nbytes: bytes per transfer and size of the temporary file.
    repeats: link transfers timed; the fastest counts.
    base: bandwidths for what is not measured; default `Bandwidths()`.

  Returns:
    `Bandwidths` with the measured fields replaced.

  Examples:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as nvme_dir:
    ...   bw = measure_bandwidths(nvme_dir, nbytes="4MiB", repeats=1)
    >>> bw.measured
    ('link', 'nvme_read', 'nvme_write')
  """
  n = parse_bytes(nbytes, "nbytes")
  if not n:
    raise ValueError("nbytes must be > 0.")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")
  base = base or Bandwidths()
  values: dict[str, float] = {}
  notes = []
  device = jax.local_devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  if "pinned_host" in kinds:
    x = jax.device_put(jnp.ones(max(n // 4, 1), jnp.float32), device)
    on_device = x.sharding
    on_host = on_device.with_memory_kind("pinned_host")
    jax.device_put(jax.device_put(x, on_host), on_device).block_until_ready()  # warm up
    best = math.inf
    for _ in range(repeats):
      t0 = time.perf_counter()
      h = jax.device_put(x, on_host).block_until_ready()
      jax.device_put(h, on_device).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    values["link"] = 2 * x.nbytes / best
    notes.append(f"link: {format_bytes(x.nbytes)} each way on {device.platform}")
  else:
    notes.append(f"link not measured: {device.platform} has no pinned_host memory")
  if nvme_dir is not None:
    os.makedirs(nvme_dir, exist_ok=True)
    read, write = _measure_disk(os.fspath(nvme_dir), n)
    values.update(nvme_read=read, nvme_write=write)
    notes.append(f"disk: {format_bytes(n)} file in {os.path.abspath(nvme_dir)}")
  else:
    notes.append("disk not measured: no NVMe directory")
  return dataclasses.replace(
    base,
    **values,
    measured=tuple(k for k in ("link", "nvme_read", "nvme_write") if k in values),
    note="; ".join(notes),
  )


def _measure_disk(directory: str, nbytes: int) -> tuple[float, float]:
  """(read, write) bytes per second of a file of `nbytes` in `directory`, written and fsynced."""
  chunk = min(nbytes, 16 << 20)
  block = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
  fd, path = tempfile.mkstemp(prefix=".optax_offload_measure_", dir=directory)
  try:
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
      left -= os.write(fd, block[: min(left, chunk)])
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    if hasattr(os, "posix_fadvise"):
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.lseek(fd, 0, os.SEEK_SET)
    buf = bytearray(chunk)
    t0 = time.perf_counter()
    while os.readv(fd, [buf]) > 0:
      pass
    read_s = time.perf_counter() - t0
  finally:
    os.close(fd)
    os.unlink(path)
  return nbytes / max(read_s, 1e-9), nbytes / max(write_s, 1e-9)
