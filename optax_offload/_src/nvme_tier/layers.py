"""Layer rows of a stack's NVMe arrays, fetched and put from inside the backward pass.

`value_and_update` updates a layer stack inside its backward pass, a block of one or two layers at
a time, last layer first, streaming the block's rows through the window in groups. With the
stack's optimizer state in the NVMe tier, each group's rows of each NVMe leaf (all its state
arrays) arrive by one callback (`TracedLayers.fetch`) when the streamed update fetches the group,
and leave by one (`TracedLayers.put`) when it sends the group's new state, threaded on the
update's token (`callbacks.TracedTier`). So the device holds the NVMe rows of the groups in
flight, not the block's, and on a GPU, where JAX copies a callback's operands into host memory
before it runs (jaxlib's ``XlaFfiPythonGpuCallback``), that copy is one leaf's rows of one group
(`host_budget.fused_nvme_block`).

On disk nothing changes: the store groups are the plan's (a stack leaf whole, or in row slices),
so the state that `update_and_apply`, checkpoints and inspection read is the same. Host side, the
first block that needs a store group fetches it whole (one store fetch, from the prefetch pool)
into a writable copy; blocks read their rows from it and write their new rows into it, and once
every row of the group is written the group goes to the store's write-behind thread (one store put)
and the copy is dropped. So host memory holds the groups that the blocks in flight touch (a row
slice of the window's size each; a stack leaf that is not sliced is one group), not the stack.

Read-ahead follows the backward pass: the store's prefetch window is set to the next store group
in the order the backward reaches them (last layer first, the last applied stack first), then the
groups of the leaves updated after it (`NvmeStore.fetch`'s ``then``). `TracedLayers.start`, run
before the forward pass, starts reading the first one, so the disk reads the top layers' state while
the forward computes.

A store group may hold a stack's arrays and other leaves' too (the plan groups small leaves
together): the backward fetches it, and the update after the backward pass reads and writes the
other leaves' arrays in the same host copy (`fetch_members`, `put_members`) before it is put.

Restriction (the caller says so with a clear error): params on one device (the layer callbacks do
not run under `shard_map`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_offload._src.nvme_tier import callbacks
from optax_offload._src.nvme_tier import shards as shards_lib
from optax_offload._src.nvme_tier.shards import Key

_TOKEN = jax.ShapeDtypeStruct((3,), jnp.int32)
FETCH_SCOPE, PUT_SCOPE = "nvme_layer_fetch", "nvme_layer_put"
"""`jax.named_scope`s of the per-piece callbacks (in their HLO ``op_name``): `oo.timeline`'s
``disk`` argument charges disk bytes to callbacks by name."""


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Rows ``[start, stop)`` of an NVMe array, member `member` of store group `group`."""

  group: int
  member: int
  start: int
  stop: int


@dataclasses.dataclass
class _Update:
  """The store groups of one update (one child generation) that are open on the host."""

  parent: int
  child: int
  new: dict[int, list[np.ndarray]] = dataclasses.field(default_factory=dict)
  left: dict[int, int] = dataclasses.field(default_factory=dict)
  fetched: set[int] = dataclasses.field(default_factory=set)


class TracedLayers:
  """The callbacks of the stacks of one traced step: a fetch and a put per NVMe piece of each group
  of a block's streamed update (`value_and_update._BlockRows`).

  Args:
    traced: the update's `callbacks.TracedTier`.
    stacks: per stack, its leaf indices (in the stack's leaf order), in the order the forward pass
      applies the stacks.
    paths: every leaf's path, for messages.

  Raises:
    NotImplementedError: the params are on more than one device, or a store group mixes a stack's
      NVMe arrays with another leaf's.
  """

  def __init__(
    self,
    traced: callbacks.TracedTier,
    stacks: Sequence[Sequence[int]],
    paths: Sequence[str],
  ):
    tier = traced.tier
    if tier.mesh.size != 1:
      raise NotImplementedError(
        "value_and_update with a layer stack's optimizer state in the NVMe tier needs the params "
        f"on one device (they are on a mesh of {tier.mesh.size}); use jax.value_and_grad and "
        "oo.update_and_apply, which stream NVMe state on a mesh."
      )
    self.traced, self.paths = traced, list(paths)
    fused = {i for leaves in stacks for i in leaves}
    self.pieces: dict[Key, list[_Piece]] = {}
    # Store group holding a stack's arrays -> rows (and other members) to put before it is complete.
    self.rows: dict[int, int] = {}
    # Such a group's members of other leaves (the plan groups small leaves together): updated after
    # the backward pass (`fetch_members`, `put_members`) from the copy the backward fetched.
    self.others: dict[int, list[int]] = {}
    for sg, members in enumerate(tier.members):
      if not any(key[0] in fused for key, _ in members):
        continue
      self.others[sg] = [m for m, (key, _) in enumerate(members) if key[0] not in fused]
      self.rows[sg] = len(self.others[sg])
      for m, (key, rows) in enumerate(members):
        if key[0] in fused:
          a, b = rows if rows is not None else (0, tier.arrays[key].shape[0])
          self.pieces.setdefault(key, []).append(_Piece(sg, m, a, b))
          self.rows[sg] += b - a
    stack_keys = [sorted(k for k in self.pieces if k[0] in set(leaves)) for leaves in stacks]
    order: list[int] = []
    for keys in reversed(stack_keys):  # the backward reaches the last applied stack first
      top = {}
      for key in keys:
        for p in self.pieces[key]:
          top[p.group] = max(top.get(p.group, 0), p.stop)
      order.extend(g for g in sorted(top, key=lambda g: (-top[g], g)) if g not in order)
    # Then the groups of the leaves updated after the backward pass, in plan order.
    self.order = order + [g for g in range(len(tier.members)) if g not in self.rows]
    self._open: dict[tuple[int, int], _Update] = {}
    self._lock = threading.Lock()

  # -- host side ---------------------------------------------------------------------------------

  def _update(self, tier, token) -> _Update:
    key = (tier.id, int(token[1]))
    u = self._open.get(key)
    if u is None:
      u = self._open[key] = _Update(int(token[0]), int(token[1]), left=dict(self.rows))
    return u

  def _then(self, u: _Update, after: int) -> list[tuple[int, int]]:
    rest = self.order[self.order.index(after) + 1 :]
    return [(g, u.parent) for g in rest if g not in u.fetched]

  def _group(self, device, tier, u: _Update, sg: int) -> list[np.ndarray]:
    if sg not in u.new:
      if sg in u.fetched:
        raise RuntimeError(
          f"NVMe tier: store group {sg} of a stack was fetched twice in one update."
        )
      u.fetched.add(sg)
      names = tier.names[sg]
      try:
        got = tier.rendezvous.fetch(device, sg, u.parent, names, then=self._then(u, sg))
      except Exception as e:
        held = ", ".join(
          self.paths[key[0]] + ("" if rows is None else f" (layers {rows[0]}-{rows[1] - 1})")
          for key, rows in tier.members[sg]
        )
        raise type(e)(f"the state of {held}: {e}") from e
      u.new[sg] = [np.array(got[name]) for name in names]  # writable: the new rows go here
      stats = tier.layer_stats
      stats["store_fetches"] += 1
      held = sum(a.nbytes for arrays in u.new.values() for a in arrays)
      stats["peak_groups_held"] = max(stats["peak_groups_held"], len(u.new))
      stats["peak_bytes_held"] = max(stats["peak_bytes_held"], held)
    return u.new[sg]

  def _describe(self, start: int, rows: int) -> str:
    return f"layer {start}" if rows == 1 else f"layers {start}-{start + rows - 1}"

  # -- traced side ---------------------------------------------------------------------------------

  def start(self, token: jax.Array) -> jax.Array:
    """Starts reading the first store group the backward pass needs; returns the token."""

    def _start(device, token):
      del device
      tier = self.traced.resolve(int(token[2]))
      if self.order:
        tier.store.prefetch([(self.order[0], int(token[0]))])
      return np.asarray(token)

    return self.traced._shard_local(_start, _TOKEN, None, token, in_specs=None)

  def fetch(self, token: jax.Array, start: jax.Array, rows: int, keys: Sequence[Key]):
    """Rows ``[start, start + rows)`` of the NVMe arrays `keys` (parent generation).

    Returns ({key: array of `rows` rows}, token).
    """
    tier0 = self.traced.tier
    keys = list(keys)
    shapes = [
      jax.ShapeDtypeStruct((rows, *tier0.arrays[k].shape[1:]), tier0.arrays[k].dtype) for k in keys
    ]

    def _fetch(device, token, start):
      tier = self.traced.resolve(int(token[2]))
      start = int(start)
      tier.layer_stats["fetch_callbacks"] += 1
      try:
        with self._lock:
          u = self._update(tier, token)
          out = []
          for key in keys:
            got = []
            for p in self.pieces[key]:
              lo, hi = max(p.start, start), min(p.stop, start + rows)
              if lo < hi:
                got.append(
                  self._group(device, tier, u, p.group)[p.member][lo - p.start : hi - p.start]
                )
            # A view, not a copy: the callback copies it into the program's buffer at once.
            out.append(np.concatenate(got) if len(got) > 1 else got[0])
      except Exception as e:
        raise type(e)(
          f"value_and_update: reading the optimizer state of {self._describe(start, rows)} of a "
          f"layer stack from NVMe generation {int(token[0])} failed: {e}"
        ) from e
      return [np.asarray(token), *out]

    with jax.named_scope(FETCH_SCOPE):  # the step-time model finds the disk reads by this name
      token, *flat = self.traced._shard_local(
        _fetch, [_TOKEN, *shapes], None, token, start, in_specs=None
      )
    return dict(zip(keys, flat)), token

  def put(self, token: jax.Array, start: jax.Array, new: dict[Key, Any]) -> jax.Array:
    """Hands the new rows from ``start`` on of the NVMe arrays `new` (by key, each a piece's rows;
    child generation) over; a store group goes to the writer once all its rows are in.
    Returns the token."""
    keys = list(new)

    def _put(device, token, start, *arrays):
      tier = self.traced.resolve(int(token[2]))
      start = int(start)
      tier.layer_stats["put_callbacks"] += 1
      with self._lock:
        u = self._update(tier, token)
        done = []
        for key, x in zip(keys, arrays):
          off = 0
          for p in self.pieces[key]:
            lo, hi = max(p.start, start), min(p.stop, start + len(x))
            if lo < hi:
              self._group(device, tier, u, p.group)[p.member][lo - p.start : hi - p.start] = x[
                off : off + hi - lo
              ]
              off += hi - lo
              u.left[p.group] -= hi - lo
              if u.left[p.group] == 0:
                done.append(p.group)
        ready = self._ready(tier, u, done)
      self._put_ready(device, tier, u, ready)
      return np.asarray(token)

    with jax.named_scope(PUT_SCOPE):
      return self.traced._shard_local(
        _put, _TOKEN, None, token, start, *[new[k] for k in keys], in_specs=None
      )

  def _ready(self, tier, u: _Update, done: list[int]):
    ready = [(sg, u.new.pop(sg)) for sg in done]
    if all(n == 0 for n in u.left.values()):
      del self._open[(tier.id, u.child)]
    return ready

  def _put_ready(self, device, tier, u: _Update, ready) -> None:
    for sg, arrays in ready:
      tier.layer_stats["store_puts"] += 1
      names = tier.names[sg]
      tier.rendezvous.put(device, sg, u.child, dict(zip(names, arrays)), names)

  def fetch_members(self, sg: int, token: jax.Array):
    """The arrays of store group `sg`'s members of other leaves than the stacks' (parent
    generation), by key, from the copy the backward pass fetched. Returns (arrays, token)."""
    tier0 = self.traced.tier
    members = [tier0.members[sg][m] for m in self.others[sg]]
    shapes = [
      jax.ShapeDtypeStruct(tier0.arrays[key].shard_shape(rows), tier0.arrays[key].dtype)
      for key, rows in members
    ]

    def _fetch(device, token):
      tier = self.traced.resolve(int(token[2]))
      with self._lock:
        group = self._group(device, tier, self._update(tier, token), sg)
        out = [np.array(group[m]) for m in self.others[sg]]
      return [np.asarray(token), *out]

    token, *flat = self.traced._shard_local(_fetch, [_TOKEN, *shapes], None, token, in_specs=None)
    return dict(zip([key for key, _ in members], flat)), token

  def put_members(self, sg: int, token: jax.Array, parts: Any) -> jax.Array:
    """Writes store group `sg`'s members of other leaves (`parts` by leaf index, as
    `callbacks.TracedTier.put` takes them); the group goes to the writer once complete."""
    tier0 = self.traced.tier
    members = [tier0.members[sg][m] for m in self.others[sg]]
    flat = shards_lib.select(parts, [key for key, _ in members])

    def _put(device, token, *arrays):
      tier = self.traced.resolve(int(token[2]))
      with self._lock:
        u = self._update(tier, token)
        group = self._group(device, tier, u, sg)
        for m, x in zip(self.others[sg], arrays):
          group[m][...] = x
        u.left[sg] -= len(arrays)
        ready = self._ready(tier, u, [sg] if u.left[sg] == 0 else [])
      self._put_ready(device, tier, u, ready)
      return np.asarray(token)

    return self.traced._shard_local(_put, _TOKEN, None, token, *flat, in_specs=None)
