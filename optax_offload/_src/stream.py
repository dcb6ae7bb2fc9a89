"""The grouped update: the inner transformation run group by group, each group's state streamed.

`run` is the one loop behind `offload`'s update (and the reference semantics its tests compare
against). The plan's groups (`plan.Plan.units`) hold pieces: whole leaves, or row slices of big
leaves. For each group, in order:

1. its offloaded state arrives on the device (host tier: one copy per array, of a slice of the host
   array for a row slice; NVMe tier: the group's store fetch);
2. the inner transformation updates it in `StreamSpec.chunks` row chunks, each written back into
   the arrived buffers (`dynamic_update_slice`, which XLA does in place), so a group costs its own
   size on the device, not twice that (with ``tx.update``: the pieces whose updates are written
   into one buffer anyway, `_Run.chunks`; the others in one update, fused with
   ``optax.apply_updates``);
3. its new state leaves the device while the next group computes (host tier: a copy, or a
   `dynamic_update_slice` into the donated host array for a row slice; NVMe: the group's put).

Program order on the device (``placement="device"``): stage k computes group k; the previous
group's new state leaves during the first half of its chunks, and the next group's state arrives
during the second half, once the leaving copies are done. `jax.lax.optimization_barrier`s fix that
order, so at most two groups' state is on the device at once (the window) and every copy can be in
flight while some update computes. XLA:GPU keeps at most two copies in flight: with one update
computation per group only half of a group's copies (two in, two out for Adam) could overlap
compute, hence at least two chunks per group.

Under a trace, a run of equal consecutive row slices of one leaf, or the slices of several alike
leaves taken in turn (`stream_spec.loop_plan`), is one `lax.fori_loop` of those stages, the
slice's row traced (`_loop`): the program does not grow with the number of slices (XLA:GPU's
compile time grew faster than it), and alike leaves (a Llama layer's four attention matrices)
share one loop.

Params and gradients that live in host memory (weights offloaded too, as `offloaded_scan` leaves
them) travel with their leaf's state: their slices arrive with the group, and with `apply` the new
params are written into the group's param buffer and leave with its state
(`_Run.stream_host_params`).

With ``placement="host"`` each group's update runs on the host next to its state
(``compute_on("device_host")``): only the group's gradients (and params) go to the host and its
updates come back.

Length: over the ~500 lines we aim for: one engine with three placements (device window, host
compute, no placement) and the streamed weights and gradients, which share the per-group fetch,
compute and send of `_Run`; splitting the placements apart would split that class's state. What it
runs (the `StreamSpec` and the loops) is planned in `stream_spec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_offload._src import _compat
from optax_offload._src import host_compute
from optax_offload._src import memory
from optax_offload._src import stream_spec
from optax_offload._src.memory import DEVICE
from optax_offload._src.memory import HOST
from optax_offload._src.plan import Piece
from optax_offload._src.plan import Tier
from optax_offload._src.stream_spec import LoopRange
from optax_offload._src.stream_spec import StreamSpec

Key = tuple[int, int]
"""(leaf index, index of the array in the leaf's flattened state part, or `PARAM` / `GRAD`)."""

PARAM, GRAD = -1, -2
"""Array indices of a leaf's param and gradient when they live in host memory and stream through
the window with its state (weights offloaded too)."""


Box = tuple[tuple[int, int], ...]
"""(start, stop) along each of an array's leading axes; the other axes are whole."""


_TRACED_FOR: list[str] = []


@contextlib.contextmanager
def traced_for(platform: str):
  """Updates traced inside are for `platform` (e.g. ``"cuda"``), whatever the default backend:
  `gpu_program.compile_for_gpu` traces on this machine's CPU devices a program it compiles for a
  GPU."""
  _TRACED_FOR.append(platform)
  try:
    yield
  finally:
    _TRACED_FOR.pop()


def _traced_for_cpu() -> bool:
  """Whether the update being traced will run on a CPU (`traced_for`, else the default
  backend)."""
  return (_TRACED_FOR[-1] if _TRACED_FOR else jax.default_backend()) == "cpu"


def _chunk_bounds(start: int, stop: int, chunks: int) -> list[tuple[int, int]]:
  bounds = [start + (stop - start) * q // chunks for q in range(chunks + 1)]
  return list(zip(bounds, bounds[1:]))


def _slice(x: jax.Array, start: int, stop: int) -> jax.Array:
  return _take(x, ((start, stop),), 1)


def _put_rows(x: jax.Array, value: jax.Array, start: int) -> jax.Array:
  return _write(x, value, ((start, start + value.shape[0]),), 1)


def _take(x: jax.Array, box: Box, depth: int) -> jax.Array:
  """The box of `x` along its first `depth` axes (the box's first ones)."""
  box = box[: min(depth, len(box))]
  if all(a == 0 and b == n for (a, b), n in zip(box, x.shape)):
    return x
  starts = [a for a, _ in box] + [0] * (x.ndim - len(box))
  limits = [b for _, b in box] + list(x.shape[len(box) :])
  return lax.slice(x, starts, limits)


def _on_mesh_of(x: jax.Array, value: jax.Array) -> jax.Array:
  """`x`, typed on `value`'s mesh when it has none (an NVMe-tier fetch, from a callback, beside
  gradients on an explicit mesh): `lax.dynamic_update_slice` wants the two on one mesh."""
  x_mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  v_sharding = jax.typeof(value).sharding
  v_mesh = getattr(v_sharding, "mesh", None)
  if x_mesh is not None and v_mesh is not None and x_mesh.empty and not v_mesh.empty:
    return jax.sharding.reshard(x, v_sharding)
  return x


def _write(x: jax.Array, value: jax.Array, box: Box, depth: int) -> jax.Array:
  """`x` with `value` written at the box (first `depth` axes); XLA does it in place."""
  if value.shape == x.shape:
    return value
  x = _on_mesh_of(x, value)
  box = box[: min(depth, len(box))]
  starts = [a for a, _ in box] + [0] * (x.ndim - len(box))
  return lax.dynamic_update_slice(x, value.astype(x.dtype), starts)


def _take_at(x: jax.Array, box: Box, depth: int, shift) -> jax.Array:
  """`_take`, the box's rows moved by `shift` (None, or a traced row: a dynamic slice)."""
  if shift is None:
    return _take(x, box, depth)
  box = box[: min(depth, len(box))]
  starts = [box[0][0] + shift] + [a for a, _ in box[1:]] + [0] * (x.ndim - len(box))
  sizes = [b - a for a, b in box] + list(x.shape[len(box) :])
  return lax.dynamic_slice(x, starts, sizes)


def _write_at(x: jax.Array, value: jax.Array, box: Box, depth: int, shift) -> jax.Array:
  """`_write`, the box's rows moved by `shift` (None, or a traced row)."""
  if shift is None:
    return _write(x, value, box, depth)
  box = box[: min(depth, len(box))]
  starts = [box[0][0] + shift] + [a for a, _ in box[1:]] + [0] * (x.ndim - len(box))
  return lax.dynamic_update_slice(x, value.astype(x.dtype), starts)


def _local(box: Box, start: int) -> Box:
  """A leaf's box in the coordinates of a piece starting at row `start`."""
  return ((box[0][0] - start, box[0][1] - start),) + box[1:]


_TRACED_UPDATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per inner update, per trace it is called in: its jitted call (`_inner_update`)."""


def _inner_update(inner):
  """``inner.update``; inside a trace, a jitted call, so that the many chunk and group updates of
  the same shapes are traced once (XLA inlines the call: the program is the same).

  Once per trace: a jitted call kept beyond it would keep its own trace of `inner` too, with what
  Python values `inner` read then (a schedule reading a global, as plain optax re-reads in a new
  ``jax.jit``)."""

  def call(grads, state, params, extra_args):
    tracers = [x for x in jax.tree.leaves(grads) if isinstance(x, _compat.Tracer)]
    if not tracers:
      return inner.update(grads, state, params, **extra_args)
    update = inner.update
    per_trace = _TRACED_UPDATES.setdefault(update, weakref.WeakKeyDictionary())
    trace = tracers[0]._trace
    if trace not in per_trace:
      per_trace[trace] = jax.jit(lambda g, s, p, kw: update(g, s, p, **kw))
    return per_trace[trace](grads, state, params, extra_args)

  return call


def _applied(p: jax.Array, u: jax.Array) -> jax.Array:
  """``optax.apply_updates`` of one leaf (or slice of it): ``p + u`` in the param's dtype."""
  return jnp.asarray(p + u).astype(jnp.result_type(p))


class _Run:
  """The arrays of one update as they change, and the computation of one group's chunks.

  Args:
    inner, layout, spec: the inner transformation, the `StateLayout`, the `StreamSpec`.
    grads, params: leaves (params None when not given); indexable by leaf.
    shared: the shared leaves of the inner state.
    arrays: ``(leaf, j) -> array`` of the state parts.
    treedefs: per leaf, the tree structure of its state part.
    n_rows: per leaf, the length of its leading axis.
    extra_args: passed to every inner update.
  """

  def __init__(
    self,
    inner,
    layout,
    spec,
    grads,
    params,
    shared,
    arrays,
    treedefs,
    n_rows,
    extra_args,
    apply,
    grad_transform=None,
    row_offset=None,
    grad_dtypes=None,
  ):
    self.inner, self.layout, self.spec = inner, layout, spec
    self.grad_transform = grad_transform
    self.grad_dtypes = grad_dtypes
    self.row_offset = row_offset
    # A traced row, in `_loop`: the pieces' rows of the gradients, params and updates start there
    # (their rows 0.. in the pieces' own coordinates, as the fetched state's are).
    self.row_shift = None
    # In `_loop`: the pieces' rows of the gradients, cut out before the chunks. On XLA:CPU a
    # buffer of its own, read as the unrolled chunks read the gradients: read through a dynamic
    # slice in each chunk, bf16 gradients gave mu and nu an ulp apart from the unrolled form's.
    # Elsewhere (XLA:GPU) the cut fuses into the chunks (a buffer of its own cost 0.25 of the
    # window in device temporaries).
    self.grad_rows = None
    self.grads, self.params, self.shared_in = grads, params, shared
    self.arrays: dict[Key, Any] = dict(arrays)
    self.treedefs, self.n_rows, self.extra_args = treedefs, n_rows, extra_args
    self.apply = apply
    # With tx.update on the device window (`run`): leaf -> whether its pieces' updates are
    # computed in the spec's chunks too (`chunks`); None: one chunk a piece.
    self.chunk_updates: dict[int, bool] | None = None
    self.new_shared = None
    # Per leaf: the updates (or, with `apply`, the new params) written so far.
    self.updates: dict[int, Any] = {}
    # Params and grads that live in host memory (weights offloaded too): see `stream_host_params`.
    self.moving: dict[int, list[int]] = {}

  def stream_host_params(self) -> None:
    """Params and grads that live in host memory stream through the window with the state, as
    arrays ``(leaf, PARAM)`` and ``(leaf, GRAD)``; the new params go back to host memory."""
    for i, g in enumerate(self.grads):
      extra = []
      if self.params is not None and memory.in_host(self.params[i]):
        if not self.apply:
          raise ValueError(
            "offload: params in host memory need oo.update_and_apply (the updates are applied "
            "group by group; tx.update would bring every update to the device)."
          )
        self.arrays[(i, PARAM)] = self.params[i]
        extra.append(PARAM)
      if g is not None and memory.in_host(g):
        self.arrays[(i, GRAD)] = g
        extra.append(GRAD)
      if extra:
        self.moving[i] = extra

  def alike(self, i: int, j: int) -> bool:
    """Whether the row slices of leaves i and j may share a loop (`loop_plan`): the same trailing
    shapes and dtypes of gradients, params and state arrays, tiers, moves and chunking."""

    def form(k):
      arrays = [self.arrays[(k, n)] for n in range(len(self.spec.array_tiers[k]))]
      return (
        [(jnp.shape(x)[1:], jnp.result_type(x)) for x in arrays],
        jnp.shape(self.grads[k])[1:],
        jnp.result_type(self.grads[k]),
        None if self.params is None else jnp.result_type(self.params[k]),
        None if self.grad_dtypes is None else self.grad_dtypes[k],
        self.treedefs[k],
        self.spec.array_tiers[k],
        self.spec.dims[k],
        self.moving.get(k),
        None if self.chunk_updates is None else self.chunk_updates.get(k),
      )

    return form(i) == form(j)

  def offset_rows(self, i: int, j: int) -> bool:
    """Whether array j of leaf i is a host-tier array whose rows start at `row_offset` (a larger
    array than the gradients: the update of a block of rows of it)."""
    return (
      self.row_offset is not None
      and j not in (PARAM, GRAD)
      and self.spec.array_tiers[i][j] is Tier.HOST
      and bool(self.spec.dims[i][j])
    )

  def piece_rows(self, piece: Piece) -> tuple[int, int]:
    return (0, self.n_rows[piece.leaf]) if piece.whole else (piece.start, piece.stop)

  def fetch(self, k: int, fetched: dict[Key, Any], space) -> dict[tuple[int, int], Any]:
    """Group k's offloaded arrays (NVMe ones from `fetched`), moved to `space` (None: not moved)."""
    bufs = {}
    for n, piece in enumerate(self.spec.units[k]):
      i = piece.leaf
      start, stop = self.piece_rows(piece)
      for j in self.spec.offloaded(i) + self.moving.get(i, []):
        if j not in (PARAM, GRAD) and self.spec.array_tiers[i][j] is Tier.NVME:
          x = fetched[(i, j)]
        elif self.offset_rows(i, j):
          x = lax.dynamic_slice_in_dim(self.arrays[(i, j)], self.row_offset + start, stop - start)
        else:
          x = self.arrays[(i, j)]
          if not piece.whole and (j in (PARAM, GRAD) or self.spec.dims[i][j]):
            x = _slice(x, start, stop)
        bufs[(n, j)] = x if space is None else memory.to_space(x, space)
    return bufs

  def send(self, k: int, bufs, space) -> dict[int, Any]:
    """Writes group k's new offloaded arrays back (moved to `space` first unless None).

    Returns the NVMe-tier parts, by leaf, for `nvme_tier.TracedTier.put`.
    """
    nvme_parts: dict[int, list[Any]] = {}
    for n, piece in enumerate(self.spec.units[k]):
      i = piece.leaf
      for j in self.spec.offloaded(i) + ([PARAM] if PARAM in self.moving.get(i, []) else []):
        x = bufs[(n, j)]
        if j == PARAM:
          x = x if space is None else memory.to_space(x, space)
          x = x if piece.whole else _put_rows(self.arrays[(i, j)], x, piece.start)
          self.arrays[(i, j)] = self.updates[i] = x
          continue
        if self.spec.array_tiers[i][j] is Tier.NVME:
          nvme_parts.setdefault(i, [None] * len(self.spec.array_tiers[i]))[j] = x
          continue
        x = x if space is None else memory.to_space(x, space)
        if self.offset_rows(i, j):
          start = self.row_offset + self.piece_rows(piece)[0]
          x = lax.dynamic_update_slice_in_dim(self.arrays[(i, j)], x, start, 0)
        elif not piece.whole and self.spec.dims[i][j]:
          x = _put_rows(self.arrays[(i, j)], x, piece.start)
        self.arrays[(i, j)] = x
    return {
      i: self.treedefs[i].unflatten(
        [a if a is not None else self.arrays[(i, j)] for j, a in enumerate(arrays)]
      )
      for i, arrays in nvme_parts.items()
    }

  def grad_source(self, i: int) -> jax.Array:
    # A leaf's chunks read the gradient from the buffer their updates are written into (when that
    # buffer started as the gradient), so that XLA can write them in place of the gradient.
    u = self.updates.get(i)
    if self.apply or u is None or jnp.result_type(u) != jnp.result_type(self.grads[i]):
      return self.grads[i]
    return u

  def param_source(self, i: int) -> jax.Array:
    # With `apply`, chunks read the params from the buffer the new params are written into.
    return self.updates.get(i, self.params[i]) if self.apply else self.params[i]

  def put_update(self, i: int, u: jax.Array, box: Box, whole: bool) -> None:
    if self.apply:  # optax.apply_updates, on the chunk
      p = self.params[i] if whole else _take_at(self.param_source(i), box, len(box), self.row_shift)
      u = _applied(p, u)
    if whole:
      self.updates[i] = u
      return
    base = self.updates.get(i)
    if base is None:
      base = self.updates_buffer(i, jnp.result_type(u))
    self.updates[i] = _write_at(base, u, box, len(box), self.row_shift)

  def updates_buffer(self, i: int, dtype) -> jax.Array:
    """The buffer leaf i's row slices write their updates (or new params) into."""
    base = self.params[i] if self.apply else self.grads[i]
    if jnp.result_type(base) != dtype:
      # One buffer for the leaf's updates, every piece written into it in place. Through a
      # barrier, so that XLA cannot fold the first write into a `pad` of that piece (a second
      # leaf-sized producer of the buffer, computed with the piece's update).
      base = lax.optimization_barrier(jnp.zeros(jnp.shape(base), dtype))
    return base

  def chunks(self, k: int) -> tuple[tuple[int, int], ...]:
    """``(axis, count)`` of group k's pieces: the spec's when the updates are applied here, else
    one chunk each.

    Chunks make the update in place, but an update written chunk by chunk reaches
    ``optax.apply_updates`` materialized, so XLA can no longer fuse ``p + u`` into the update (as it
    does for plain optax, with a different rounding). So `update_and_apply` chunks; ``tx.update``
    on the device window (`chunk_updates`) chunks a leaf's pieces where its updates are written into
    one buffer anyway: row slices, and, in a program for a GPU, whole leaves whose updates have the
    gradient's dtype (written in place of the gradient; a param-sized buffer of their own
    otherwise, which one chunk avoids: XLA fuses ``p + u`` into the update and writes the new
    params in place). On a CPU, where no copy overlaps anything, whole leaves keep one chunk and
    plain optax's bits.
    """
    unit = self.spec.units[k]
    if self.apply:
      return self.spec.chunks[k]
    if self.chunk_updates is None:
      return ((0, 1),) * len(unit)
    return tuple(
      c if self.chunk_updates.get(p.leaf) else (0, 1) for p, c in zip(unit, self.spec.chunks[k])
    )

  def chunk_box(self, piece: Piece, axis: int, count: int, q: int) -> Box:
    """The box of a piece's chunk q, in the leaf's coordinates."""
    start, stop = self.piece_rows(piece)
    if axis == 0:
      return (_chunk_bounds(start, stop, count)[q],)
    cols = jnp.shape(self.grads[piece.leaf])[1]
    return ((start, stop), _chunk_bounds(0, cols, count)[q])

  def compute(self, k: int, q: int, bufs: dict[tuple[int, int], Any]) -> None:
    """Updates chunk q of every piece of group k that has more than q chunks, in one inner update."""
    unit, chunks = self.spec.units[k], self.chunks(k)
    members = [(n, p) for n, p in enumerate(unit) if q < chunks[n][1]]
    grads, params, parts, boxes = {}, {}, {}, {}
    for n, piece in members:
      i = piece.leaf
      box = self.chunk_box(piece, *chunks[n], q)
      start = self.piece_rows(piece)[0]
      full = all(a == 0 and b == d for (a, b), d in zip(box, jnp.shape(self.grads[i])))
      boxes[n] = (box, full)
      ndim = jnp.ndim(self.grads[i])
      local = _local(box, start)
      if (n, GRAD) in bufs:
        grads[i] = _take(bufs[(n, GRAD)], local, ndim)
      else:
        source = self.grad_source(i)
        if self.grad_rows is not None and source is self.grads[i]:
          grads[i] = _take(self.grad_rows, box, ndim)
        else:
          grads[i] = _take_at(source, box, ndim, self.row_shift)
      if self.grad_dtypes is not None:
        grads[i] = grads[i].astype(self.grad_dtypes[i])
      if self.grad_transform is not None:
        grads[i] = self.grad_transform(grads[i])
      if (n, PARAM) in bufs:
        params[i] = _take(bufs[(n, PARAM)], local, ndim)
      elif self.params is not None:
        params[i] = _take_at(self.param_source(i), box, ndim, self.row_shift)
      views = []
      for j, tier in enumerate(self.spec.array_tiers[i]):
        depth = self.spec.dims[i][j]
        if tier is Tier.DEVICE:
          views.append(_take(self.arrays[(i, j)], box, depth))
        else:
          views.append(_take(bufs[(n, j)], _local(box, start), depth))
      parts[i] = self.treedefs[i].unflatten(views)
    group = sorted(parts)
    n_leaves = self.layout.num_leaves
    u, s = _inner_update(self.inner)(
      self.layout.masked([grads.get(i) for i in range(n_leaves)], group),
      self.layout.view(self.shared_in, parts, group),
      None
      if self.params is None
      else self.layout.masked([params.get(i) for i in range(n_leaves)], group),
      self.extra_args,
    )
    new_shared, new_parts = self.layout.unview(s, group)
    if self.new_shared is None:
      self.new_shared = new_shared
    updates = dict(zip(group, self.layout.group_leaves(u, group)))
    for n, piece in members:
      i = piece.leaf
      box, full = boxes[n]
      start = self.piece_rows(piece)[0]
      for j, new in enumerate(jax.tree.leaves(new_parts[i])):
        depth = self.spec.dims[i][j]
        if self.spec.array_tiers[i][j] is Tier.DEVICE:
          if depth and not full:
            self.arrays[(i, j)] = _write(self.arrays[(i, j)], new, box, depth)
          elif q == 0:
            self.arrays[(i, j)] = new
        elif depth and chunks[n][1] > 1:
          bufs[(n, j)] = _write(bufs[(n, j)], new, _local(box, start), depth)
        elif q == 0:
          bufs[(n, j)] = new
      if (n, PARAM) in bufs:  # params in host memory: the chunk's new params, in the group's buffer
        new_p = _applied(params[i], updates[i])
        bufs[(n, PARAM)] = _write(bufs[(n, PARAM)], new_p, _local(box, start), len(box))
      else:
        self.put_update(i, updates[i], box, full)


def run(
  inner,
  layout,
  spec: StreamSpec,
  grads: Sequence[jax.Array],
  shared: Sequence[Any],
  per_leaf: Sequence[Any],
  params: Sequence[jax.Array] | None,
  extra_args: dict[str, Any],
  *,
  placement: str = "none",
  nvme: Any = None,
  generation: Any = None,
  store: Any = None,
  apply: bool = False,
  grad_transform: Any = None,
  row_offset: Any = None,
  grad_dtypes: Sequence[Any] | None = None,
  update_dtypes: Sequence[Any] | None = None,
  chunk_updates: dict[int, bool] | None = None,
) -> tuple[list[Any], list[Any], list[Any], Any]:
  """Runs the inner update group by group.

  Args:
    inner: the inner transformation (with extra-args support).
    layout: the `StateLayout` of the parameter tree.
    spec: groups, tiers and chunks.
    grads: gradient leaves.
    shared: the shared leaves of the inner state (`StateLayout.split`).
    per_leaf: each leaf's state part (host-tier arrays in host memory; NVMe-tier placeholders).
    params: param leaves, or None.
    extra_args: passed to every inner update.
    placement: ``"none"`` (no moves: the reference semantics), ``"device"`` (stream through the
      device window) or ``"host"`` (update each group on the host, next to its state).
    nvme: the NVMe tier's callbacks (`nvme_tier.TracedTier`), or None.
    generation: the NVMe generation the state names (traced), when `nvme` is given.
    store: the NVMe store id the state names (traced): the update runs on that store (of `nvme`'s
      layout), so a program traced before `close_nvme` serves a state of a later ``tx.init``.
    apply: return new params (``optax.apply_updates`` of each chunk's updates, written into the
      params' buffers) instead of updates.
    grad_transform: an elementwise function applied to every chunk of the gradients before the
      inner update (global-norm clipping, once the norm is known), or None.
    row_offset: None, or a (traced) row: the host-tier state arrays are larger than the gradients
      along their leading axis, and the update is of their rows from this one on (a block of
      layers of a stack, updated inside the backward pass); those rows are read and written in
      place.
    grad_dtypes: None, or per leaf the dtype every chunk of its gradients is cast to before
      `grad_transform` (accumulated float32 gradients cast back to the gradients' dtype, as
      ``optax.MultiSteps`` does).
    update_dtypes: None, or per leaf the dtype of its updates (the params', or the master's with
      `master_dtype`): without `apply`, on the device window of a GPU, a whole leaf whose updates
      have its gradient's dtype is updated in the spec's chunks (`_chunked_updates`).
    chunk_updates: None, or per leaf whether its updates (without `apply`) are computed in the
      spec's chunks, in place of `_chunked_updates`' choice (the split probes' column chunks).

  Returns:
    (update leaves, or new param leaves with `apply`; new shared leaves; new per-leaf parts; new
    NVMe generation).
  """
  arrays, treedefs = {}, []
  for i, part in enumerate(per_leaf):
    flat, treedef = jax.tree.flatten(part)
    treedefs.append(treedef)
    arrays.update({(i, j): x for j, x in enumerate(flat)})
  n_rows = [jnp.shape(g)[0] if jnp.ndim(g) else 1 for g in grads]
  if apply and params is None:
    raise ValueError("applying the updates needs the params")
  r = _Run(
    inner,
    layout,
    spec,
    list(grads),
    params,
    shared,
    arrays,
    treedefs,
    n_rows,
    extra_args,
    apply,
    grad_transform,
    row_offset,
    grad_dtypes,
  )
  if chunk_updates is not None:
    r.chunk_updates = dict(chunk_updates)
  elif placement == "device" and not apply and len(spec.units) > 1:
    r.chunk_updates = _chunked_updates(spec, grads, params, update_dtypes) or None
  if placement != "host":
    r.stream_host_params()
  elif apply and any(p is not None and memory.in_host(p) for p in params):
    raise NotImplementedError(
      "offload: update_on='host' with params in host memory is not supported yet; use "
      "update_on='device', which streams them through the window with the state."
    )
  token = nvme.begin(generation, store=store) if nvme is not None else generation
  if placement == "host":
    token = _run_on_host(r, nvme, token)
  else:
    token = _run_streamed(r, nvme, token, on_device=placement == "device")
  new_generation = nvme.commit(token) if nvme is not None else generation
  per_leaf = [
    treedef.unflatten(
      [
        jnp.zeros((0,), r.arrays[(i, j)].dtype) if t is Tier.NVME else r.arrays[(i, j)]
        for j, t in enumerate(spec.array_tiers[i])
      ]
    )
    for i, treedef in enumerate(treedefs)
  ]
  new_shared = r.new_shared if r.new_shared is not None else shared
  if placement != "none":
    new_shared = memory.to_space(new_shared, DEVICE)
  return [r.updates.get(i) for i in range(layout.num_leaves)], new_shared, per_leaf, new_generation


def _chunked_updates(spec: StreamSpec, grads, params, update_dtypes) -> dict[int, bool]:
  """Leaf -> whether ``tx.update`` computes its pieces in the spec's chunks (`_Run.chunks`), in a
  program for a GPU: a leaf updated in row slices, and a whole leaf whose updates have its
  gradient's dtype (written in place of the gradient).

  On a CPU none (no copy overlaps anything there, and one update a piece keeps the bits every tier
  and plain optax had), nor for params on a mesh of several devices (`StreamSpec.loop`; not tried
  there yet).
  """
  if not spec.loop or _traced_for_cpu():
    return {}
  dtypes = update_dtypes or [jnp.result_type(p) for p in (params or grads)]
  sliced = {p.leaf for unit in spec.units for p in unit if not p.whole}
  return {
    i: i in sliced or jnp.result_type(g) == jnp.dtype(d)
    for i, (g, d) in enumerate(zip(grads, dtypes))
  }


def _run_streamed(r: _Run, nvme, token, on_device: bool):
  units = r.spec.units
  space_in = DEVICE if on_device else None
  staged = on_device and len(units) > 1

  def host_keys(k):
    return {
      (p.leaf, j)
      for p in units[k]
      for j in r.spec.offloaded(p.leaf) + r.moving.get(p.leaf, [])
      if j in (PARAM, GRAD) or r.spec.array_tiers[p.leaf][j] is Tier.HOST
    }

  def fetch(k, token):
    fetched = {}
    if nvme is not None and k in nvme.groups:
      fetched, token = nvme.fetch(k, token)
    return r.fetch(k, fetched, space_in), token

  def send(k, bufs, token):
    nvme_parts = r.send(k, bufs, HOST if on_device else None)
    if nvme_parts:
      token = nvme.put(k, token, nvme_parts)
    return token

  # Equal row slices of one leaf run in loops under a trace (not the update of a block of rows in
  # the backward pass, whose few groups stay unrolled). Eagerly, unrolled: a loop's body would be
  # compiled and fused where the eager update runs op by op (other bits; lion's state differed).
  traced = any(isinstance(x, _compat.Tracer) for x in jax.tree.leaves(r.grads))
  order, loops = list(range(len(units))), {}
  if staged and traced and r.row_offset is None:
    # Alike leaves share a loop with update_and_apply; with tx.update, whose updates buffers
    # would all ride in the loop's carry, the device temporaries of two stacked bf16 leaves with
    # master weights grew 86.6 -> 96.5 MiB (measured once; the case of
    # tests/test_gpu_program.py's tx_update test, which pins 86.6), so one loop a leaf.
    order, loops = stream_spec.loop_plan(r.spec, r.chunks, r.alike if r.apply else None)
  bufs, token = fetch(order[0], token)
  previous = None  # (k, bufs) of the group whose new state has not left yet
  pos = 0
  while pos < len(order):
    k = order[pos]
    following = order[pos + 1] if pos + 1 < len(order) else None
    if pos in loops:
      # Its groups in one loop; it leaves them as the unrolled ones would: the last one computed
      # and not sent (`previous`), the next one arrived (`bufs`).
      loop = loops[pos]
      for i in loop.leaves:  # every leaf's updates buffer in the loop's carry
        if PARAM not in r.moving.get(i, []) and i not in r.updates:
          r.updates[i] = r.updates_buffer(i, jnp.result_type(r.updates[loop.leaves[0]]))
      bufs, prev_bufs, token = _loop(r, loop, bufs, previous[1], token)
      previous = (order[loop.end - 1], prev_bufs)
      pos = loop.end
      continue
    if staged:
      # Stage boundary: group k's state has arrived and the previous group is computed.
      sources = (
        {key: r.arrays[key] for key in sorted(host_keys(following))}
        if following is not None
        else {}
      )
      prev_bufs = previous[1] if previous else None
      # The previous group's updates written slice by slice pass the boundary too: XLA would
      # otherwise recompute them where they are used (optax.apply_updates, after the last group),
      # keeping every group's results alive until then. A whole leaf's updates stay free to fuse
      # into that use.
      done = {}
      if previous:
        done = {
          p.leaf: r.updates[p.leaf]
          for p, (_, c) in zip(units[previous[0]], r.chunks(previous[0]))
          if not (p.whole and c == 1) and p.leaf in r.updates
        }
      bufs, prev_bufs, sources, done, token = lax.optimization_barrier(
        (bufs, prev_bufs, sources, done, token)
      )
      r.arrays.update(sources)
      r.updates.update(done)
      if previous:
        previous = (previous[0], prev_bufs)
    if previous:
      token = send(previous[0], previous[1], token)
    phases = max(c for _, c in r.chunks(k))
    # The next group's state arrives only once the previous group's has left (the window), and
    # after the first half of the chunks, so that both kinds of copies overlap some compute. With
    # one chunk, only one kind can: the arriving copies (the prefetch).
    gate = (phases - 1) // 2 if phases > 1 else -1
    if not (staged and following is not None):
      gate = None
    leaves = sorted({p.leaf for p in units[k]})
    for q in range(-1, phases):
      if q >= 0:
        r.compute(k, q, bufs)
      if not on_device or q == phases - 1 or (q == -1 and gate != -1):
        continue
      # One chunk after the other: without a barrier XLA sees that each chunk reads rows the
      # previous one did not write, computes all chunks first and keeps all their results alive.
      done = {i: r.updates[i] for i in leaves if i in r.updates}
      keys = set()
      if q == gate:
        keys = host_keys(following) | (host_keys(previous[0]) if previous else set())
      gated = {key: r.arrays[key] for key in sorted(keys)}
      bufs, done, gated, token = lax.optimization_barrier((bufs, done, gated, token))
      r.updates.update(done)
      r.arrays.update(gated)
    previous = (k, bufs)
    if following is not None:
      bufs, token = fetch(following, token)
    pos += 1
  return send(previous[0], previous[1], token)


def _loop(r: _Run, loop: LoopRange, bufs, prev_bufs, token):
  """A loop's groups (`LoopRange`) in a `lax.fori_loop` of ``loop.stages`` groups an iteration, as
  the unrolled stages run them: a group computes in its chunks while the previous group's new
  state leaves (dynamic_update_slice into the host arrays, in place) and then the next group's
  arrives (a dynamic_slice of them).

  Args:
    r: the run; its host arrays and the leaves' updates are read and written.
    loop: the groups: block position 1 has arrived (`bufs`), and position 0 is computed and has
      not left (`prev_bufs`).
    token: the run's token (through the barriers).

  Returns:
    (the arrived buffers of the group after the loop, the computed ones of its last, token).
  """
  i0 = loop.leaves[0]
  size = loop.size
  moving = r.moving.get(i0, [])
  keys = r.spec.offloaded(i0) + moving
  sent = r.spec.offloaded(i0) + ([PARAM] if PARAM in moving else [])
  first_k = loop.first
  chunks = r.chunks(first_k)
  phases = chunks[0][1]
  gate = (phases - 1) // 2 if phases > 1 else -1
  carries_updates = PARAM not in moving

  def stage(p, s, cur, prev, host, upd, token):
    """Block position ``stages * p + s`` (`p` traced): `cur` arrived, `prev` (the previous
    position) computed; as `_run_streamed`'s stage."""
    i, at = loop.group((p, s))
    prev_i, prev_at = loop.group((p, s - 1))
    next_i, next_at = loop.group((p, s + 1))
    cur, prev, host, upd, token = lax.optimization_barrier((cur, prev, host, upd, token))
    host = dict(host)
    for j in sent:
      x = memory.to_space(prev[j], HOST)
      host[(prev_i, j)] = lax.dynamic_update_slice_in_dim(host[(prev_i, j)], x, prev_at, 0)
    lbufs = {(0, j): cur[j] for j in keys}
    local_spec = dataclasses.replace(r.spec, units=((Piece(i),),), chunks=(r.spec.chunks[first_k],))
    local = _Run(
      r.inner,
      r.layout,
      local_spec,
      {i: r.grads[i]},
      None if r.params is None else {i: r.params[i]},
      r.shared_in,
      {},
      r.treedefs,
      {i: size},
      r.extra_args,
      r.apply,
      r.grad_transform,
    )
    local.row_shift = at
    if r.chunk_updates and r.chunk_updates.get(i):  # the slice's chunks, as unrolled groups'
      local.chunk_updates = {i: True}
    if GRAD not in moving:
      local.grad_rows = lax.platform_dependent(
        r.grads[i],
        at,
        cpu=lambda g, at: lax.optimization_barrier(lax.dynamic_slice_in_dim(g, at, size, 0)),
        default=lambda g, at: lax.dynamic_slice_in_dim(g, at, size, 0),
      )
    if carries_updates:
      local.updates[i] = upd[i]
    for q in range(-1, phases):
      if q >= 0:
        local.compute(0, q, lbufs)
      if q == phases - 1 or (q == -1 and gate != -1):
        continue
      gated = host if q == gate else {}
      lbufs, done, gated, token = lax.optimization_barrier((lbufs, local.updates, gated, token))
      local.updates.update(done)
      host.update(gated)
    if carries_updates:
      upd = dict(upd)
      upd[i] = local.updates[i]
    nxt = {
      j: memory.to_space(lax.dynamic_slice_in_dim(host[(next_i, j)], next_at, size, 0), DEVICE)
      for j in keys
    }
    return nxt, {j: lbufs[(0, j)] for j in keys}, host, upd, token

  def body(p, carry):
    a, b, host, upd, token = carry
    for s in range(1, loop.stages + 1, 2):  # block positions 1.., after the unrolled position 0
      b, a, host, upd, token = stage(p, s, a, b, host, upd, token)  # a computed, b next arrived
      a, b, host, upd, token = stage(p, s + 1, b, a, host, upd, token)
    return a, b, host, upd, token

  host = {(i, j): r.arrays[(i, j)] for i in loop.leaves for j in keys}
  upd = {i: r.updates.get(i) for i in loop.leaves} if carries_updates else None
  cur = {j: bufs[(0, j)] for j in keys}
  prev = {j: prev_bufs[(0, j)] for j in keys}
  cur, prev, host, upd, token = lax.fori_loop(0, loop.trips, body, (cur, prev, host, upd, token))
  r.arrays.update(host)
  if carries_updates:
    r.updates.update(upd)
  return {(0, j): x for j, x in cur.items()}, {(0, j): x for j, x in prev.items()}, token


def _flat(x: jax.Array) -> jax.Array:
  """`x` as a 1-D array, as it crosses to and from a host computation. On Explicit mesh axes,
  where jax wants the result's sharding, an array sharded on an axis after its first is gathered
  along those axes first (a flat array is sharded as the first axis, if at all)."""
  sharding = jax.typeof(x).sharding
  spec = tuple(sharding.spec)
  if memory.on_explicit_axes(sharding) and any(a is not None for a in spec[1:]):
    first = jax.sharding.PartitionSpec(*spec[:1])
    x = jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, first))
  return x.reshape(-1)


def _unflat(x: jax.Array, shape: tuple[int, ...], like: Any) -> jax.Array:
  """`x` (`_flat`'s) in `shape`, sharded as the type sharding `like` (on Explicit mesh axes)."""
  return memory.reshard_as(x.reshape(shape), like)


def _run_on_host(r: _Run, nvme, token):
  """Each group's update runs on the host next to its state; updates come back group by group.

  A group's pieces are computed on host-local views (the piece's rows of gradients, params and
  state, as whole leaves), in the same chunks as on the device, so both placements give the same
  bits.
  """
  spec, n_leaves = r.spec, r.layout.num_leaves
  for k, unit in enumerate(spec.units):
    fetched = {}
    if nvme is not None and k in nvme.groups:
      fetched, token = nvme.fetch(k, token)
    local_grads, local_params, local_arrays = {}, {}, {}
    in_place: dict[Key, tuple[int, int]] = {}  # host arrays of row slices: (start, stop)
    shapes: dict[int, tuple[int, ...]] = {}  # each piece's shape
    likes: dict[int, Any] = {}  # and its type's sharding
    for piece in unit:
      i = piece.leaf
      start, stop = r.piece_rows(piece)
      # Gradients, params and updates cross as flat arrays: a 2-D array's device layout (a
      # transposed one, from a matmul's backward) need not match what XLA:GPU's host call expects,
      # and its layout assignment fails ("async shape ... to match"); a 1-D array has one layout.
      grads = _slice(r.grads[i], start, stop)
      local_grads[i] = memory.to_space(_flat(grads), HOST)
      shapes[i], likes[i] = grads.shape, jax.typeof(grads).sharding
      if r.params is not None:
        local_params[i] = memory.to_space(_flat(_slice(r.params[i], start, stop)), HOST)
      for j, tier in enumerate(spec.array_tiers[i]):
        if tier is Tier.NVME:  # the store hands over the piece's rows
          x = fetched[(i, j)]
        else:
          x = r.arrays[(i, j)]
          if spec.dims[i][j] and not piece.whole:
            if tier is Tier.HOST:  # sliced and written back inside the host computation
              in_place[(i, j)] = (start, stop)
            else:
              x = _slice(x, start, stop)
        local_arrays[(i, j)] = x if tier is Tier.HOST else memory.to_space(x, HOST)
    shared = memory.to_space(r.shared_in, HOST)

    def group_update(grads, params, arrays, shared, *, k, unit, in_place, shapes, likes):
      grads = {i: _unflat(g, shapes[i], likes[i]) for i, g in grads.items()}
      if params is not None:
        params = {i: _unflat(p, shapes[i], likes[i]) for i, p in params.items()}
      whole = tuple(Piece(p.leaf) for p in unit)
      local_spec = dataclasses.replace(spec, units=(whole,), chunks=(r.chunks(k),))
      views = {
        key: _slice(x, *in_place[key]) if key in in_place else x for key, x in arrays.items()
      }
      local = _Run(
        r.inner,
        r.layout,
        local_spec,
        grads,
        None if r.params is None else params,
        shared,
        views,
        r.treedefs,
        {i: jnp.shape(g)[0] if jnp.ndim(g) else 1 for i, g in grads.items()},
        r.extra_args,
        False,
      )
      bufs = local.fetch(0, views, None)
      for q in range(max(c for _, c in r.chunks(k))):
        local.compute(0, q, bufs)
      local.send(0, bufs, None)
      for n, p in enumerate(whole):  # NVMe arrays come back too (send leaves them to the caller)
        for j in spec.offloaded(p.leaf):
          local.arrays[(p.leaf, j)] = bufs[(n, j)]
      out = {
        key: _put_rows(arrays[key], local.arrays[key], in_place[key][0])
        if key in in_place
        else local.arrays[key]
        for key in arrays
      }
      flat = {i: _flat(u) for i, u in local.updates.items()}
      return flat, out, local.new_shared

    updates, arrays, new_shared = host_compute.run_on_host(
      functools.partial(
        group_update, k=k, unit=unit, in_place=in_place, shapes=shapes, likes=likes
      ),
      local_grads,
      local_params if r.params is not None else None,
      local_arrays,
      shared,
    )
    if r.new_shared is None:
      r.new_shared = new_shared
    nvme_parts: dict[int, list[Any]] = {}
    for piece in unit:
      i = piece.leaf
      start, stop = r.piece_rows(piece)
      u = _unflat(memory.to_space(updates[i], DEVICE), shapes[i], likes[i])
      r.put_update(i, u, ((start, stop),), piece.whole)
      for j, tier in enumerate(spec.array_tiers[i]):
        x = arrays[(i, j)]
        if tier is Tier.NVME:
          nvme_parts.setdefault(i, [None] * len(spec.array_tiers[i]))[j] = x
          continue
        if tier is Tier.DEVICE:
          x = (
            _put_rows(r.arrays[(i, j)], memory.to_space(x, DEVICE), start)
            if not piece.whole
            else memory.to_space(x, DEVICE)
          )
        r.arrays[(i, j)] = x
    if nvme_parts:
      parts = {
        i: r.treedefs[i].unflatten(
          [a if a is not None else r.arrays[(i, j)] for j, a in enumerate(arrays_)]
        )
        for i, arrays_ in nvme_parts.items()
      }
      token = nvme.put(k, token, parts)
  del n_leaves
  return token
