"""Placement plan: which tier holds each leaf's state, and the groups streamed through the device.

Pure functions on shapes and byte counts; no JAX execution. `offload` calls `make_plan` at trace time
and the `plan` command prints it.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Sequence
from typing import Any

from optax_offload._src.nvme import chunk_io
from optax_offload._src.nvme import options as nvme_options
from optax_offload._src.units import format_bytes

DEFAULT_WINDOW_FRACTION = 0.1
"""Default `window_bytes`: this fraction of the device's memory, when the backend reports it."""

FALLBACK_WINDOW_BYTES = 1 << 30
"""Default `window_bytes` when the backend does not report its memory (e.g. the CPU backend)."""

GPU_PINNED_POOL_DEFAULT = 64 * 2**30
"""JAX's GPU client caps its pinned host pool at 64 GiB per device unless
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` is set."""


NVME_DISK_FACTOR = 4
"""Disk space per byte of NVMe-tier state: the store keeps the last two committed generations and
writes up to two more (see `NvmeStore`); 3 suffices when commits keep up with writes."""


def nvme_buffer_bytes(group: int, options: Any = None, *, held: int = 0, block: int = 0) -> int:
  """Most host RAM the NVMe tier's buffers take for store groups of at most `group` bytes (to
  within the padding the tier adds: each array rounded to 4 KiB blocks, a little more).

  `update`'s groups (`NvmeTier.host_buffer_bound`): ``prefetch_depth`` groups read ahead, the one
  read from, ``write_depth`` written behind and the copy a put makes (on a GPU, of its callback's
  operands), and ``io_threads`` write-staging buffers of one request. With the update in the
  backward pass (`held` > 0) the tier also holds `held`, the groups of the pair of layers in
  flight, and a callback's copy of at most `block` bytes of their rows or one group being copied
  from (`host_budget.fused_nvme_held`, `host_budget.fused_nvme_block`); the leaves outside the stack
  are updated after the backward pass as `update`'s groups are, and the larger count holds.

  Examples:
    >>> nvme_buffer_bytes(1 << 30) / 2**30  # 4 groups and 4 x 4 MiB of staging
    4.015625
  """
  if group <= 0:
    return 0
  o = nvme_options.NvmeOptions.of(options)
  # A write request is at most a chunk file, which is at most its group.
  staging = o.io_threads * chunk_io.request_bytes(min(o.chunk_bytes, group))
  after = (o.prefetch_depth + 1 + o.write_depth + 1) * group + staging
  if not held:
    return after
  during = held + max(block, group) + (o.prefetch_depth + o.write_depth) * group + staging
  return max(after, during)


FUSED_WEIGHT_LAYERS_ON_DEVICE = 7
"""Layers of a stack's weights on the device at once in `value_and_update`'s backward loop
(`fused_scan._consume_update`): the pair being updated (2), the pair just computed as one
[2, ...] block (2), the next layer carried and the two fetched one layer ahead (3). Read off the
loop, not measured."""

FUSED_GRAD_LAYERS_ON_DEVICE = 4
"""Layers of a stack's gradients on the device at once in that loop: the pair being updated and the
pair being computed."""

FUSED_NVME_LAYERS_HELD = 2
"""With the update in the backward pass, the layers of a block of its loop (a pair; `fused_scan`).
With state in the NVMe tier the tier holds the store groups that the block in flight touches
until each is complete (row slices of one layer or a multiple of this: `_pair_aligned`), beside
the groups read ahead and written behind; and each piece of a block's groups (a leaf's rows of the
block, or a slice of them) passes through a callback (on a GPU, a copy of it in host memory)."""

FUSED_ACCUMULATOR_LAYERS_ON_DEVICE = 3
"""With several micro-batches a step, layers of a stack's gradient accumulators on the device at
once in that loop: the one carried and the two fetched with their layers' weights."""


def gpu_pinned_pool() -> int:
  """The pinned host pool per GPU: ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GB, or 64 GiB by default."""
  value = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  try:
    return int(float(value) * 2**30) if value else GPU_PINNED_POOL_DEFAULT
  except ValueError:
    return GPU_PINNED_POOL_DEFAULT


def pinned_pool_warning(host_bytes_per_device: int) -> str | None:
  """A warning when a GPU's pinned host pool cannot hold its share of the host tier, else None.

  Examples:
    >>> pinned_pool_warning(10 * 2**30) is None
    True
    >>> print(pinned_pool_warning(100 * 2**30)[:60])
    The host tier needs 100.00 GiB of pinned host memory per GPU
  """
  pool = gpu_pinned_pool()
  if host_bytes_per_device <= pool:
    return None
  gb = -(-host_bytes_per_device // 2**30)
  return (
    f"The host tier needs {format_bytes(host_bytes_per_device)} of pinned host memory per GPU, "
    f"more than JAX's GPU client allows ({format_bytes(pool)}): set "
    f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={gb} (or more) before JAX starts, or lower host_limit so "
    "that the rest goes to NVMe."
  )


class Tier(enum.Enum):
  """Where a leaf's optimizer state lives between steps."""

  DEVICE = "device"
  HOST = "host"
  NVME = "nvme"


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """What the plan needs to know about one parameter leaf.

  Attributes:
    path: the leaf's key path, for messages (e.g. ``"['dense']['kernel']"``).
    size: number of elements of the parameter.
    state_bytes: bytes of this leaf's offloadable optimizer state, per device (its shard): what the
      device window holds.
    process_bytes: bytes of that state held by this process: every local device's shard (a replicated
      leaf once per local device); what `host_limit` counts. Defaults to `state_bytes`.
    rows: length of the leading axis when the leaf's update may be split along it (the inner
      update of a row slice equals that slice of the whole update and the axis is not sharded),
      else 0. A leaf whose state exceeds a group's share of the window is then streamed in row
      slices, whichever tier holds it (the NVMe tier stores the slices apart).
    moving_bytes: bytes of the param and its gradient per device when they live in host memory
      (weights offloaded too): they stream through the window with the state.
    nvme_bytes: bytes of that state this process keeps on NVMe when the leaf goes there: its
      local devices' distinct shards, once each (a replicated leaf once per process). Defaults to
      `process_bytes`.
  """

  path: str
  size: int
  state_bytes: int
  process_bytes: int | None = None
  rows: int = 0
  moving_bytes: int = 0
  nvme_bytes: int | None = None

  @property
  def held_bytes(self) -> int:
    """`process_bytes`, or `state_bytes` when it is not given."""
    return self.state_bytes if self.process_bytes is None else self.process_bytes

  def bytes_in(self, tier: Tier) -> int:
    """Bytes of this leaf's state that this process keeps in `tier`."""
    if tier is Tier.NVME and self.nvme_bytes is not None:
      return self.nvme_bytes
    return self.held_bytes


@dataclasses.dataclass(frozen=True)
class Piece:
  """A leaf, or a slice ``[start, stop)`` of its leading axis, updated as one part of a group.

  Attributes:
    leaf: index of the leaf.
    start: first row, or None for the whole leaf.
    stop: end row, or None for the whole leaf.
  """

  leaf: int
  start: int | None = None
  stop: int | None = None

  @property
  def whole(self) -> bool:
    return self.start is None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Tier of every leaf and the groups the update streams through the device.

  Attributes:
    tiers: one `Tier` per leaf, in leaf order.
    units: the groups, in update order: each a tuple of `Piece`s (leaves or row slices of leaves);
      every row of every leaf is in exactly one piece.
    window_bytes: the device window the groups were sized for.
    bytes_per_tier: state bytes per tier held by this process (`LeafInfo.held_bytes`).
  """

  tiers: tuple[Tier, ...]
  units: tuple[tuple[Piece, ...], ...]
  window_bytes: int
  bytes_per_tier: dict[str, int]

  @property
  def groups(self) -> tuple[tuple[int, ...], ...]:
    """The leaves of each group (a sliced leaf is in the groups of all its slices)."""
    return tuple(tuple(dict.fromkeys(p.leaf for p in unit)) for unit in self.units)

  def piece_bytes(self, piece: Piece, leaves: Sequence[LeafInfo]) -> int:
    """Bytes a piece streams through the window: its offloaded state (none for device-tier
    leaves) and its params and gradients when they live in host memory."""
    leaf = leaves[piece.leaf]
    nbytes = leaf.moving_bytes + (0 if self.tiers[piece.leaf] is Tier.DEVICE else leaf.state_bytes)
    return _share(nbytes, piece, leaf)

  def group_bytes(self, leaves: Sequence[LeafInfo]) -> list[int]:
    """Offloaded state bytes of each group."""
    return [sum(self.piece_bytes(p, leaves) for p in unit) for unit in self.units]

  def nvme_group_bytes(self, leaves: Sequence[LeafInfo]) -> int:
    """Bytes of the largest NVMe store group: a group's NVMe leaves or their row slices (the state
    this process holds, `LeafInfo.held_bytes`; not the params that stream with them)."""
    return max(
      (
        sum(
          _share(leaves[p.leaf].held_bytes, p, leaves[p.leaf])
          for p in unit
          if self.tiers[p.leaf] is Tier.NVME
        )
        for unit in self.units
      ),
      default=0,
    )


def _share(nbytes: int, piece: Piece, leaf: LeafInfo) -> int:
  """`nbytes` of `leaf`, or a row slice's share of them (rounded up)."""
  return nbytes if piece.whole else -(-nbytes * (piece.stop - piece.start) // leaf.rows)


GROUP_SHARE = 4
"""Leaves above ``window // (WINDOW_SLOTS * GROUP_SHARE)`` bytes are groups of their own; smaller
ones are grouped up to that size."""

WINDOW_SLOTS = 2.25
"""Groups the window holds at once: the one updated (in place) and the one in transit (the
previous group's new state leaving, then the next group's state arriving), plus the update's own
temporaries (one chunk's results: measured on XLA:GPU's programs, at most ~0.2 of a group)."""


def make_plan(
  leaves: Sequence[LeafInfo],
  *,
  min_size: int,
  window_bytes: int,
  host_limit: int | None = None,
  nvme: bool = False,
) -> Plan:
  """Decides the tier of each leaf's state and the streaming groups.

  Policy:
    * a leaf with fewer than `min_size` elements keeps its state on the device;
    * the other leaves go to pinned host memory while they fit in `host_limit`; when they do not, the
      largest leaves go to NVMe first (fewest files, longest sequential reads), ties broken by leaf
      order, until the rest fits;
    * groups hold at most ``window_bytes / WINDOW_SLOTS`` of offloaded state each, so that the
      group being updated, the one in transit and the update's temporaries fit in the window
      together. An offloaded leaf larger than that whose `LeafInfo.rows` allows it is split into
      equal row slices of one row or an even number (dividing the rows if that takes at most 1.5x
      the fewest slices, else of the most rows that fit with the remainder last), each a group of
      its own, whatever its tier (host or NVMe: the groups,
      and so the results, do not depend on the tier); any other leaf larger than that is a group
      of its own (and exceeds the window). Leaves above a quarter of that are groups of their own;
      smaller ones are grouped, in leaf order, up to a quarter of it (`GROUP_SHARE`).

  Args:
    leaves: one `LeafInfo` per parameter leaf, in tree order.
    min_size: leaves with fewer elements keep their state on the device.
    window_bytes: most offloaded-state bytes resident on the device at once.
    host_limit: pinned-host budget in bytes, or None for no limit.
    nvme: whether an NVMe tier is available for what exceeds `host_limit`.

  Returns:
    The `Plan`.

  Raises:
    ValueError: when the state exceeds `host_limit` and there is no NVMe tier.

  Examples:
    >>> leaves = [LeafInfo("a", 10, 80), LeafInfo("b", 10_000, 80_000), LeafInfo("c", 20_000, 160_000)]
    >>> p = make_plan(leaves, min_size=4096, window_bytes=1_000_000, host_limit=100_000, nvme=True)
    >>> [t.value for t in p.tiers], p.groups
    (['device', 'host', 'nvme'], ((0, 1), (2,)))
    >>> stacked = [LeafInfo("layers", 32 * 1024, 32 * 8192, rows=32)]
    >>> [(u[0].start, u[0].stop) for u in make_plan(stacked, min_size=1, window_bytes=73728).units]
    [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 28), (28, 32)]
    >>> on_nvme = make_plan(stacked, min_size=1, window_bytes=73728, host_limit=0, nvme=True)
    >>> on_nvme.tiers[0].value, on_nvme.units == make_plan(stacked, min_size=1, window_bytes=73728).units
    ('nvme', True)
  """
  tiers = [Tier.DEVICE if leaf.size < min_size else Tier.HOST for leaf in leaves]
  host_bytes = sum(leaf.held_bytes for leaf, t in zip(leaves, tiers) if t is Tier.HOST)
  if host_limit is not None and host_bytes > host_limit:
    if not nvme:
      raise ValueError(
        f"The offloaded optimizer state needs {format_bytes(host_bytes)} ({host_bytes} bytes) of host "
        f"memory but host_limit is {format_bytes(host_limit)}: {host_bytes - host_limit} bytes are "
        "missing. Raise host_limit, or pass nvme_dir=... to keep the rest on disk."
      )
    by_size = sorted(
      (i for i, t in enumerate(tiers) if t is Tier.HOST),
      key=lambda i: (-leaves[i].held_bytes, i),
    )
    for i in by_size:
      if host_bytes <= host_limit:
        break
      tiers[i] = Tier.NVME
      host_bytes -= leaves[i].held_bytes

  budget = group_budget(window_bytes)
  units = _pack(_pieces(leaves, tiers, budget), leaves, tiers, budget)

  bytes_per_tier = {t.value: 0 for t in Tier}
  for leaf, tier in zip(leaves, tiers):
    bytes_per_tier[tier.value] += leaf.bytes_in(tier)
  return Plan(tuple(tiers), units, window_bytes, bytes_per_tier)


def _pieces(leaves: Sequence[LeafInfo], tiers: Sequence[Tier], budget: int) -> list[Piece]:
  """Each leaf whole, or in equal row slices of at most `budget` bytes when it can be split."""
  pieces = []
  for i, (leaf, tier) in enumerate(zip(leaves, tiers)):
    nbytes = leaf.moving_bytes + (0 if tier is Tier.DEVICE else leaf.state_bytes)
    row = -(-nbytes // max(leaf.rows, 1))
    if leaf.moving_bytes and row > budget:
      what = f"one layer (row) of {leaf.path}" if leaf.rows >= 2 else f"{leaf.path} (not split)"
      raise ValueError(
        f"offload: window_bytes {format_bytes(int(budget * WINDOW_SLOTS))} is smaller than {what}, "
        f"whose weights live in host memory: {format_bytes(row)} of "
        f"weights, gradients and state, and a group holds window_bytes / {WINDOW_SLOTS}. Raise "
        f"window_bytes to at least {format_bytes(math.ceil(row * WINDOW_SLOTS))}."
      )
    if nbytes <= budget or leaf.rows < 2:
      pieces.append(Piece(i))
      continue
    # The most rows a slice holds within the budget, in a slice of one row or an even number
    # (`_pair_aligned`).
    fit = max(1, min(leaf.rows, budget * leaf.rows // nbytes))
    fit -= 0 if _pair_aligned(fit) else 1
    n = -(-leaf.rows // fit)
    # Equal slices: the update runs them in one loop (`stream`), so the program does not grow with
    # their number. Slices that divide the rows when that takes at most 1.5x the fewest slices (a
    # remainder slice is unrolled beside the loop: 40 rows in 20 slices of 2, not 13 of 3 and 1);
    # else the most rows that fit, the remainder last.
    n = next(
      (m for m in range(n, n + n // 2 + 1) if leaf.rows % m == 0 and _pair_aligned(leaf.rows // m)),
      None,
    )
    size = fit if n is None else leaf.rows // n
    bounds = list(range(0, leaf.rows, size)) + [leaf.rows]
    pieces.extend(Piece(i, a, b) for a, b in zip(bounds, bounds[1:]))
  return pieces


def block_info(leaf: LeafInfo, rows: int, layers: int, split: bool) -> LeafInfo:
  """`leaf` (a stack leaf of `layers` rows) cut to a block of `rows` of its rows, as the update in
  the backward pass plans a block's groups: its size and state pro rata, split by rows when
  `split`."""
  return LeafInfo(
    leaf.path,
    leaf.size * rows // layers,
    -(-leaf.state_bytes * rows // layers),
    rows=rows if split else 0,
  )


def group_budget(window_bytes: int) -> int:
  """Bytes a group of the update may hold for `window_bytes`: ``window_bytes / WINDOW_SLOTS``.

  Examples:
    >>> group_budget(2_250_000)
    1000000
  """
  return max(int(window_bytes / WINDOW_SLOTS), 1)


def largest_piece_rows(leaf: LeafInfo, window_bytes: int) -> int:
  """Rows of the largest piece `make_plan` cuts `leaf` into for `window_bytes` (all its rows when
  it stays whole).

  Examples:
    >>> largest_piece_rows(LeafInfo("w", 2 * 1024, 2 * 8192, rows=2), window_bytes=20_000)
    1
  """
  budget = group_budget(window_bytes)
  pieces = _pieces([leaf], [Tier.HOST], budget)
  return max(max(leaf.rows, 1) if p.whole else p.stop - p.start for p in pieces)


def _pair_aligned(rows: int) -> bool:
  """Whether row slices of `rows` rows start on the pairs of layers that the update in the backward
  pass updates together (``[2j, 2j + 1]``, `fused_scan`): one row, or an even number. With NVMe
  state a pair across two slices of k rows would keep both in host memory (2k rows, not k:
  `host_budget.fused_nvme_held`). Every plan slices so (it cannot know whether the update will run
  in the backward pass, and the NVMe tier's files follow the plan): at most a few more groups than
  the budget needs (40 rows that fit 5 to a slice: 10 slices of 4, not 8 of 5)."""
  return rows == 1 or rows % FUSED_NVME_LAYERS_HELD == 0


def _pack(
  pieces: Sequence[Piece], leaves: Sequence[LeafInfo], tiers: Sequence[Tier], budget: int
) -> tuple[tuple[Piece, ...], ...]:
  """Groups of consecutive pieces: a row slice or a leaf above ``budget // GROUP_SHARE`` bytes alone,
  smaller leaves together up to that size.

  XLA merges the updates of a group's leaves into a few kernels, so several large leaves in one
  group would leave most of their copies with no update to overlap.
  """
  probe = Plan(tuple(tiers), (), 0, {})
  bundle = max(budget // GROUP_SHARE, 1)
  units: list[tuple[Piece, ...]] = []
  current: list[Piece] = []
  current_bytes = 0
  for piece in pieces:
    nbytes = probe.piece_bytes(piece, leaves)
    if current and (current_bytes + nbytes > bundle or not piece.whole or not current[-1].whole):
      units.append(tuple(current))
      current, current_bytes = [], 0
    current.append(piece)
    current_bytes += nbytes
  if current:
    units.append(tuple(current))
  return tuple(units)


def describe_plan(plan: Plan, leaves: Sequence[LeafInfo]) -> str:
  """A human-readable table of the plan: one line per group, then bytes per tier.

  Examples:
    >>> leaves = [LeafInfo("w", 8192, 65536), LeafInfo("b", 8, 64)]
    >>> print(describe_plan(make_plan(leaves, min_size=4096, window_bytes=1 << 20), leaves))
    group 0: 64.00 KiB offloaded
      w  host  64.00 KiB
      b  device  64 B
    device: 64 B, host: 64.00 KiB, nvme: 0 B (window 1.00 MiB)
  """
  lines = []
  for k, (unit, nbytes) in enumerate(zip(plan.units, plan.group_bytes(leaves))):
    lines.append(f"group {k}: {format_bytes(nbytes)} offloaded")
    for piece in unit:
      rows = "" if piece.whole else f"[{piece.start}:{piece.stop}]"
      lines.append(
        f"  {leaves[piece.leaf].path}{rows}  {plan.tiers[piece.leaf].value}  "
        f"{format_bytes(plan.piece_bytes(piece, leaves) or leaves[piece.leaf].state_bytes)}"
      )
  totals = ", ".join(f"{k}: {format_bytes(v)}" for k, v in plan.bytes_per_tier.items())
  lines.append(f"{totals} (window {format_bytes(plan.window_bytes)})")
  return "\n".join(lines)


describe = describe_plan
