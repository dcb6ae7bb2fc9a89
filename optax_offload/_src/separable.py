"""A check that an inner transformation is separable: each leaf's update ignores the other leaves.

`offload` runs the inner transformation group by group, which is only correct when the update of a
leaf depends on its own gradient, parameter and state plus shared scalars. The check runs the inner
transformation for a few steps on a miniature of the parameter tree (same structure, ranks and dtypes,
at most 3 elements per axis), once on the whole tree and once in two groups, with gradients of very
different scales in the two groups, and compares.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import stream
from optax_offload._src.layout import StateLayout
from optax_offload._src.plan import Piece
from optax_offload._src.plan import Tier

logger = logging.getLogger(__name__)

_GROUP_SCALES = (1e3, 1e1, 1e2)
"""Gradient scale of the first group at each probe step; the second group's is fixed at 1e-2."""


def _miniature(shape: Sequence[int]) -> tuple[int, ...]:
  return tuple(min(int(d), 3) for d in shape)


def _tolerance(dtype) -> float:
  return 1e-4 if jnp.finfo(dtype).bits >= 32 else 3e-2


def run_grouped(
  inner: optax.GradientTransformationExtraArgs,
  layout: StateLayout,
  groups: Sequence[Sequence[int]],
  grads: Sequence[jax.Array],
  state: optax.OptState,
  params: Sequence[jax.Array] | None,
  **extra_args,
) -> tuple[list[jax.Array], optax.OptState]:
  """The inner update run group by group (whole leaves), with no placement.

  Returns:
    The update leaves (in leaf order) and the new full state.
  """
  shared, per_leaf = layout.split(state)
  spec = _device_spec(tuple(tuple(Piece(i) for i in g) for g in groups), per_leaf, None)
  updates, new_shared, new_per_leaf, _ = stream.run(
    inner, layout, spec, grads, shared, per_leaf, params, extra_args
  )
  return updates, layout.merge(new_shared, new_per_leaf)


def _device_spec(units, per_leaf, dims=None, chunks=None) -> stream.StreamSpec:
  """A spec with every array on the device (no moves), one chunk per piece unless given."""
  tiers = tuple((Tier.DEVICE,) * len(jax.tree.leaves(part)) for part in per_leaf)
  dims = dims or tuple((0,) * len(t) for t in tiers)
  chunks = chunks or tuple(((0, 1),) * len(u) for u in units)
  return stream.StreamSpec(units, tiers, dims, chunks)


_PROBE_CAP = 256
"""Non-leading axes of a split probe are cut to this length (keeping e.g. adafactor's factoring,
which starts at 128)."""


def shared_dims(part: object, shape: Sequence[int]) -> tuple[int, ...]:
  """How many leading axes (at most 2) each array of a state part shares with its param."""
  out = []
  for x in jax.tree.leaves(part):
    d = 0
    while d < min(2, len(shape), len(x.shape)) and x.shape[d] == shape[d]:
      d += 1
    out.append(d)
  return tuple(out)


def splittable(
  inner: optax.GradientTransformationExtraArgs,
  avals: Sequence[jax.ShapeDtypeStruct],
  per_leaf: Sequence[object],
  dims: Sequence[Sequence[int]],
  min_size: int,
  axis: int,
) -> list[int]:
  """Per leaf: the length of `axis` when its update may be split along it, else 0.

  Axis 0: updating rows ``[0:1]`` and ``[1:n]`` as separate pieces equals updating the whole leaf
  (row slices and row chunks). Axis 1: updating it in two column chunks, each applied to the params
  in place, equals the whole update applied. A probe checks this on a small leaf with the same
  trailing axes (cut to 256) and very different gradient scales in the two parts, over a few
  steps; the large state arrays must share the split axes with the param. Elementwise optimizers
  qualify; lamb and lars (trust ratio over the leaf) do not, nor adafactor's factored moments
  along the factored axes (stacked 3-D leaves split along axis 0 qualify).
  """
  out, cache = [], {}
  for aval, part, depth in zip(avals, per_leaf, dims):
    shape = tuple(aval.shape)
    arrays = jax.tree.leaves(part)
    big = [j for j, x in enumerate(arrays) if np.prod(x.shape) >= min_size]
    if (
      len(shape) <= axis
      or shape[axis] < 2
      or not big
      or not all(depth[j] > axis for j in big)
      or not jnp.issubdtype(aval.dtype, jnp.floating)
    ):
      out.append(0)
      continue
    probe = tuple(min(int(d), _PROBE_CAP) for d in shape[1:])
    key = (jnp.dtype(aval.dtype), probe, tuple(depth), axis)
    if key not in cache:
      cache[key] = _split_probe(inner, jnp.dtype(aval.dtype), probe, tuple(depth), axis)
    out.append(shape[axis] if cache[key] else 0)
  return out


def _split_probe(
  inner, dtype, trailing: tuple[int, ...], depth: tuple[int, ...], axis: int
) -> bool:
  rows = next(m for m in range(5, 64) if m not in trailing)
  shape = (rows, *trailing)
  rng = np.random.default_rng(1)
  with jax.ensure_compile_time_eval():
    try:
      params = {"x": jnp.asarray(rng.normal(size=shape) + 0.5, dtype)}
      layout = StateLayout(inner, jax.tree.structure(params))
      state = inner.init(params)
      _, per_leaf = layout.split(state)
      if shared_dims(per_leaf[0], shape) != depth:
        return False
      if axis == 0:
        spec = _device_spec(((Piece(0, 0, 1),), (Piece(0, 1, rows),)), per_leaf, (depth,))
      else:
        spec = _device_spec(((Piece(0),),), per_leaf, (depth,), (((1, 2),),))
      split_state, split_params = state, params["x"]
      # Compiled, not op by op: eager ops compile one small program each, per shape (for a 13B
      # Llama's leaves, 5 s of the first compile's trace).
      joint_update = jax.jit(inner.update)
      split_update = jax.jit(
        lambda g, shared, per: stream.run(
          inner, layout, spec, [g], shared, per, [split_params], {}, apply=axis == 1
        )
      )
      for scale in _GROUP_SCALES:
        g = rng.normal(size=shape)
        first = (slice(None),) * axis + (slice(0, shape[axis] // 2 if axis else 1),)
        g *= 1e-2
        g[first] *= 1e2 * scale
        grads = {"x": jnp.asarray(g, dtype)}
        joint, state = joint_update(grads, state, params)
        shared, per = layout.split(split_state)
        split, new_shared, new_per, _ = split_update(grads["x"], shared, per)
        split_state = layout.merge(new_shared, new_per)
        # Updates of low-precision params (master weights) may round either way: one ulp of the
        # params is noise, not a dependence on the other part.
        ulp = 2 * float(jnp.finfo(dtype).eps) * float(jnp.max(jnp.abs(params["x"])))
        if axis == 0:
          _compare("x", dtype, joint["x"], split[0], atol=ulp)
        else:
          _compare("x", dtype, optax.apply_updates(params, joint)["x"], split[0], atol=ulp)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(split_state)):
          _compare("x", dtype, a, b)
    except _NotSeparable:
      return False
    except Exception as e:  # the probe is a best effort: do not split what it cannot check
      logger.info("offload: split probe failed (%s: %s); leaves stay whole.", type(e).__name__, e)
      return False
  return True


def check_separable(
  inner: optax.GradientTransformationExtraArgs,
  layout: StateLayout,
  paths: Sequence[str],
  avals: Sequence[jax.ShapeDtypeStruct],
) -> None:
  """Raises ValueError when the inner transformation mixes leaves.

  Args:
    inner: the inner transformation.
    layout: the state layout for the parameter tree.
    paths: key paths of the parameter leaves, for messages.
    avals: shapes and dtypes of the parameter leaves.

  Raises:
    ValueError: when the grouped update differs from the joint one.
  """
  n = layout.num_leaves
  if n < 2 or not all(jnp.issubdtype(a.dtype, jnp.floating) for a in avals):
    return
  rng = np.random.default_rng(0)
  groups = (tuple(range(0, n, 2)), tuple(range(1, n, 2)))
  with jax.ensure_compile_time_eval():
    params = [jnp.asarray(rng.normal(size=_miniature(a.shape)) + 0.5, a.dtype) for a in avals]
    params_tree = layout.params_treedef.unflatten(params)
    try:
      joint_state = inner.init(params_tree)
      split_state = joint_state
      # Compiled, not op by op (see `_split_probe`).
      joint_update = jax.jit(inner.update)
      grouped_update = jax.jit(lambda g, s: run_grouped(inner, layout, groups, g, s, params))
      for scale in _GROUP_SCALES:
        grads = [
          jnp.asarray(rng.normal(size=p.shape) * (scale if i % 2 == 0 else 1e-2), p.dtype)
          for i, p in enumerate(params)
        ]
        joint, joint_state = joint_update(
          layout.params_treedef.unflatten(grads), joint_state, params_tree
        )
        split, split_state = grouped_update(grads, split_state)
        joint = layout.params_treedef.flatten_up_to(joint)
        for i in range(n):
          _compare(paths[i], avals[i].dtype, joint[i], split[i])
    except _NotSeparable:
      raise
    except Exception as e:  # the probe is a best effort; the real update reports real errors
      logger.warning(
        "offload: could not check that the inner transformation is separable (%s: %s); "
        "continuing without the check.",
        type(e).__name__,
        e,
      )


class _NotSeparable(ValueError):
  pass


def _compare(path: str, dtype, joint: jax.Array, split: jax.Array, atol: float = 0.0) -> None:
  a = np.asarray(joint, np.float64)
  b = np.asarray(split, np.float64)
  scale = np.max(np.abs(a), initial=0.0)
  diff = np.abs(a - b)
  bad = ~(diff <= _tolerance(dtype) * np.abs(a) + 1e-6 * scale + atol) & ~(
    np.isnan(a) & np.isnan(b)
  )
  if np.any(bad):
    rel = float(np.max(diff / np.maximum(np.abs(a), 1e-30)))
    raise _NotSeparable(
      "offload: the inner transformation is not separable: the update of leaf "
      f"{path} changes when the other leaves are updated in a separate group (relative "
      f"difference up to {rel:.3g}). offload updates the state group by group, so a transformation "
      "that mixes leaves (global-norm clipping, global noise, ...) must go outside it, e.g. "
      "optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-3))). If you are "
      "sure it is separable, pass check_separable=False."
    )
