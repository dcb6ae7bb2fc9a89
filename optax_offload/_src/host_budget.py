"""One host budget (``host_memory``) for `estimate`: what goes in host memory, what to NVMe, and why.

The items each step touches most stay in host memory first: the layer stack's weights (read in the
forward and backward passes and by the update), its gradients or accumulators, the NVMe tier's
staging buffers; the optimizer state (read and written once a step) fills what is left, the rest
goes to NVMe. Whether the stack's update runs in the backward pass (`value_and_update`) is chosen
here too, as it decides whether whole gradients exist. Each item's tier and reason is a
`Placement`. Also the settings the budget starts from: JAX's share of the GPU's memory and the
NVMe tier's directory.

Pure arithmetic on an `Estimate` (`estimate` builds it and calls these); this module imports
nothing of `estimate`, which imports it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple

from optax_offload._src import measure
from optax_offload._src import nvme_stack
from optax_offload._src import offloaded_scan as scan_lib
from optax_offload._src import plan as plan_lib
from optax_offload._src.plan import FUSED_GRAD_LAYERS_ON_DEVICE
from optax_offload._src.plan import FUSED_WEIGHT_LAYERS_ON_DEVICE
from optax_offload._src.units import format_bytes
from optax_offload._src.units import format_bytes_up

if TYPE_CHECKING:  # only for annotations: estimate imports this module
  from optax_offload._src.estimate import Estimate


class StackLeaf(NamedTuple):
  """A leaf of the layer stack in pinned host memory, as the budget counts it.

  Attributes:
    nbytes: its bytes, whole (what the device figures count, as for every param).
    layers: its leading (layer) axis.
    params: its elements, whole.
    held: its bytes in this process's pinned host memory (its shards of a multi-process mesh;
      ``nbytes`` in one process): what its weights, gradients and accumulators take on the host.
  """

  nbytes: int
  layers: int
  params: int
  held: int

  @property
  def held_params(self) -> int:
    """Its elements in this process's pinned host memory."""
    return self.params * self.held // self.nbytes if self.nbytes else 0


@dataclasses.dataclass(frozen=True)
class Placement:
  """One item of the plan: what it is, the tier that holds it, its bytes, and why there.

  Attributes:
    what: the item, e.g. ``"stack weights (bf16)"``.
    tier: ``"device"``, ``"host"``, ``"nvme"``, or ``"none"`` (never whole anywhere).
    nbytes: its bytes in that tier (peak, for the device's items).
    reason: why the planner put it there.
  """

  what: str
  tier: str
  nbytes: int
  reason: str


DEFAULT_MEMORY_FRACTION = 0.75
"""The share of a GPU's memory JAX takes unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise."""


def memory_fraction_from_env() -> float:
  """The share of a GPU's memory JAX may take: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, else 0.75.

  Examples:
    >>> 0 < memory_fraction_from_env() <= 1
    True
  """
  value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  if not value:
    return DEFAULT_MEMORY_FRACTION
  try:
    fraction = float(value)
  except ValueError:
    raise ValueError(
      f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number: JAX reads it as the share of the "
      "GPU's memory it takes (e.g. .95); unset it for JAX's default 0.75."
    ) from None
  return check_fraction(fraction, "XLA_PYTHON_CLIENT_MEM_FRACTION")


def check_fraction(fraction: Any, name: str = "memory_fraction") -> float:
  if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
    raise ValueError(f"{name} must be a number in (0, 1], got {fraction!r}.")
  return float(fraction)


def check_nvme_dir(nvme_dir: str | os.PathLike) -> str:
  """Checks that `nvme_dir` is a writable directory, or can be created as one; returns its path.

  Raises:
    ValueError: it is a file, or neither it nor the parent it would be created in is writable.

  Examples:
    >>> check_nvme_dir("/proc/version")
    Traceback (most recent call last):
    ValueError: --nvme-dir /proc/version exists and is not a directory: give a directory (it is created if missing).
  """
  path = os.path.abspath(os.fspath(nvme_dir))
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise ValueError(
        f"--nvme-dir {path} exists and is not a directory: give a directory (it is created if "
        "missing)."
      )
    if not os.access(path, os.W_OK | os.X_OK):
      raise ValueError(
        f"--nvme-dir {path} is not writable by this user: give a directory you can write, or "
        "change its permissions."
      )
    return path
  parent = measure.nearest_existing(os.path.dirname(path))
  if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
    raise ValueError(
      f"--nvme-dir {path} does not exist and cannot be created: {parent} is not a writable "
      "directory. Create it (mkdir -p) or give a directory on a disk you can write."
    )
  return path


def host_memory_advice(e: Estimate) -> str:
  """What to change when `e`'s host total exceeds its `host_memory`."""
  fmt = format_bytes
  fixed = e.host_weight_bytes + e.accumulator_bytes
  budget = e.host_memory or 0
  if fixed > budget or (e.nvme and fixed + e.nvme_buffer_bytes > budget):
    weights = e.host_weight_bytes if e.update_in_backward else e.host_weight_bytes // 2
    stack = e.weights_on == "host"
    parts = [f"the stack's weights {fmt(weights)}"] if stack else []
    if stack and not e.update_in_backward:
      parts.append(f"gradients {fmt(e.host_weight_bytes // 2)}")
    if e.accumulator_bytes:
      parts.append(f"gradient accumulators {fmt(e.accumulator_bytes)} (accumulate={e.accumulate})")
    if e.nvme_buffer_bytes:
      parts.append(f"NVMe staging buffers {fmt(e.nvme_buffer_bytes)}")
    why = (
      " (gradients and accumulators on NVMe are not implemented; the stack's weights go to "
      "NVMe with --weights-on nvme and --nvme-dir, oo.write_nvme_stack, read twice a "
      "micro-batch, where the NVMe buffers and accumulators fit in --host-memory without them)"
      if stack or e.accumulator_bytes
      else ""
    )
    at_least = format_bytes_up(fixed + e.nvme_buffer_bytes)
    if not e.nvme:
      # Without an NVMe tier the offloaded state stays in host memory too.
      at_least = (
        f"{format_bytes_up(e.host_total_bytes)} (the offloaded state too: no NVMe tier), or give "
        f"an NVMe tier (--nvme-dir) for the state and at least {at_least} plus its staging buffers"
      )
    elif e.host_memory_with_weights_on_nvme is not None:
      at_least = (
        f"{format_bytes_up(e.host_memory_with_weights_on_nvme)}, where the plan puts the stack's "
        "weights on NVMe itself (the NVMe buffers in host memory; the weights read twice a step: "
        f"oo.write_nvme_stack, oo.value_and_update), or to at least {at_least} to keep them in RAM"
      )
    advice = (
      f"{' + '.join(parts)} must stay in host memory{why}: raise --host-memory to at least "
      f"{at_least}"
    )
    if stack and not e.update_in_backward:
      advice += ", or update in the backward pass (--update-in-backward yes: no whole gradients)"
    elif e.accumulator_bytes:
      advice += (
        ", or take one micro-batch per step (--accumulate 1: no accumulators), or keep some of "
        "the stack's leaves on the device when the card has room for their weights and "
        "accumulators (--stack-on-device SIZE; with shapes, oo.estimate of params with those "
        "leaves on the device; docs/consumer.md)"
      )
    return advice + "."
  return (
    f"the offloaded state does not fit beside the rest: give an NVMe tier (--nvme-dir) for it, "
    f"or raise --host-memory to at least {format_bytes_up(e.host_total_bytes)}."
  )


def placements(e: Estimate) -> tuple[Placement, ...]:
  """The items of `e`'s plan, each with its tier and the reason for it."""
  out = []
  add = lambda *a: out.append(Placement(*a))  # noqa: E731
  state = "optimizer state" + (" and master copy" if e.master_bytes else "")
  if e.weights_on == "nvme":
    add(
      f"layer stack's weights ({e.param_dtype})",
      "nvme",
      e.nvme_weight_bytes,
      f"{e.weights_on_reason}: oo.write_nvme_stack writes them, the forward and backward passes "
      "read a layer at a time, and oo.value_and_update writes each block's new weights in the "
      "backward pass (without clip_by_global_norm; one device)",
    )
  elif e.weights_on == "host":
    weights = e.host_weight_bytes if e.update_in_backward else e.host_weight_bytes // 2
    add(
      f"layer stack's weights ({e.param_dtype})",
      "host",
      weights,
      "touched most: read in the forward and backward passes and rewritten by every update; "
      "kept in host memory first (on NVMe when they do not fit, with an NVMe tier and the update "
      "in the backward pass)",
    )
  if e.weights_on != "device":
    if e.update_in_backward:
      add(
        "layer stack's gradients",
        "none",
        0,
        "never whole: each layer's gradient is consumed by its update inside the backward pass "
        "(oo.value_and_update)",
      )
    else:
      add(
        "layer stack's gradients",
        "host",
        e.host_weight_bytes // 2,
        "written by the backward pass, read by the update after it (oo.update_and_apply)",
      )
    if e.accumulator_bytes:
      add(
        f"gradient accumulators ({e.accumulator_dtype})",
        "host",
        e.accumulator_bytes,
        f"read and written by each of the {e.accumulate} micro-batches' backward passes",
      )
    add(
      "layer stack on the device",
      "device",
      e.stack_layer_bytes,
      (
        f"{FUSED_WEIGHT_LAYERS_ON_DEVICE} layers of weights and {FUSED_GRAD_LAYERS_ON_DEVICE} of "
        "gradients at once"
        + (
          f" ({plan_lib.FUSED_ACCUMULATOR_LAYERS_ON_DEVICE} of accumulators)"
          if e.accumulator_bytes
          else ""
        )
        + ", each fetched one layer ahead; the update window beside them"
        if e.update_in_backward
        else f"{scan_lib.WEIGHT_LAYERS_ON_DEVICE} layers of weights and "
        f"{scan_lib.GRAD_LAYERS_ON_DEVICE} of gradients at once, each fetched one layer ahead"
      ),
    )
  kept = e.stack_device_bytes + e.stack_device_grad_bytes
  if e.stack_device_bytes:
    add(
      "layer stack's leaves kept on the device",
      "device",
      kept,
      f"the card has room for them beside the streamed layers: weights "
      f"{format_bytes(e.stack_device_bytes)} used in place (no link bytes), their "
      + (
        f"accumulators {format_bytes(e.stack_device_grad_bytes)} beside them"
        if e.update_in_backward and e.accumulate > 1
        else "gradients consumed layer by layer"
        if e.update_in_backward
        else f"gradients {format_bytes(e.stack_device_grad_bytes)}"
      )
      + "; their state streamed with the stack's",
    )
  if e.param_bytes + e.grad_bytes - kept or e.weights_on == "device":
    where = " outside the stack" if e.weights_on != "device" else ""
    add(
      f"params and grads{where}",
      "device",
      e.param_bytes + e.grad_bytes - kept,
      "the device computes with them"
      + ("" if e.weights_on == "host" else " (--weights-on host streams a layer stack instead)"),
    )
  if e.window_peak:
    add(
      "update window",
      "device",
      e.window_peak,
      f"offloaded {state} pass through it group by group (window_bytes {format_bytes(e.window_bytes)})",
    )
  if e.device_state_bytes:
    add("small leaves' state", "device", e.device_state_bytes, "leaves under min_size stay")
  if e.host_bytes or not e.nvme_bytes:
    if e.host_memory is not None:
      why = "read and written once a step by the update: it fills the host budget left"
    elif e.host_limit is not None:
      why = "up to --host-limit (the state's own bound)"
    else:
      why = "no host budget given: all of it"
    add(f"{state} in host memory", "host", e.host_bytes, why)
  if e.nvme_bytes:
    add(
      f"{state} on NVMe",
      "nvme",
      e.nvme_bytes,
      "touched least (read and written once a step): what does not fit in host memory; "
      "read ahead in update order, written behind",
    )
    # One callback a piece of the pair's groups; a count without shapes bounds the largest piece.
    bound = (
      ""
      if e.plan is not None
      else (
        "; without shapes, at most a group or one layer's rows of all the NVMe state, the larger"
      )
    )
    add(
      "NVMe staging buffers",
      "host",
      e.nvme_buffer_bytes,
      (
        "the NVMe groups that the pair of layers being updated in the backward pass touches and "
        f"a copy of the largest piece of the pair's rows (a GPU callback's operands{bound}), the "
        "groups read ahead and written behind, and the write staging"
        if e.update_in_backward
        else "store groups read ahead, read from, written behind and copied for the next put, "
        "and the write staging"
      ),
    )
  return tuple(out)


def plan_update_in_backward(
  plan: Callable[[bool, str | None], Estimate],
  given: bool | None,
  stack: list,
  update_on: str,
  host_memory: int | None,
  accumulate: int,
) -> Estimate:
  """`plan(update_in_backward, why)` with the stack's update in the backward pass as `given`, or
  where the planner chooses it: for accumulation, and where the stack's whole gradients do not fit
  in `host_memory` (beside its weights alone, or beside what else the plan keeps there).

  Raises:
    ValueError: update_in_backward asked for without a stack, or accumulation without it.
  """
  weights = sum(leaf.held for leaf in stack)
  if given is True:
    if not stack:
      raise ValueError(
        'update_in_backward needs a layer stack in pinned host memory (weights_on="host", '
        "--weights-on host --layers N): value_and_update updates the stack that offloaded_scan "
        "streams."
      )
    return plan(True, "as asked (--update-in-backward yes)")
  decides = given is None and stack and update_on == "device"
  if accumulate > 1 and not decides:
    raise ValueError(
      "accumulate > 1 is planned for a layer stack updated in the backward pass only "
      "(value_and_update's host-memory accumulators: --weights-on host --layers N, without "
      "--update-in-backward no), or plan one micro-batch per step."
    )
  if not decides:
    return plan(False, "as asked (--update-in-backward no)" if given is False and stack else None)
  refuse = "(--update-in-backward no to refuse)"
  if accumulate > 1:
    why = f"accumulate={accumulate} accumulates the stack's gradients in its backward passes"
    return plan(True, f"chosen: {why} {refuse}")
  if host_memory is not None and 2 * weights > host_memory:
    why = (
      f"the stack's weights and gradients ({format_bytes(2 * weights)}) do not fit in "
      f"--host-memory {format_bytes(host_memory)}"
    )
    return plan(True, f"chosen: {why} {refuse}")
  e = plan(False, None)
  if host_memory is not None and e.host_total_bytes > host_memory:
    # The whole gradients fit beside the weights, not beside the NVMe buffers (or state) too.
    beside = "the NVMe buffers" if e.nvme else "the offloaded state"
    why = (
      f"the stack's whole gradients do not fit in --host-memory {format_bytes(host_memory)} "
      f"beside its weights and {beside}"
    )
    in_backward = plan(True, f"chosen: {why} {refuse}")
    device_short = [any(f.tier == "device" for f in x.shortfalls) for x in (e, in_backward)]
    if in_backward.host_total_bytes <= host_memory and device_short[0] >= device_short[1]:
      return in_backward  # (its window beside the streamed layers: not where the device is short)
  # Kept whole, though the update in the backward pass may be faster (no whole gradients: fewer
  # bytes on the drive and the link): the plan says so where that one fits and is 5% faster.
  fused = plan(True, "as asked (--update-in-backward yes)")
  if fused.fits and fused.step_time_lower_bound < 0.95 * e.step_time_lower_bound:
    return dataclasses.replace(e, step_s_in_backward=fused.step_time_lower_bound)
  return e


def with_weights_on_host(
  e: Estimate,
  stack: list[StackLeaf],
  fused: bool = False,
  accumulate: int = 1,
  accumulators: int = 0,
  accumulator_itemsize: int = 4,
  on_device: frozenset[int] = frozenset(),
  kept: tuple[int, int] = (0, 0),
  nvme_options: Any = None,
) -> Estimate:
  """`e` with the weights of `stack` in pinned host memory
  (`on_device`: indices of the stack's leaves kept on the device, `fused_nvme_held`; `kept`:
  their (bytes, params); `nvme_options`: the NVMe tier's, for its buffers).

  After the backward pass (`update_and_apply`): the gradients live in pinned host memory too; the
  device holds `offloaded_scan.WEIGHT_LAYERS_ON_DEVICE` layers of their weights and
  `offloaded_scan.GRAD_LAYERS_ON_DEVICE` of their gradients during the forward and backward
  passes, and after them the update streams (weights, gradients, state) through the window. Per
  step the weights cross the link four times (forward, backward, into the update and back) and
  the gradients twice.

  In the backward pass (`value_and_update`, `fused`): no whole gradients anywhere; the device holds
  `FUSED_WEIGHT_LAYERS_ON_DEVICE` and `FUSED_GRAD_LAYERS_ON_DEVICE` layers (and with accumulators
  `plan.FUSED_ACCUMULATOR_LAYERS_ON_DEVICE` layers of them) and the window at once.
  Per micro-batch the weights cross the link twice (forward, backward) and once more per step
  (the new weights); the accumulators (`accumulators` bytes, `accumulator_itemsize` bytes a
  parameter) 2 (accumulate - 1) times a step.
  """
  weights = sum(leaf.held for leaf in stack)  # on this process's host, and across its links
  whole = sum(leaf.nbytes for leaf in stack)  # the device figures count params whole
  per_layer = sum(-(-leaf.nbytes // leaf.layers) for leaf in stack)
  window = e.window_peak
  if e.plan is None:  # a bare count: the window now carries weights and gradients with the state
    window = min(e.window_bytes, e.offloaded_bytes + 2 * weights)
  stack_layer_bytes = 0
  buffers = e.nvme_buffer_bytes
  if fused and e.nvme_bytes:
    # The groups of a pair of layers stay in host memory until complete, beside the groups read
    # ahead and written behind (nvme_tier/layers.py with value_and_update).
    buffers = plan_lib.nvme_buffer_bytes(
      e.nvme_group_bytes,
      nvme_options,
      held=fused_nvme_held(e, stack, on_device),
      block=fused_nvme_block(e, stack, on_device),
    )
  if fused:
    layers_on_device = FUSED_WEIGHT_LAYERS_ON_DEVICE + FUSED_GRAD_LAYERS_ON_DEVICE
    if accumulators:  # rows of the accumulators come in with their layers' weights
      per_layer_params = sum(-(-leaf.params // leaf.layers) for leaf in stack)
      stack_layer_bytes = (
        plan_lib.FUSED_ACCUMULATOR_LAYERS_ON_DEVICE * per_layer_params * accumulator_itemsize
      )
    host_weights = weights
    link = e.link_bytes + (2 * accumulate + 1) * weights + 2 * (accumulate - 1) * accumulators
    # The kept leaves' gradients are consumed layer by layer too; with several micro-batches their
    # accumulators live beside them on the device.
    kept_grads = kept[1] * accumulator_itemsize if accumulate > 1 else 0
  else:
    layers_on_device = scan_lib.WEIGHT_LAYERS_ON_DEVICE + scan_lib.GRAD_LAYERS_ON_DEVICE
    host_weights = 2 * weights
    link = e.link_bytes + 6 * weights
    kept_grads = kept[0]
  return dataclasses.replace(
    e,
    weights_on="host",
    param_bytes=e.param_bytes - whole,
    grad_bytes=e.grad_bytes - whole - kept[0] + kept_grads,
    stack_layer_bytes=stack_layer_bytes + layers_on_device * per_layer,
    nvme_buffer_bytes=buffers,
    host_weight_bytes=host_weights,
    window_peak=window,
    link_bytes=link,
    accumulate=accumulate,
    accumulator_bytes=accumulators,
    stack_device_bytes=kept[0],
    stack_device_grad_bytes=kept_grads,
  )


def weights_to_nvme(
  e: Estimate, stack: list[StackLeaf], fused: bool, nvme: bool, host_memory: int
) -> str | None:
  """Why the stack's weights go to NVMe (`with_weights_on_nvme`), or None where they stay: they go
  when `e` (weights in host memory) exceeds `host_memory`, the step updates the stack in the
  backward pass (`value_and_update`, which trains a stack on NVMe), there is an NVMe tier, and a
  step takes one micro-batch. With k micro-batches the drive would read the weights 2k times a
  step (13B, 40 micro-batches: 1.9 TiB a step, about 12 minutes at 3 GB/s): fewer micro-batches,
  or leaves of the stack kept on the card, are the better plan, so the plan says that instead
  (``weights_on="nvme"`` still asks for it)."""
  if not (stack and fused and nvme and e.weights_on == "host" and e.accumulate == 1):
    return None
  if e.host_total_bytes <= host_memory:
    return None
  return (
    f"the stack's weights ({format_bytes(e.host_weight_bytes)}) do not fit in --host-memory "
    f"{format_bytes(host_memory)} beside "
    + ("their accumulators and " if e.accumulator_bytes else "")
    + "the NVMe buffers; on NVMe they are read in each forward and backward pass (the disk's "
    "time below)"
  )


def with_weights_on_nvme(e: Estimate, stack: list[StackLeaf], why: str) -> Estimate:
  """`e` (`with_weights_on_host`'s, the update in the backward pass) with the stack's weights on
  NVMe: a layer stack `write_nvme_stack` wrote, read a layer at a time in each forward and backward
  pass and written a block of layers at a time by `value_and_update`'s update. Host memory holds
  the stack store's buffers instead: the layers read ahead (`nvme_stack.DEFAULT_OPTIONS`), written
  behind, the one read last, and a block's put (two layers)."""
  weights = sum(leaf.held for leaf in stack)
  layer = sum(-(-leaf.held // leaf.layers) for leaf in stack)
  buffers = plan_lib.nvme_buffer_bytes(layer, nvme_stack.DEFAULT_OPTIONS) + 3 * layer
  return dataclasses.replace(
    e,
    weights_on="nvme",
    weights_on_reason=why,
    host_weight_bytes=0,
    nvme_weight_bytes=weights,
    nvme_buffer_bytes=e.nvme_buffer_bytes + buffers,
  )


def fused_nvme_held(
  e: Estimate, stack: list[StackLeaf], on_device: frozenset[int] = frozenset()
) -> int:
  """Host bytes of the stack's NVMe state that the update in the backward pass holds at once: the
  store groups that the block of layers in flight touches, each held until all its rows are
  written. For a bare count, one block's rows (groups of one layer row); with shapes, per NVMe
  leaf of the stack (streaming with its weights, `LeafInfo.moving_bytes`, or kept on the device:
  the indices `on_device`), the most rows of its slices (the plan's pieces; the whole leaf when it
  is not sliced) that one block touches, each leaf by its own layers."""
  rows = _stack_nvme_rows(e, stack[0].layers, on_device)
  if e.plan is None:
    ((row, layers),) = rows.values()
    return min(plan_lib.FUSED_NVME_LAYERS_HELD, layers) * row
  slices: dict[int, list[tuple[int, int]]] = {}
  for unit in e.plan.units:
    for piece in unit:
      if piece.start is not None:
        slices.setdefault(piece.leaf, []).append((piece.start, piece.stop))
  return sum(_rows_held(slices.get(i, [(0, n)]), n) * row for i, (row, n) in rows.items())


def _rows_held(slices: list[tuple[int, int]], layers: int) -> int:
  """The most rows of `slices` ((start, stop) each) that one block of `fused_scan`'s backward loop
  touches: an odd top layer alone, then the pairs ``[2j, 2j + 1]``.

  Examples:
    >>> _rows_held([(0, 5), (5, 10)], 10)  # the pair [4, 5] touches both
    10
    >>> _rows_held([(0, 4), (4, 8), (8, 10)], 10)
    4
  """
  pair = plan_lib.FUSED_NVME_LAYERS_HELD
  blocks = [(b, min(b + pair, layers)) for b in range(0, layers, pair)]
  return max(
    sum(stop - start for start, stop in slices if start < hi and lo < stop) for lo, hi in blocks
  )


def fused_nvme_block(
  e: Estimate, stack: list[StackLeaf], on_device: frozenset[int] = frozenset()
) -> int:
  """Host bytes of the largest piece of a block's NVMe rows (`plan.FUSED_NVME_LAYERS_HELD`
  layers): the copy a callback's operands take on a GPU, where JAX copies them into host memory
  before the callback runs. The streamed update of a block moves each NVMe piece of its groups by
  one callback (`value_and_update._BlockRows`): a leaf's rows of the block, or of a slice of them
  when they exceed a group (`plan.block_info`, `plan.largest_piece_rows`; split as
  `value_and_update` splits a leaf with state, whatever the plan of the whole leaf). A put's new
  rows wait there before they go into the held groups; a fetch that joins two row slices makes
  such a copy too, never at the same time. For a bare count, which cannot see the leaves, a bound
  that holds whatever they are: a piece is one leaf's rows of a block, whose state fits a group
  (`plan.group_budget`; a byte more from rounding each row up) or else is one row, and
  one leaf's row is at most one row of all the NVMe state: the least of a block's rows of all of
  it and the larger of a group and one such row."""
  pieces = []
  for i, (row, n) in _stack_nvme_rows(e, stack[0].layers, on_device).items():
    block = min(plan_lib.FUSED_NVME_LAYERS_HELD, n)
    if e.plan is None:
      group = plan_lib.group_budget(e.window_bytes) + 1
      pieces.append(min(block * row, max(group, row)))
      continue
    info = plan_lib.block_info(e.leaves[i], block, n, split=True)
    pieces.append(plan_lib.largest_piece_rows(info, e.plan.window_bytes) * row)
  return max(pieces, default=0)


def _stack_nvme_rows(e: Estimate, layers: int, on_device: frozenset[int]) -> dict:
  """(bytes of one layer row, layers) of each of the stack's NVMe leaves, by leaf index: those
  streaming with the stack's weights (`LeafInfo.moving_bytes`) or kept on the device
  (`on_device`), each of its own layers (its rows; `layers`, the first stack's, when it cannot be
  split by rows). For a bare count, one row of all the NVMe state, under the key None."""
  if e.plan is None:
    return {None: (-(-e.nvme_bytes // layers), layers)}
  out = {}
  for i, (leaf, tier) in enumerate(zip(e.leaves, e.plan.tiers)):
    if (leaf.moving_bytes or i in on_device) and tier is plan_lib.Tier.NVME:
      n = leaf.rows or layers
      out[i] = (-(-leaf.held_bytes // n), n)
  return out


def accumulator_bytes(stack: list[StackLeaf], fused: bool, accumulate: int, itemsize: int) -> int:
  """Bytes of the stack's gradient accumulators (`itemsize` bytes each) in host memory: only with
  the update in the backward pass and more than one micro-batch per step."""
  stack_params = sum(leaf.held_params for leaf in stack)
  return itemsize * stack_params if fused and accumulate > 1 else 0


def fit_host_memory(
  build: Callable[[int | None], Estimate],
  host_memory: int,
  host_limit: int | None,
  stack: list[StackLeaf],
  fused: bool,
  accumulators: int,
) -> Estimate:
  """`build(state_limit)` with the largest limit on the offloaded state in host memory that keeps
  the host total within `host_memory` (and `host_limit`, when given).

  Most touched first: the stack's weights (read in the forward and backward passes and by the
  update), its gradients or accumulators, then the NVMe tier's buffers; the optimizer state (read
  and written once a step) fills what is left, the rest goes to NVMe.
  """
  weights = sum(leaf.held for leaf in stack)
  fixed = (weights if fused else 2 * weights) + accumulators
  limit = max(0, host_memory - fixed)
  if host_limit is not None:
    limit = min(limit, host_limit)
  e = build(limit)
  for _ in range(8):  # the NVMe tier's buffers come out of the host budget too
    over = e.host_total_bytes - host_memory
    if over <= 0 or not e.nvme or limit == 0:
      break
    # The buffers grow as the limit shrinks (and round up): close in, then step past rounding.
    # From the state placed, not the limit: whole leaves move, so a limit above what they fill
    # would shrink without moving any (13B with bf16 moments stayed 12 MB over in 8 steps).
    limit = max(0, min(limit, e.host_bytes) - (over if over > 4096 else 2 * over + 64))
    e = build(limit)
  return e
