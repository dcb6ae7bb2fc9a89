"""What the grouped update streams, and which of its groups run in a loop.

`StreamSpec` is derived from the plan and the state's shapes (`tree_setup.make_setup`): the
groups, each state array's tier, the axes it shares with its param, and the chunks of each group's
update. `loop_plan` picks the runs of equal row slices (of one leaf, or of several alike leaves
taken in turn) that `stream.run` executes as one `lax.fori_loop` each, so that the program does
not grow with the number of slices. Nothing here traces: `stream` runs what this module plans.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_offload._src.plan import Piece
from optax_offload._src.plan import Tier


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  """How `stream.run` moves and splits the state: derived from the plan and the state's shapes.

  Attributes:
    units: the plan's groups of pieces, in update order.
    array_tiers: per leaf, the tier of each array of its state part.
    dims: per leaf, how many leading axes each array of its state part shares with the param (0, 1
      or 2): a row slice or chunk of the leaf takes the same rows (and columns) of those axes;
      an array sharing none is passed whole.
    chunks: per group, per piece, ``(axis, count)``: its update (with `update_and_apply`) is
      computed in `count` chunks along `axis` (0: rows, 1: columns), each written in place.
    loop: whether equal row slices may run in a loop (`loop_plan`). `make_setup` allows it for
      params on one device: on a mesh of two CPU devices the loop's bits differed from the NVMe
      tier's (unrolled) groups' (tests/test_nvme_tier.py's stale-state test), not yet explained.
  """

  units: tuple[tuple[Piece, ...], ...]
  array_tiers: tuple[tuple[Tier, ...], ...]
  dims: tuple[tuple[int, ...], ...]
  chunks: tuple[tuple[tuple[int, int], ...], ...]
  loop: bool = True

  def offloaded(self, i: int) -> list[int]:
    """The arrays of leaf i's state part that live off the device between steps."""
    return [j for j, t in enumerate(self.array_tiers[i]) if t is not Tier.DEVICE]


LOOP_MIN_GROUPS = 6
"""Fewest groups that the update runs in a loop: consecutive equal row slices of one leaf, or of
several leaves alike (`loop_plan`); the first and the last of them (and up to a period's worth
more) stay unrolled around the loop."""


@dataclasses.dataclass(frozen=True)
class LoopRange:
  """Groups run in one `lax.fori_loop` (`stream._loop`): block positions ``1 .. 1 + stages * trips`` of a
  block of equal row slices of `leaves`, taken in turn (slice t of each leaf, then slice t + 1).

  Attributes:
    end: the position (in `loop_plan`'s order) after the loop's last group.
    leaves: the block's leaves, in turn order.
    starts: per leaf, the first row of its block.
    size: rows a slice.
    stages: groups an iteration (the leaves' count, doubled when odd, so that the buffers of two
      consecutive groups alternate in the loop carry instead of swapping places, which XLA copies).
    trips: iterations.
    first: the group at block position 1 (every group of the loop is chunked as it is).
  """

  end: int
  leaves: tuple[int, ...]
  starts: tuple[int, ...]
  size: int
  stages: int
  trips: int
  first: int  # the loop's first group (its chunks are every group's)

  def group(self, b) -> tuple[int, Any]:
    """(leaf, first row) of block position `b` (static ``b % len(leaves)``), as `b` may be traced:
    ``b = stages * p + s`` with `s` static is passed as ``(p, s)``."""
    p, s = b
    n = len(self.leaves)
    j = s % n
    return self.leaves[j], self.starts[j] + (self.stages // n * p + s // n) * self.size


def _loopable(spec: StreamSpec, k: int) -> Piece | None:
  """Group k's piece when the group can be one iteration of a loop over row slices: one row slice
  of a leaf whose state is all in host memory and shares the param's rows (NVMe-tier groups stay
  unrolled: the tier's callbacks take a static group)."""
  unit = spec.units[k]
  if len(unit) != 1 or unit[0].whole:
    return None
  i = unit[0].leaf
  if not all(t is Tier.HOST for t in spec.array_tiers[i]) or not all(spec.dims[i]):
    return None
  return unit[0]


def _runs(spec: StreamSpec, chunks) -> list[tuple[int, int]]:
  """``(first, end)`` of each range of consecutive equal row slices of one leaf (same rows, same
  chunks), at least two."""
  units, out, k = spec.units, [], 0
  while k < len(units):
    first = _loopable(spec, k)
    end = k + 1
    while first is not None and end < len(units):
      piece = _loopable(spec, end)
      prev = units[end - 1][0]
      if (
        piece is None
        or piece.leaf != first.leaf
        or piece.start != prev.stop
        or piece.stop - piece.start != first.stop - first.start
        or chunks(end) != chunks(k)
      ):
        break
      end += 1
    if end - k >= 2:
      out.append((k, end))
    k = end
  return out


def loop_plan(spec: StreamSpec, chunks=None, alike=None) -> tuple[list[int], dict[int, LoopRange]]:
  """The order the device update runs the groups in, and the ranges of it that run in loops.

  Consecutive runs of equal row slices of leaves that are `alike` (same slices, same state arrays
  and chunks: Llama's ``wq``, ``wk``, ``wv``, ``wo``) form one block, whose slices run in turn
  (slice 0 of each leaf, then slice 1, ...), so that one loop serves them all: a program with
  fewer loops, and fewer groups unrolled around them. Other groups keep the plan's order. A block
  of at least `LOOP_MIN_GROUPS` groups runs in a loop of its ``1 .. n`` (`LoopRange`).

  Args:
    spec: the stream spec.
    chunks: ``k -> `` group k's chunks as the update computes them (default: the spec's).
    alike: ``(leaf, leaf) -> bool``, whether two leaves' slices may share a loop (default: no
      two leaves).

  Returns:
    (the groups in update order, ``position -> LoopRange`` of each loop's first position).

  Examples:
    >>> from optax_offload._src.plan import Piece, Tier
    >>> units = tuple((Piece(0, a, a + 2),) for a in range(0, 20, 2)) + ((Piece(0, 20, 21),),)
    >>> spec = StreamSpec(units, ((Tier.HOST,),), ((1,),), (((0, 2),),) * 11)
    >>> order, loops = loop_plan(spec)  # groups 1 to 8 in 4 iterations; 0, 9, 10 unrolled
    >>> order == list(range(11)), loops[1].end, loops[1].trips
    (True, 9, 4)
  """
  chunks = chunks or (lambda k: spec.chunks[k])
  alike = alike or (lambda i, j: False)
  if not spec.loop:
    return list(range(len(spec.units))), {}
  runs = _runs(spec, chunks)
  blocks: list[list[tuple[int, int]]] = []
  for first, end in runs:
    if blocks:
      pf, pe = blocks[-1][-1]
      if (
        pe == first
        and end - first == pe - pf
        and chunks(first) == chunks(pf)
        and spec.chunks[first] == spec.chunks[pf]
        and _size(spec, first) == _size(spec, pf)
        and alike(spec.units[pf][0].leaf, spec.units[first][0].leaf)
      ):
        blocks[-1].append((first, end))
        continue
    blocks.append([(first, end)])
  order, loops, k = [], {}, 0
  for block in blocks:
    first = block[0][0]
    order.extend(range(k, first))
    n = block[0][1] - first
    pos = len(order)
    order.extend(f + t for t in range(n) for f, _ in block)
    period = len(block)
    stages = period if period % 2 == 0 else 2 * period
    trips = (period * n - 2) // stages
    if period * n >= LOOP_MIN_GROUPS and trips >= 2:  # one trip: no smaller than unrolled
      loops[pos + 1] = LoopRange(
        end=pos + 1 + stages * trips,
        leaves=tuple(spec.units[f][0].leaf for f, _ in block),
        starts=tuple(spec.units[f][0].start for f, _ in block),
        size=_size(spec, first),
        stages=stages,
        trips=trips,
        first=order[pos + 1],
      )
    k = block[-1][1]
  order.extend(range(k, len(spec.units)))
  return order, loops


def _size(spec: StreamSpec, k: int) -> int:
  (piece,) = spec.units[k]
  return piece.stop - piece.start


def unrolled_groups(spec: StreamSpec) -> int:
  """Groups of the device update that are not in a loop, at most (`loop_plan`, without blocks of
  several leaves): what the program's size grows with."""
  return len(spec.units) - sum(r.end - p for p, r in loop_plan(spec)[1].items())
