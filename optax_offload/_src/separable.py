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

from optax_offload._src.layout import StateLayout

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
  """The inner update run group by group, with no placement (the reference semantics of `offload`).

  Returns:
    The update leaves (in leaf order) and the new full state.
  """
  shared, per_leaf = layout.split(state)
  new_shared, new_per_leaf, updates = None, {}, [None] * layout.num_leaves
  for group in groups:
    u, s = inner.update(
      layout.masked(grads, group),
      layout.view(shared, dict(enumerate(per_leaf)), group),
      None if params is None else layout.masked(params, group),
      **extra_args,
    )
    group_shared, group_per_leaf = layout.unview(s, group)
    new_shared = group_shared if new_shared is None else new_shared
    new_per_leaf.update(group_per_leaf)
    for i, leaf in zip(group, layout.group_leaves(u, group)):
      updates[i] = leaf
  return updates, layout.merge(new_shared, [new_per_leaf[i] for i in range(layout.num_leaves)])


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
      for scale in _GROUP_SCALES:
        grads = [
          jnp.asarray(rng.normal(size=p.shape) * (scale if i % 2 == 0 else 1e-2), p.dtype)
          for i, p in enumerate(params)
        ]
        joint, joint_state = inner.update(
          layout.params_treedef.unflatten(grads), joint_state, params_tree
        )
        split, split_state = run_grouped(inner, layout, groups, grads, split_state, params)
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


def _compare(path: str, dtype, joint: jax.Array, split: jax.Array) -> None:
  a = np.asarray(joint, np.float64)
  b = np.asarray(split, np.float64)
  scale = np.max(np.abs(a), initial=0.0)
  diff = np.abs(a - b)
  bad = ~(diff <= _tolerance(dtype) * np.abs(a) + 1e-6 * scale) & ~(np.isnan(a) & np.isnan(b))
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
