"""Estimates for `offload` before a run: bytes per tier, whether they fit, and a step-time bound.

Like DeepSpeed's memory estimators, plus time. Pure arithmetic on a parameter count or on parameter
shapes (no array is allocated). The bandwidths and the free disk space it starts from come from
`measure` (the only code that touches hardware); ``python -m optax_offload plan`` prints the report
that `report.report` renders (``str(estimate)``).

From shapes, the plan is `offload`'s own: `tree_plan.plan_tree`, the derivation offload runs at init
(tests/test_tree_plan.py holds the two to it). From a bare count, the model is one aggregate (see
`estimate`).

One host budget (``host_memory``): the stack's weights first, then its gradients or accumulators
and the NVMe tier's buffers, the optimizer state in what is left, the rest on NVMe; each item's
tier and reason is a `Placement`. That arithmetic lives in `host_budget`; this module holds the
result type and the two estimates (from a count, from shapes) behind one function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import compress
from optax_offload._src import host_budget
from optax_offload._src import layout as layout_lib
from optax_offload._src import master as master_lib
from optax_offload._src import memory
from optax_offload._src import named_optimizers
from optax_offload._src import nvme_stack
from optax_offload._src import plan as plan_lib
from optax_offload._src import report
from optax_offload._src import tree_plan
from optax_offload._src.host_budget import Placement
from optax_offload._src.measure import Bandwidths
from optax_offload._src.measure import free_disk
from optax_offload._src.measure import nearest_existing
from optax_offload._src.named_optimizers import NamedOptimizer
from optax_offload._src.plan import NVME_DISK_FACTOR
from optax_offload._src.units import check_options
from optax_offload._src.units import dtype_name
from optax_offload._src.units import format_bytes
from optax_offload._src.units import format_bytes_up
from optax_offload._src.units import parse_accumulator_dtype
from optax_offload._src.units import parse_bytes
from optax_offload._src.units import parse_count
from optax_offload._src.units import parse_dtype
from optax_offload._src.units import parse_master_dtype


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

  All sizes are bytes per process. Params and gradients count whole (unsharded); for shapes
  with shardings, the optimizer state and a layer stack in pinned host memory (its weights,
  gradients and accumulators) count what this process holds, as `footprint` does (its shards, and
  a replicated array once per local device), and the window one device's share.
  ``str(estimate)`` is the report that ``python -m optax_offload plan`` prints.

  Attributes:
    params: number of parameters.
    param_dtype: parameter (and gradient) dtype; ``"mixed"`` for a tree of several dtypes.
    optimizer: the optimizer's name.
    state_dtype: dtype of the optimizer's state (the master dtype when there is a master copy;
      ``"mixed"`` when the moments are kept narrower than the master copy).
    master_dtype: dtype of the offloaded master copy of the parameters, or None.
    moment_dtype: dtype the optimizer's moments are kept in (`with_moment_dtype`), or None.
    update_on: ``"device"`` or ``"host"``.
    weights_on: ``"device"``, or ``"host"`` when the layer stack's weights and gradients live in
      pinned host memory too (`offloaded_scan`, and `update_and_apply` streaming them), or
      ``"nvme"`` when its weights live on NVMe (`write_nvme_stack`, trained by `value_and_update`
      in the backward pass: no whole gradients).
    device_memory: device memory given, or None (not checked).
    host_limit: pinned-host budget given, or None (no limit).
    nvme: whether an NVMe tier is available.
    nvme_capacity: disk bytes available to the NVMe tier, or None (not checked).
    step_s_in_backward: where the planner kept the stack's gradients whole, the step time lower
      bound with the update in the backward pass instead, when that plan fits as well and is
      faster by 5% or more (``--update-in-backward yes``), else None.
    nvme_space_of: where `nvme_dir` does not exist yet, the nearest folder of it that does, whose
      file system's free space `nvme_capacity` is (a drive not mounted yet shows here), else None.
    nvme_free_bytes: where `nvme_dir` is given, the free space of its file system, which bounds
      `nvme_capacity` (``nvme_size`` only lowers it), else None.
    window_bytes: the window `offload` would use.
    param_bytes: bytes of the parameters on the device (with ``weights_on="host"``: the leaves
      outside the stack).
    grad_bytes: bytes of the gradients on the device (likewise).
    stack_layer_bytes: with ``weights_on="host"``, the stack's weights and gradients on the device
      at once during the forward and backward passes (a few layers); the window is used only
      after them, so the device peak counts the larger of the two.
    host_weight_bytes: bytes of the weights and gradients in pinned host memory.
    device_state_bytes: optimizer state that stays on the device (small leaves, step count).
    window_peak: offloaded state resident on the device at once during the update.
    activation_bytes: activations and workspace, as given (not estimated).
    master_bytes: bytes of the master copy (part of the offloaded state).
    host_bytes: offloaded state in pinned host memory.
    nvme_bytes: offloaded state on NVMe (one generation).
    nvme_weight_bytes: with ``weights_on="nvme"``, the stack's weights on NVMe (one generation).
    weights_on_reason: with ``weights_on="nvme"``, why the planner put them there.
    host_memory_with_weights_on_nvme: where the stack's weights do not fit in `host_memory` and
      would not on NVMe either (whose buffers need host memory too), the host memory a plan with
      them on NVMe needs (the planner moves them there itself from that budget on), else None.
    nvme_buffer_bytes: host RAM the NVMe tier's buffers take at most (groups read ahead, written
      behind and in use, and the write staging: `plan.nvme_buffer_bytes`).
    nvme_group_bytes: bytes of the largest NVMe store group (what one read or write moves).
    link_bytes: bytes that cross the host<->device link per step.
    bandwidths: the bandwidths the step time uses.
    host_memory: the pinned host memory the run may use in all (weights, gradients, state,
      staging buffers), or None (not checked).
    device_card_memory: the card's memory when `memory_fraction` was given, else None;
      `device_memory` is then the share JAX may take.
    memory_fraction: the share of the card JAX may take, or None (`device_memory` as given).
    update_in_backward: whether the stack's update runs inside the backward pass
      (`value_and_update`): its gradients never exist whole.
    update_in_backward_reason: why the planner chose (or was told) so.
    accumulate: micro-batches per optimizer step (`value_and_update`'s ``accumulate``).
    accumulator_bytes: the stack's gradient accumulators in pinned host memory.
    accumulator_dtype: their dtype (`value_and_update`'s ``accumulator_dtype``), or None without
      accumulators.
    stack_device_bytes: weights of the layer stack's leaves kept on the device (beside leaves in
      pinned host memory: a card with room for them); counted in `param_bytes`.
    stack_device_grad_bytes: what those leaves' gradients hold on the device: their accumulators
      with the update in the backward pass and several micro-batches (none whole with one), their
      gradients otherwise; counted in `grad_bytes`.
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
  weights_on: str = "device"
  nvme_group_bytes: int = 0
  stack_layer_bytes: int = 0
  host_weight_bytes: int = 0
  moment_dtype: str | None = None
  host_memory: int | None = None
  device_card_memory: int | None = None
  memory_fraction: float | None = None
  update_in_backward: bool = False
  update_in_backward_reason: str | None = None
  accumulate: int = 1
  accumulator_bytes: int = 0
  accumulator_dtype: str | None = None
  stack_device_bytes: int = 0
  stack_device_grad_bytes: int = 0
  nvme_weight_bytes: int = 0
  weights_on_reason: str | None = None
  host_memory_with_weights_on_nvme: int | None = None
  nvme_space_of: str | None = None
  nvme_free_bytes: int | None = None
  step_s_in_backward: float | None = None
  leaves: tuple[plan_lib.LeafInfo, ...] | None = dataclasses.field(default=None, repr=False)
  plan: plan_lib.Plan | None = dataclasses.field(default=None, repr=False)

  @property
  def offloaded_bytes(self) -> int:
    """Optimizer state (and master copy) off the device: host plus NVMe."""
    return self.host_bytes + self.nvme_bytes

  @property
  def device_bytes(self) -> int:
    """Peak device memory: params, grads, on-device state, the window (or, if larger, the stack's
    layers streamed during the forward and backward passes) and activations."""
    if self.update_in_backward:  # the window is used during the backward pass, beside its layers
      streamed = self.window_peak + self.stack_layer_bytes
    else:
      streamed = max(self.window_peak, self.stack_layer_bytes)
    return (
      self.param_bytes
      + self.grad_bytes
      + self.device_state_bytes
      + streamed
      + self.activation_bytes
    )

  @property
  def host_total_bytes(self) -> int:
    """Host memory the run uses in all: stack weights, gradients and accumulators, the offloaded
    state in host memory, and the NVMe tier's staging buffers."""
    return self.pinned_bytes + self.nvme_buffer_bytes

  @property
  def pinned_bytes(self) -> int:
    """The JAX arrays in pinned host memory: what JAX's GPU client's pinned pool must hold."""
    return self.host_weight_bytes + self.accumulator_bytes + self.host_bytes

  @property
  def pinned_pool_setting(self) -> str | None:
    """The environment setting a GPU run needs for `pinned_bytes`, or None when JAX's pool suffices
    (64 GiB per device, or ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` when set)."""
    if self.pinned_bytes <= plan_lib.gpu_pinned_pool():
      return None
    return f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={-(-self.pinned_bytes // 2**30)}"

  @property
  def placements(self) -> tuple[Placement, ...]:
    """What the plan put where and why, item by item (see `Placement`)."""
    return host_budget.placements(self)

  @property
  def nvme_disk_bytes(self) -> int:
    """Disk space the NVMe tier (and a stack's weights on NVMe) need: `NVME_DISK_FACTOR`
    generations."""
    return NVME_DISK_FACTOR * (self.nvme_bytes + self.nvme_weight_bytes)

  @property
  def bytes_per_tier(self) -> dict[str, int]:
    """``{"device": ..., "host": ..., "nvme": ...}``: device peak, host memory in all
    (`host_total_bytes`: pinned arrays and the NVMe tier's staging buffers), NVMe (one
    generation of the state and of a stack's weights there)."""
    return {
      "device": self.device_bytes,
      "host": self.host_total_bytes,
      "nvme": self.nvme_bytes + self.nvme_weight_bytes,
    }

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
          f"raise host_limit (--host-limit; --host-memory bounds all host memory) to at least "
          f"{format_bytes(self.host_bytes)}, or give an NVMe tier (--nvme-dir) for the rest.",
        )
      )
    if self.host_memory is not None and self.host_total_bytes > self.host_memory:
      out.append(
        Shortfall(
          "host", self.host_total_bytes, self.host_memory, host_budget.host_memory_advice(self)
        )
      )
    if self.nvme_capacity is not None and self.nvme_disk_bytes > self.nvme_capacity:
      out.append(
        Shortfall(
          "nvme",
          self.nvme_disk_bytes,
          self.nvme_capacity,
          f"the NVMe tier keeps up to {NVME_DISK_FACTOR} generations of "
          f"{format_bytes(self.nvme_bytes + self.nvme_weight_bytes)}: free disk space, point "
          + (
            "--nvme-dir at a larger disk (or pass a larger --nvme-size)"
            if self.nvme_free_bytes is None or self.nvme_capacity < self.nvme_free_bytes
            else f"--nvme-dir at a larger disk (its free space, {format_bytes(self.nvme_free_bytes)}, "
            "bounds the tier: --nvme-size only lowers it)"
          )
          + ", or raise --host-memory."
          + ("" if self.nvme_space_of is None else f" (This is {self.nvme_space_note}.)"),
        )
      )
    return tuple(out)

  @property
  def nvme_space_note(self) -> str | None:
    """Where `nvme_dir` does not exist yet, what the disk check read (for the report and the
    NVMe shortfall), else None."""
    if self.nvme_space_of is None:
      return None
    return (
      f"the free space of {self.nvme_space_of}: --nvme-dir does not exist yet; mount its drive "
      "first if it is not"
    )

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
    needed = fixed + (1 << 30)
    if self.memory_fraction is None:
      device = (
        f"more than that plus a window (e.g. {format_bytes(needed)} with --window-bytes 1GiB)"
      )
    else:  # (the card that gives JAX that share)
      card = math.ceil(needed / self.memory_fraction)
      device = (
        f"room for that plus a window (e.g. {format_bytes(needed)} with --window-bytes 1GiB: a "
        f"card of {format_bytes_up(card)} at the "
        f"{self.memory_fraction:g} JAX takes, XLA_PYTHON_CLIENT_MEM_FRACTION)"
      )
    return (
      f"{what} alone take {format_bytes(fixed)}: stream the layer stack's weights and grads from "
      "host memory too (oo.offloaded_scan; --weights-on host --layers N), use a device with "
      f"{device} (--device-memory), shard the params over more devices, or train fewer parameters."
    )

  @property
  def step_times(self) -> dict[str, float]:
    """Seconds per step that each resource needs at its bandwidth, forward and backward excluded
    (a stack's weights on NVMe are read in each forward and backward pass: twice a micro-batch,
    and written once a step)."""
    bw = self.bandwidths
    host_s = 0.0
    if self.update_on == "host":
      host_s = (2 * self.offloaded_bytes + self.link_bytes) / bw.host_memory
    weights = self.nvme_weight_bytes
    return {
      "link": self.link_bytes / bw.link,
      "nvme_read": (self.nvme_bytes + 2 * self.accumulate * weights) / bw.nvme_read,
      "nvme_write": (self.nvme_bytes + weights) / bw.nvme_write,
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
      host_total_bytes=self.host_total_bytes,
      pinned_bytes=self.pinned_bytes,
      pinned_pool=dict(
        bytes=self.pinned_bytes,
        limit=plan_lib.gpu_pinned_pool(),
        setting=self.pinned_pool_setting,
      ),
      placements=[dataclasses.asdict(p) for p in self.placements],
    )
    return out

  def __str__(self) -> str:
    return report.report(self)


def _param_tree(params: Any) -> Any:
  """The parameter tree of `params`: a Flax NNX module's `nnx.Param` state, or `params` itself."""
  module = type(params).__module__
  if module.startswith("flax"):
    from flax import nnx

    if isinstance(params, nnx.Module):
      return nnx.state(params, nnx.Param)
  return params


def _stack_leaves_on_device(tree: Any) -> frozenset[int]:
  """Indices (in leaf order) of the layer stack's leaves kept on the device: leaves not in pinned
  host memory beside a leaf that is (the same parent in the tree), with its leading (layer) axis.
  Their state streams with the stack's in the backward pass, their weights stay on the card.

  A guess from the tree (`estimate` sees no loss): a kept leaf in another sub-tree than the
  streamed ones is missed, and a leaf beside a top-level stack leaf with a leading axis of the
  same length is taken for one."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  host = {(path[:-1], x.shape[0]) for path, x in flat if _in_pinned_host(x) and len(x.shape)}
  return frozenset(
    i
    for i, (path, x) in enumerate(flat)
    if not _in_pinned_host(x) and len(x.shape) and (path[:-1], x.shape[0]) in host
  )


def _in_pinned_host(x: Any) -> bool:
  """Whether a param leaf (array or `jax.ShapeDtypeStruct`) is placed in pinned host memory."""
  return memory.is_pinned_host(getattr(x, "sharding", None))


def _nbytes(x: Any) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def _bandwidths(given: Any) -> Bandwidths:
  """`estimate`'s `bandwidths`: a `Bandwidths`, or a dict of its fields (the rest default)."""
  if given is None:
    return Bandwidths()
  if isinstance(given, Bandwidths):
    return given
  fields = [f.name for f in dataclasses.fields(Bandwidths)]
  if isinstance(given, dict) and set(given) <= set(fields):
    return Bandwidths(**given)
  raise TypeError(
    f"estimate: bandwidths={given!r}; pass oo.Bandwidths(...) or a dict of its fields "
    f"({', '.join(fields[:4])}: bytes per second)."
  )


def estimate(
  params: Any,
  *,
  optimizer: str | optax.GradientTransformation = "adamw",
  param_dtype: Any = "fp32",
  master_dtype: Any = None,
  moment_dtype: Any = None,
  update_on: str = "device",
  weights_on: str = "device",
  layers: int | None = None,
  stack_on_device: int | str | None = None,
  device_memory: int | str | None = None,
  host_limit: int | str | None = None,
  host_memory: int | str | None = None,
  update_in_backward: bool | None = None,
  accumulate: int = 1,
  accumulator_dtype: Any = "fp32",
  memory_fraction: float | None = None,
  nvme_dir: str | os.PathLike | None = None,
  nvme_size: int | str | None = None,
  nvme_options: Any = None,
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
  arrays or `jax.ShapeDtypeStruct`, or a Flax NNX module), the plan is the one `offload` makes at
  init, by the same code: the optimizer's state built abstractly with `jax.eval_shape`, leaves
  sliced in rows where the update allows it and their sharding does not cut the rows, each leaf
  placed by `make_plan`; the shapes' shardings (``sharding=`` of a `jax.ShapeDtypeStruct`, or an
  array's) are taken into account as `offload` takes the params'.

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
    moment_dtype: dtype of the optimizer's moments (``"bf16"``, ``"int8"``), as `offload`'s: the
      float state arrays shaped like their param are counted in it where it is narrower (a bare
      count: every per-parameter slot of the named optimizer); the master copy keeps
      `master_dtype`. ``"int8"``: a byte per element and 4 per block of 256 (a bare count: one
      axis, 1.0156 bytes per element; shapes: the quantized state `offload` builds).
    update_on: ``"device"`` or ``"host"``, as in `offload`.
    weights_on: ``"host"`` when the layer stack's weights and gradients live in pinned host memory
      too (`offloaded_scan` forward and backward; `update_and_apply` streams them through the
      window with the state). For a bare count every parameter is taken to be in the stack of
      `layers` layers; in a tree, the leaves whose sharding has ``memory_kind="pinned_host"`` are
      the stack (their leading axis is the layer axis), as `offload` decides. Given as ``"host"``,
      weights that do not fit in `host_memory` go to NVMe where that fits (with an NVMe tier and
      the update in the backward pass); left ``"device"`` with a tree, they stay where the tree
      places them. ``"nvme"``: the stack's weights on NVMe (`write_nvme_stack`, trained by
      `value_and_update` in the backward pass, read twice a micro-batch and written once a step).
    layers: the number of layers in the stack, for a bare count with ``weights_on="host"``.
    stack_on_device: for a bare count with ``weights_on="host"``, bytes of the stack's weights kept
      on the device (whole leaves in the model, e.g. ``"3.91GiB"`` for two attention projections
      of a 13B): out of the host budget with their accumulators, on the device with their
      gradients. With shapes, give those leaves a device sharding instead.
    device_memory: device memory available to JAX (bytes or ``"24GiB"``), or None not to check it.
      On GPU, JAX preallocates 75% of the card unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says
      otherwise.
    host_limit: pinned-host budget for the offloaded state alone (`offload`'s ``host_limit``), or
      None for no limit; prefer `host_memory`.
    host_memory: the host memory the run may use in all (bytes or ``"48GiB"``): the stack's
      weights, its gradients or accumulators, the offloaded state and the NVMe tier's staging
      buffers. What each step touches most stays in it (weights first, the state last); the state
      beyond it goes to NVMe, and with ``weights_on="host"`` the stack's weights too where they do
      not fit (gradients and accumulators on NVMe are not implemented). None: not checked.
    update_in_backward: with ``weights_on="host"``, whether the stack's update runs inside the
      backward pass (`value_and_update`: no whole gradients, the window beside the streamed
      layers); None decides: yes when the stack's weights and gradients exceed `host_memory`,
      or with the NVMe buffers (or the state) beside them where the host fits without whole
      gradients and the device no worse, or when ``accumulate > 1``.
    accumulate: micro-batches per optimizer step with the update in the backward pass: gradient
      accumulators for the stack in host memory.
    accumulator_dtype: their dtype (`value_and_update`'s ``accumulator_dtype``): ``"fp32"`` (4 B
      per parameter, as ``optax.MultiSteps``) or ``"bf16"`` (2 B).
    memory_fraction: the share of `device_memory` JAX may take, when `device_memory` is the card's
      memory (the command passes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` or JAX's 0.75); None:
      `device_memory` is what JAX may take.
    nvme_dir: directory of the NVMe tier, or None; its free disk space is checked unless
      `nvme_size` is given.
    nvme_size: disk bytes for the NVMe tier; gives an NVMe tier even without `nvme_dir`.
    nvme_options: the `NvmeOptions` (or dict) `offload` gets; its depths and I/O threads set the
      NVMe tier's host buffers.
    min_size: leaves with fewer elements keep their state on the device.
    window_bytes: the update window; default, as in `offload`: 10% of `device_memory`, else 1 GiB.
    activation_bytes: activations and workspace to add to the device total (not estimated).
    bandwidths: link and disk bandwidths, a `Bandwidths` or a dict of its fields (bytes per
      second); default `Bandwidths()` (see `measure_bandwidths`).

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

    Moments in bf16: 8 bytes per param (fp32 master 4, mu and nu 2 each) instead of 12:

    >>> oo.estimate("7B", param_dtype="bf16", master_dtype="fp32", moment_dtype="bf16").host_bytes
    56000000000

    With shapes, every leaf is placed by `make_plan`:

    >>> import jax, jax.numpy as jnp
    >>> shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    >>> e = oo.estimate(shapes, optimizer="adam")
    >>> e.host_bytes, e.device_state_bytes  # mu and nu of w; b's state (and the count) on device
    (8388608, 8196)

    One host budget: a 13B stack in host memory on a 24 GB card with 48 GiB of RAM. The weights
    and gradients would not both fit, so the update runs in the backward pass; the state fills
    what the weights and the NVMe buffers leave:

    >>> e = oo.estimate("13B", param_dtype="bf16", master_dtype="fp32", weights_on="host",
    ...                 layers=40, device_memory="24GiB", memory_fraction=0.75,
    ...                 host_memory="48GiB", nvme_size="2TB")
    >>> e.update_in_backward, e.fits, e.bytes_per_tier["host"] <= 48 * 2**30
    (True, True, True)
    >>> [(p.what, p.tier) for p in e.placements][:2]
    [("layer stack's weights (bf16)", 'host'), ("layer stack's gradients", 'none')]
  """
  window = check_options(update_on, min_size, window_bytes)
  if weights_on not in ("device", "host", "nvme"):
    raise ValueError(f'weights_on must be "device", "host" or "nvme", got {weights_on!r}.')
  if weights_on != "device" and update_on == "host":
    raise ValueError(
      f'weights_on="{weights_on}" needs update_on="device": the update streams the weights '
      "through the window with the state."
    )
  if weights_on == "nvme" and update_in_backward is False:
    raise ValueError(
      'weights_on="nvme" needs the update in the backward pass (value_and_update trains a stack '
      "on NVMe there); drop update_in_backward=False (--update-in-backward no)."
    )
  if update_in_backward not in (None, True, False):
    raise ValueError(
      f"update_in_backward must be True, False or None (decide), got {update_in_backward!r}."
    )
  if update_in_backward is not None:  # 0, 1, numpy's bools: as the bools they equal
    update_in_backward = bool(update_in_backward)
  if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
    raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}.")
  card = parse_bytes(device_memory, "device_memory")
  fraction = None if memory_fraction is None else host_budget.check_fraction(memory_fraction)
  device_memory = card if card is None or fraction is None else int(card * fraction)
  host_limit = parse_bytes(host_limit, "host_limit")
  host_memory = parse_bytes(host_memory, "host_memory")
  nvme_size = parse_bytes(nvme_size, "nvme_size")
  activations = parse_bytes(activation_bytes, "activation_bytes") or 0
  window = tree_plan.window_bytes(window, device_memory)
  master = parse_master_dtype(master_dtype)
  moments = compress.parse_moment_dtype(moment_dtype)
  capacity, checked_at, free = nvme_size, None, None
  if nvme_dir is not None:
    path = host_budget.check_nvme_dir(nvme_dir)
    free = free_disk(path)
    capacity = free if nvme_size is None else min(nvme_size, free)
    nearest = nearest_existing(path)
    checked_at = None if nearest == os.path.abspath(path) else nearest
  opt_name, opt = named_optimizers.lookup(optimizer)
  common = dict(
    optimizer=opt_name,
    master_dtype=None if master is None else dtype_name(master),
    moment_dtype=None if moments is None else dtype_name(moments),
    update_on=update_on,
    device_memory=device_memory,
    host_limit=host_limit,
    nvme=nvme_dir is not None or nvme_size is not None,
    nvme_capacity=capacity,
    nvme_space_of=checked_at,
    nvme_free_bytes=free,
    window_bytes=window,
    activation_bytes=activations,
    bandwidths=_bandwidths(bandwidths),
  )
  held_on_nvme = False  # the params hold a layer stack on NVMe (write_nvme_stack's leaves)
  if isinstance(params, int | float | str) and not isinstance(params, bool):
    if opt is None:
      raise ValueError(
        "A custom optax transformation needs parameter shapes: pass a tree of arrays or "
        "jax.ShapeDtypeStruct, or an optimizer name for a bare count."
      )
    n, dtype = parse_count(params), parse_dtype(param_dtype)
    if n < 1000:  # as `plan` refuses a bare count below a thousand: "7" meant 7B
      raise ValueError(
        f"estimate({params!r}): a count of {n} parameters; give the model's size, e.g. 7e9 or "
        "'7B' (a model this small: pass its parameter tree)."
      )
    stack, on_device, kept_on_device = [], frozenset(), (0, 0)
    if weights_on != "device":
      if not (isinstance(layers, int) and 1 <= layers <= n):
        raise ValueError(
          f'weights_on="{weights_on}" with a parameter count needs the number of layers in the '
          f"streamed stack (layers=, --layers), got {layers!r}."
        )
      kept = parse_bytes(stack_on_device or 0, "stack_on_device") // dtype.itemsize
      if not 0 <= kept < n:
        raise ValueError(
          f"stack_on_device ({format_bytes(kept * dtype.itemsize)}) must be less than the stack's "
          f"{format_bytes(n * dtype.itemsize)} of weights: keep some of its leaves on the device, "
          "not all."
        )
      weights = (n - kept) * dtype.itemsize
      stack = [host_budget.StackLeaf(weights, layers, n - kept, weights)]
      kept_on_device = (kept * dtype.itemsize, kept)
    elif stack_on_device:
      raise ValueError('stack_on_device needs weights_on="host" (--weights-on host or nvme).')

    def base(c):
      return _estimate_count(n, dtype, master, moments, opt, c, nvme_options)

  else:
    tx = optimizer if opt is None else opt.factory()
    tree = _param_tree(params)
    flat, treedef = jax.tree.flatten(tree, is_leaf=nvme_stack.is_leaf)
    if any(map(nvme_stack.is_leaf, flat)):
      # A stack on NVMe (`write_nvme_stack`'s leaves): planned as a stack in pinned host memory,
      # with its weights on the drive.
      if weights_on == "host":
        raise ValueError(
          'weights_on="host": the params hold a layer stack on NVMe (oo.write_nvme_stack); plan '
          'it there (weights_on="nvme", the default for such params) or give the stack in '
          "pinned host memory."
        )
      if update_in_backward is False:
        raise ValueError(
          "update_in_backward=False: the params hold a layer stack on NVMe, which value_and_update "
          "trains in the backward pass only."
        )
      weights_on, held_on_nvme = "nvme", True
      tree = treedef.unflatten(nvme_stack.host_stand_ins(flat))
    derived = _derive(tree, tx, master, moments, min_size)
    stack = [
      host_budget.StackLeaf(_nbytes(x), x.shape[0], math.prod(x.shape), memory.held_bytes(x))
      for x in jax.tree.leaves(tree)
      if _in_pinned_host(x)
    ]
    if stack_on_device:
      raise ValueError(
        "stack_on_device is for a bare count; with shapes, give the stack's leaves kept on the "
        "device a device sharding (the others memory_kind='pinned_host')."
      )
    on_device = _stack_leaves_on_device(tree)
    kept_leaves = [x for i, x in enumerate(jax.tree.leaves(tree)) if i in on_device]
    kept_on_device = (sum(map(_nbytes, kept_leaves)), sum(math.prod(x.shape) for x in kept_leaves))
    if weights_on != "device" and not stack:
      raise ValueError(
        f'weights_on="{weights_on}" with shapes: give the layer stack\'s leaves a sharding with '
        'memory_kind="pinned_host" (as the params offloaded_scan streams have), e.g. '
        'jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(), memory_kind="pinned_host")).'
      )

    def base(c):
      return _estimate_tree(derived, master, c, nvme_options)

  def finished(fused: bool, why: str | None) -> Estimate:
    acc_dtype = parse_accumulator_dtype(accumulator_dtype)
    accumulators = host_budget.accumulator_bytes(stack, fused, accumulate, acc_dtype.itemsize)

    def build(state_limit, weights_to_nvme=None):
      e = base(dict(common, host_limit=state_limit))
      if stack:
        e = host_budget.with_weights_on_host(
          e,
          stack,
          fused,
          accumulate,
          accumulators,
          acc_dtype.itemsize,
          on_device,
          kept_on_device,
          nvme_options,
        )
      if weights_to_nvme is not None:
        e = host_budget.with_weights_on_nvme(e, stack, weights_to_nvme)
      return e

    on_nvme = None
    if weights_on == "nvme":
      on_nvme = (
        "the params hold them there (oo.write_nvme_stack)"
        if held_on_nvme
        else "as asked (--weights-on nvme)"
      )
    if host_memory is None:
      e = build(host_limit, on_nvme)
    elif on_nvme:
      build_nvme = functools.partial(build, weights_to_nvme=on_nvme)
      e = host_budget.fit_host_memory(build_nvme, host_memory, host_limit, [], fused, accumulators)
    else:
      e = host_budget.fit_host_memory(build, host_memory, host_limit, stack, fused, accumulators)
      # Weights said to be in host memory (not params placed there: their placement is given)
      # go to NVMe where they do not fit.
      moved = host_budget.weights_to_nvme(e, stack, fused, common["nvme"], host_memory)
      if moved is not None and weights_on == "host":
        build_nvme = functools.partial(build, weights_to_nvme=moved)
        e_nvme = host_budget.fit_host_memory(
          build_nvme, host_memory, host_limit, [], fused, accumulators
        )
        if e_nvme.host_total_bytes <= host_memory:
          e = e_nvme
        else:  # (the advice names both budgets)
          e = dataclasses.replace(e, host_memory_with_weights_on_nvme=e_nvme.host_total_bytes)
    return dataclasses.replace(
      e,
      host_limit=host_limit,
      host_memory=host_memory,
      device_card_memory=None if fraction is None else card,
      memory_fraction=fraction,
      update_in_backward=fused,
      update_in_backward_reason=why,
      accumulate=accumulate,
      accumulator_bytes=accumulators,
      accumulator_dtype=dtype_name(acc_dtype) if accumulators else None,
    )

  if weights_on == "nvme":
    return finished(True, "a stack on NVMe is trained in the backward pass (value_and_update)")
  return host_budget.plan_update_in_backward(
    finished, update_in_backward, stack, update_on, host_memory, accumulate
  )


def _count_needs_master(dtype: np.dtype, master: np.dtype) -> bool:
  """Whether `offload` keeps a master copy of params of `dtype`, for a bare count: the check of
  `master.check_master_dtype`, worded for the command line."""
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits > jnp.finfo(master).bits:
    raise ValueError(
      f"master_dtype={master.name} is narrower than the params ({dtype.name}): a master copy must be "
      "at least as wide as the params, e.g. --master-dtype fp32 with bf16 params."
    )
  return master_lib.needs_master(dtype, master)


def _host_returns(n: int, param_dtype: np.dtype, update_dtype: np.dtype) -> int:
  """Device bytes the host update adds beyond the gradients: XLA:GPU (jax 0.10) runs a step's host
  groups as one call, so all updates (in the master dtype, if any) come back at once, while the
  gradients they replace have left."""
  return max(0, n * (update_dtype.itemsize - param_dtype.itemsize))


def _estimate_count(
  n: int, dtype: np.dtype, master, moments, opt: NamedOptimizer, common, nvme_options
) -> Estimate:
  use_master = master is not None and _count_needs_master(dtype, master)
  state_dtype = master if use_master else dtype
  master_bytes = n * master.itemsize if use_master else 0
  # Every slot of a named optimizer is a float array shaped like its param: a moment.
  slot_dtype = state_dtype
  slot_bytes = n * state_dtype.itemsize
  if moments is not None and compress.narrows(state_dtype, moments):
    slot_dtype = moments
    slot_bytes = n * moments.itemsize
    if moments == compress.INT8:  # and an fp32 scale per 256 along the last axis
      slot_bytes = compress.quantized_nbytes((n,))
  offloaded = master_bytes + opt.slots * slot_bytes
  state_name = dtype_name(state_dtype)
  if slot_dtype != state_dtype and opt.slots:
    state_name = "mixed" if use_master else dtype_name(slot_dtype)
  host_limit, window = common["host_limit"], common["window_bytes"]
  host, nvme = offloaded, 0
  if host_limit is not None and offloaded > host_limit and common["nvme"]:
    host, nvme = host_limit, offloaded - host_limit
  on_device = common["update_on"] == "device"
  param_bytes = n * dtype.itemsize
  return Estimate(
    params=n,
    param_dtype=dtype_name(dtype),
    state_dtype=state_name,
    param_bytes=param_bytes,
    grad_bytes=param_bytes,
    device_state_bytes=0,
    window_peak=min(window, offloaded) if on_device else _host_returns(n, dtype, state_dtype),
    master_bytes=master_bytes,
    host_bytes=host,
    nvme_bytes=nvme,
    nvme_group_bytes=min(window // 2, nvme),
    nvme_buffer_bytes=plan_lib.nvme_buffer_bytes(min(window // 2, nvme), nvme_options),
    # update_on="host": grads go to the host, updates (in the master dtype, if any) come back.
    link_bytes=2 * offloaded if on_device else param_bytes + n * state_dtype.itemsize,
    **common,
  )


def _derive(tree: Any, tx, master, moments, min_size: int) -> tree_plan.TreeLeaves:
  """What `offload` derives for each leaf of `tree` before placing it (`tree_plan`)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if not flat:
    raise ValueError("params has no leaves: pass a parameter count or a non-empty tree of shapes.")
  for path, x in flat:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise ValueError(
        f"params leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array or "
        "jax.ShapeDtypeStruct."
      )
  paths = [layout_lib.leaf_path(p) for p, _ in flat]
  avals = [jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype)) for _, x in flat]
  shardings = [getattr(x, "sharding", None) for _, x in flat]
  if master is not None:
    master_lib.check_master_dtype(avals, paths, master)
  try:
    derived = tree_plan.derive_leaves(
      tree_plan.offloaded_inner(tx, master, moments),
      treedef,
      paths,
      avals,
      shardings,
      min_size=min_size,
      check_separable=False,
    )
  except TypeError as e:
    raise ValueError(f"Cannot estimate this optimizer's state per leaf: {e}") from e
  return derived


def _tree_plan(derived: tree_plan.TreeLeaves, common) -> tree_plan.TreePlan:
  """The plan `offload` would make (`tree_plan`, the derivation offload runs at init), or when
  the state exceeds `host_limit` without an NVMe tier, the plan without that limit (the report
  then shows the shortfall)."""
  window = common["window_bytes"]
  try:
    return tree_plan.place(
      derived, window_bytes=window, host_limit=common["host_limit"], nvme=common["nvme"]
    )
  except ValueError:  # over host_limit without NVMe: report the shortfall instead
    return tree_plan.place(derived, window_bytes=window, host_limit=None, nvme=False)


def _estimate_tree(derived: tree_plan.TreeLeaves, master, common, nvme_options) -> Estimate:
  t = _tree_plan(derived, common)
  plan, infos = t.plan, t.leaves
  sizes = [leaf.size for leaf in infos]
  has_master = [master is not None and master_lib.needs_master(d, master) for d in t.dtypes]
  group_bytes = plan.group_bytes(infos)
  pairs = [a + b for a, b in zip(group_bytes, group_bytes[1:])] or group_bytes
  nvme_group = plan.nvme_group_bytes(infos)
  offloaded = [tier is not plan_lib.Tier.DEVICE for tier in plan.tiers]
  param_bytes = sum(s * d.itemsize for s, d in zip(sizes, t.dtypes))
  # update_on="host": grads go to the host, updates (in the master dtype, if any) come back.
  host_link_bytes = sum(
    s * (d.itemsize + (master.itemsize if m else d.itemsize))
    for s, d, m, o in zip(sizes, t.dtypes, has_master, offloaded)
    if o
  )
  on_device = common["update_on"] == "device"
  state_dtypes = {jnp.dtype(x.dtype) for part in t.parts for x in jax.tree.leaves(part)} or {
    master if m else d for d, m in zip(t.dtypes, has_master)
  }
  return Estimate(
    params=sum(sizes),
    param_dtype=dtype_name(t.dtypes[0]) if len(set(t.dtypes)) == 1 else "mixed",
    state_dtype=dtype_name(state_dtypes.pop()) if len(state_dtypes) == 1 else "mixed",
    param_bytes=param_bytes,
    grad_bytes=param_bytes,
    device_state_bytes=t.device_state_bytes,
    window_peak=max(pairs, default=0)
    if on_device
    else sum(
      _host_returns(s, d, master if m else d)
      for s, d, m, o in zip(sizes, t.dtypes, has_master, offloaded)
      if o
    ),
    master_bytes=sum(
      s * master.itemsize for s, m, o in zip(sizes, has_master, offloaded) if m and o
    ),
    host_bytes=plan.bytes_per_tier["host"],
    nvme_bytes=plan.bytes_per_tier["nvme"],
    nvme_group_bytes=nvme_group,
    nvme_buffer_bytes=plan_lib.nvme_buffer_bytes(nvme_group, nvme_options),
    link_bytes=(
      2 * (plan.bytes_per_tier["host"] + plan.bytes_per_tier["nvme"])
      if on_device
      else host_link_bytes
    ),
    leaves=infos,
    plan=plan,
    **common,
  )
