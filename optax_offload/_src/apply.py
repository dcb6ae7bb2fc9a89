"""`update_and_apply` and `init`: the optax-native training step around `offload`.

A training step is usually written ``optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c),
oo.offload(inner)), k)``. With the weights in pinned host memory (`offloaded_layers`) optax's own
code cannot run it: the global norm adds leaves of two memory spaces, ``MultiSteps.init`` fails
in ``jnp.zeros_like`` of a pinned-host array (jax 0.10), and ``MultiSteps.update`` runs the whole
offloaded update on every micro-step and keeps whichever result it needs with a ``where``. Here
the same transformation is recognised and run with the same arithmetic:

- the global norm: each leaf's sum of squares computed on the device (a host-memory leaf is
  brought over piece by piece, the plan's pieces), added in tree order as ``optax.tree.norm``
  does; the clip is applied to each chunk of the gradients inside the streamed update
  (`stream.run`'s ``grad_transform``), as `value_and_update` does;
- accumulation: ``MultiSteps``' running mean computed where each accumulator lives (a host
  accumulator piece by piece through the device), and the offloaded update under a `lax.cond`, so
  it runs, and the NVMe tier writes a generation, only on the k-th micro-step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_offload._src import _compat
from optax_offload._src import layout as layout_lib
from optax_offload._src import memory
from optax_offload._src import offload as offload_lib
from optax_offload._src import stream
from optax_offload._src import value_and_update as vau
from optax_offload._src.memory import DEVICE
from optax_offload._src.memory import HOST
from optax_offload._src.state import OffloadState

_RECIPES = (
  "oo.offload(inner), optax.chain(optax.clip_by_global_norm(c), oo.offload(inner)), or either "
  "inside optax.MultiSteps(..., every_k_schedule=k)"
)


@dataclasses.dataclass(frozen=True)
class _Structure:
  """What `update_and_apply` recognised in a transformation."""

  offloaded: Any  # offload._Offloaded
  clip: float | None  # clip_by_global_norm's max_norm, or None
  multi: optax.MultiSteps | None  # the MultiSteps around it, or None

  def offload_state(self, inner_state: Any) -> OffloadState:
    return inner_state if self.clip is None else inner_state[1]

  def with_offload_state(self, inner_state: Any, new: OffloadState) -> Any:
    return new if self.clip is None else (inner_state[0], new)


def _multi_steps(tx: Any) -> optax.MultiSteps | None:
  if isinstance(tx, optax.MultiSteps):
    return tx
  owner = getattr(getattr(tx, "update", None), "__self__", None)  # .gradient_transformation()
  return owner if isinstance(owner, optax.MultiSteps) else None


def _structure(tx: Any, name: str) -> _Structure:
  multi = _multi_steps(tx)
  body = multi.inner_opt if multi is not None else tx
  offloaded = offload_lib._OFFLOADED.get(getattr(body, "update", None))
  if offloaded is not None:
    structure = _Structure(offloaded, None, multi)
  else:
    parts = _compat.chain_parts(body)
    clip = offloaded = None
    if parts is not None and len(parts) == 2:
      clip = _compat.clip_by_global_norm_max_norm(parts[0])
      offloaded = offload_lib._OFFLOADED.get(getattr(parts[1], "update", None))
    if clip is None or offloaded is None:
      raise TypeError(
        f"{name} needs {_RECIPES}; got {type(tx).__name__}. For a transformation without "
        "offload, use tx.update and optax.apply_updates."
      )
    structure = _Structure(offloaded, clip, multi)
  if multi is not None and not _compat.multi_steps_skips_nothing(multi):
    raise NotImplementedError(
      f"{name}: optax.MultiSteps with a should_skip_update_fn is not supported; leave it out."
    )
  return structure


def _check_host_memory(s: _Structure, params: Any, name: str) -> None:
  """`offload(host_memory=...)` does not count `optax.MultiSteps`' accumulators of params in
  host memory (the gradients' size there): ValueError."""
  if s.multi is None or s.offloaded.host_memory is None:
    return
  if any(
    memory.in_host(p) or memory.kind_is_host(getattr(p, "sharding", None))
    for p in jax.tree.leaves(params)
  ):
    raise ValueError(
      f"{name}: offload(host_memory=...) does not count optax.MultiSteps' accumulators of the "
      "params in pinned host memory. Accumulate with oo.value_and_update(..., accumulate=k) and "
      "oo.offload(..., host_memory=..., accumulate=k), or pass offload a host_limit that leaves "
      "room for MultiSteps' accumulators."
    )


def recognises(tx: Any) -> bool:
  """Whether `update_and_apply` takes `tx` (the Flax wrappers fall back to optax otherwise)."""
  try:
    _structure(tx, "")
  except TypeError:
    return False
  return True


def init(tx: optax.GradientTransformation | optax.MultiSteps, params: optax.Params) -> Any:
  """``tx.init(params)``, with every part of the state placed where the streamed update keeps it.

  For ``oo.offload(...)`` and ``optax.chain(optax.clip_by_global_norm(c), oo.offload(...))`` it
  is ``tx.init(params)``. For ``optax.MultiSteps(...)`` it builds the same `optax.MultiStepsState`
  with each accumulator where its param lives (pinned host memory for a leaf of an offloaded
  layer stack), which ``MultiSteps.init`` cannot do with such params: in jax 0.10 it fails in
  ``jnp.zeros_like`` of a pinned-host array (``Memory kind mismatch with xla::PjRtBuffers``).

  Args:
    tx: a transformation `update_and_apply` accepts.
    params: the params.

  Returns:
    The state: the same type and values as ``tx.init(params)``.

  Raises:
    TypeError: for a transformation `update_and_apply` does not accept.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"layers": oo.to_pinned_host(jnp.ones((4, 64, 64))), "out": jnp.ones(64)}
    >>> tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0),
    ...                                   oo.offload(optax.adamw(1e-3))), every_k_schedule=4)
    >>> state = oo.init(tx, params)
    >>> state.acc_grads["layers"].sharding.memory_kind
    'pinned_host'
  """
  s = _structure(tx, "oo.init")
  _check_host_memory(s, params, "oo.init")
  if s.multi is None:
    return tx.init(params)
  multi = s.multi
  dtype = _compat.multi_steps_accumulator_dtype(multi)
  return optax.MultiStepsState(
    mini_step=scalar_zero(jnp.int32, params),
    gradient_step=scalar_zero(jnp.int32, params),
    inner_opt_state=multi.inner_opt.init(params),
    acc_grads=jax.tree.map(lambda p: _zeros_where(p, dtype), params),
    skip_state=(),
  )


def scalar_zero(dtype, params: Any) -> jax.Array:
  """A zero scalar committed where the params are (replicated on their mesh, in device memory),
  uncommitted when no param is committed: a jitted step's outputs are committed, and a state
  scalar that was not would make the second step compile again."""
  for p in jax.tree.leaves(params):
    sharding = getattr(p, "sharding", None)
    if sharding is None or not getattr(p, "committed", False):
      continue
    if isinstance(sharding, jax.sharding.NamedSharding):
      sharding = memory.replicated(sharding)
    else:
      sharding = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
    return jax.device_put(jnp.zeros([], dtype), sharding)
  return jnp.zeros([], dtype)


def _zeros_where(p: Any, dtype) -> jax.Array:
  """Zeros of `p`'s shape in `dtype`, in `p`'s memory (and on its sharding when committed)."""
  shape = jnp.shape(p)
  sharding = getattr(p, "sharding", None)
  if sharding is None or not getattr(p, "_committed", True):
    return jnp.zeros(shape, dtype)
  if memory.kind_is_host(sharding):
    return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), HOST), out_shardings=sharding)()
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def update_and_apply(
  tx: optax.GradientTransformation | optax.MultiSteps,
  grads: optax.Updates,
  state: Any,
  params: optax.Params,
  **extra_args,
) -> tuple[optax.Params, Any]:
  """``tx.update`` then ``optax.apply_updates``, fused group by group: the updates never exist whole.

  The same values as::

    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

  but each group's new params are written into the params' buffers as soon as the group is
  computed, so the device holds no param-sized updates (with ``master_dtype``, fp32 updates of bf16
  params would take twice the params' size). Donate the params to the jitted step so that the new
  params take their place.

  `tx` is ``oo.offload(inner)``, or the usual training-step transformations around it, which also
  work with params and gradients in pinned host memory (layer stacks of `offloaded_layers`),
  where optax's own code fails:

  - ``optax.chain(optax.clip_by_global_norm(c), oo.offload(inner))``: global-norm clipping. Each
    leaf's sum of squares is computed on the device (a host-memory leaf is brought over piece by
    piece, a second pass over its gradients on the link); the clip is applied to each chunk inside
    the streamed update.
  - ``optax.MultiSteps(..., every_k_schedule=k)`` around either: gradient accumulation, with
    ``MultiSteps``' running mean in accumulators placed where the gradients live (build the state
    with `init`). The offloaded update runs only on the k-th micro-step (a `jax.lax.cond`), so
    state moves over the link and to NVMe once per optimizer step; the other micro-steps return
    the params unchanged.

  Numerics: the same as optax's (the clip's norm added in tree order, ``MultiSteps``' mean, the
  accumulated gradients cast back to the gradients' dtypes), bit for bit where a leaf's sum of
  squares is one piece; a leaf the plan streams in row slices sums its slices in float32.

  Args:
    tx: ``oo.offload(...)``, ``optax.chain(optax.clip_by_global_norm(c), oo.offload(...))``, or
      either wrapped in ``optax.MultiSteps`` (without ``should_skip_update_fn``).
    grads: the gradients.
    state: the state of `tx` (from ``tx.init``, or `init`).
    params: the params.
    **extra_args: passed to the inner transformation.

  Returns:
    (new params, new state).

  Raises:
    TypeError: when `tx` is none of the above.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"w": jnp.ones((64, 128))}
    >>> tx = oo.offload(optax.sgd(0.5), window_bytes="8KiB")
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    >>> params, state = step(params, state, {"w": jnp.ones((64, 128))})
    >>> float(params["w"][0, 0])
    0.5

    Clipping and accumulation over 2 micro-steps, weights in pinned host memory (the update runs
    on the second):

    >>> params = {"w": oo.to_pinned_host(jnp.ones((64, 128)))}
    >>> tx = optax.MultiSteps(
    ...   optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.sgd(1.0))), 2)
    >>> state = oo.init(tx, params)
    >>> step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    >>> for _ in range(2):
    ...   params, state = step(params, state, {"w": oo.to_pinned_host(jnp.ones((64, 128)))})
    >>> round(float(params["w"][0, 0]), 3), params["w"].sharding.memory_kind
    (0.989, 'pinned_host')
  """
  s = _structure(tx, "update_and_apply")
  _check_host_memory(s, params, "update_and_apply")
  if s.multi is None:
    return _update(s, grads, state, params, extra_args)
  return _accumulate(s, grads, state, params, extra_args)


def _leaves(tree, treedef):
  return treedef.flatten_up_to(tree)


def _setup(s: _Structure, grads, params):
  flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
  paths = [layout_lib.leaf_path(p) for p, _ in flat]
  avals = [
    jax.ShapeDtypeStruct(jnp.shape(g), jnp.result_type(p))
    for (_, g), p in zip(flat, _leaves(params, treedef))
  ]
  return treedef, s.offloaded.setup_for_update(paths, avals)


def _update(s: _Structure, grads, state, params, extra_args, grad_dtypes=None):
  """chain(clip?, offload) applied: the norm first, then the streamed update with the clip."""
  off = s.offloaded
  off_state = s.offload_state(state)
  if s.clip is None and grad_dtypes is None:
    new_params, new_off = off.run(grads, off_state, params, extra_args, apply=True)
    return new_params, s.with_offload_state(state, new_off)
  treedef, setup = _setup(s, grads, params)
  leaves = treedef.flatten_up_to(grads)
  clip = None
  if s.clip is not None:
    norm = _global_norm(leaves, _pieces(setup), grad_dtypes)
    clip = vau._clip_fn(norm, s.clip)
  if off.update_on == "host":  # the host update takes whole gradients: transform them first
    leaves = [
      _transformed(g, None if grad_dtypes is None else grad_dtypes[i], clip)
      for i, g in enumerate(leaves)
    ]
    grads = treedef.unflatten(leaves)
    new_params, new_off = off.run(grads, off_state, params, extra_args, apply=True)
  else:
    new_params, new_off = off.run(
      grads,
      off_state,
      params,
      extra_args,
      apply=True,
      grad_transform=clip,
      grad_dtypes=grad_dtypes,
    )
  return new_params, s.with_offload_state(state, new_off)


def _transformed(g, dtype, clip):
  g = g if dtype is None else g.astype(dtype)
  return g if clip is None else clip(g)


def _pieces(setup) -> dict[int, list[tuple[int, int] | None]]:
  """Per leaf, the row ranges of its pieces in the plan (None for a whole leaf)."""
  out: dict[int, list[tuple[int, int] | None]] = {}
  for unit in setup.spec.units:
    for p in unit:
      out.setdefault(p.leaf, []).append(None if p.whole else (p.start, p.stop))
  return out


def _global_norm(leaves, pieces, grad_dtypes) -> jax.Array:
  """``optax.tree.norm`` of the gradients (cast to `grad_dtypes` first), with every sum on the
  device: a host-memory leaf comes over in the plan's pieces, one after the other."""
  sums = []
  gate = None  # the previous host piece's sum: the next piece's copy waits for it (the window)
  for i, g in enumerate(leaves):
    dtype = jnp.result_type(g) if grad_dtypes is None else grad_dtypes[i]
    if not memory.in_host(g):
      sums.append(jnp.sum(jnp.square(g.astype(dtype))))
      continue
    total = None
    ranges = pieces.get(i, [None])
    for rows in ranges:
      x = g if rows is None else stream._slice(g, *rows)
      if gate is not None:
        x, _ = lax.optimization_barrier((x, gate))
      x = memory.to_space(x, DEVICE).astype(dtype)
      if len(ranges) == 1:
        total = jnp.sum(jnp.square(x))
      else:  # a leaf streamed in row slices: their sums added in float32
        part = jnp.sum(jnp.square(x), dtype=jnp.float32)
        total = part if total is None else total + part
      gate = total
    sums.append(total.astype(dtype))
  return jnp.sqrt(jnp.array(vau._reduce_add(sums)))


def _map_where(fn: Callable[..., jax.Array], out, *args, pieces):
  """``fn(*args)`` for one leaf, computed on the device; written into `out`'s memory.

  A host-memory leaf goes through the device in its plan pieces (each piece's result written in
  place into `out`, a host array of the result's shape and dtype); a device leaf is computed whole.
  """
  if not memory.in_host(out):
    return fn(*args)
  for rows in pieces:
    xs = [a if rows is None else stream._slice(a, *rows) for a in args]
    xs, out = lax.optimization_barrier((xs, out))
    y = memory.to_space(fn(*memory.to_space(xs, DEVICE)), HOST)
    out = y if rows is None else stream._put_rows(out, y, rows[0])
  return out


def _accumulate(s: _Structure, grads, state, params, extra_args):
  """optax.MultiSteps' update, with the offloaded update under a `lax.cond` (k-th micro-step)."""
  multi = s.multi
  treedef, setup = _setup(s, grads, params)
  pieces = _pieces(setup)
  g_leaves = treedef.flatten_up_to(grads)
  acc_leaves = treedef.flatten_up_to(state.acc_grads)
  acc_dtype = _compat.multi_steps_accumulator_dtype(multi)
  acc_update = _compat.multi_steps_acc_update(multi)
  n = state.mini_step

  def mean(g, acc):
    return acc_update(g, acc, n_acc=n).astype(acc_dtype)

  acc = [
    _map_where(mean, a, g, a, pieces=pieces.get(i, [None]))
    for i, (g, a) in enumerate(zip(g_leaves, acc_leaves))
  ]
  k_steps = _compat.multi_steps_every_k(multi)(state.gradient_step)
  emit = state.mini_step == (k_steps - 1)
  grad_dtypes = [jnp.result_type(g) for g in g_leaves]

  def step(operands):
    params, inner_state, acc = operands
    new_params, new_inner = _update(
      s, treedef.unflatten(acc), inner_state, params, extra_args, grad_dtypes=grad_dtypes
    )
    zeros = [
      _map_where(jnp.zeros_like, a, a, pieces=pieces.get(i, [None])) for i, a in enumerate(acc)
    ]
    return new_params, new_inner, zeros

  def micro_step(operands):
    return operands

  new_params, new_inner, acc = lax.cond(
    emit, step, micro_step, (params, state.inner_opt_state, acc)
  )
  new_state = optax.MultiStepsState(
    mini_step=optax.safe_increment(state.mini_step) % k_steps,
    gradient_step=emit * optax.safe_increment(state.gradient_step)
    + (1 - emit) * state.gradient_step,
    inner_opt_state=new_inner,
    acc_grads=treedef.unflatten(acc),
    skip_state=state.skip_state,
  )
  return new_params, new_state
