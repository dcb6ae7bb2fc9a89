"""The inner state in the dtypes its update returns, from ``init`` on.

Plain optax lets an update widen its state: `optax.inject_hyperparams` keeps ``b1`` and ``b2`` as
float32 arrays, so ``b1 * mu`` turns a bfloat16 param's moments into float32 at the first update
(and a jitted step compiles a second time); an integer param's moments start in its dtype and turn
float32 there too. `offload` keeps its state in buffers of fixed dtypes
(the NVMe tier's files above all), so it starts with the dtypes the update returns: the same
values (the moments start at 0), from the first step on.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_offload._src import layout as layout_lib


def with_update_dtypes(
  inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """`inner`, whose ``init`` returns each float array of the state in the wider of its own dtype
  and the dtype that ``update`` returns it in, and each integer or bool array that ``update``
  returns as a float in that float (the update, with zero gradients, traced only).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(3)}  # (float32 hyperparameters)
    >>> tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)
    >>> state = tx.init(params)
    >>> state.inner_state[0].mu["w"].dtype, tx.update(params, state, params)[1].inner_state[0].mu["w"].dtype
    (dtype(bfloat16), dtype('float32'))
    >>> with_update_dtypes(tx).init(params).inner_state[0].mu["w"].dtype
    dtype('float32')
  """

  def init_fn(params):
    state = inner.init(params)
    if layout_lib.asks_for_layout(params):
      return state
    try:
      after = jax.eval_shape(
        lambda s, p: inner.update(jax.tree.map(jnp.zeros_like, p), s, p)[1], state, params
      )
    except Exception:  # (an update that needs extra arguments, or state leaves that are no arrays)
      return state
    if jax.tree.structure(after) != jax.tree.structure(state):
      return state
    return jax.tree.map(_widened, state, after)

  _PLAIN_INITS[init_fn] = inner.init
  return optax.GradientTransformationExtraArgs(init_fn, inner.update)


_PLAIN_INITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plain_init(tx: optax.GradientTransformation):
  """`tx`'s ``init``, or the one `with_update_dtypes` wrapped (whose init traces the update too:
  for the structure of a state, or the dtypes of what the update widens back, it is enough)."""
  return _PLAIN_INITS.get(tx.init, tx.init)


def _widened(x: Any, after: Any) -> Any:
  mine, theirs = getattr(x, "dtype", None), getattr(after, "dtype", None)
  if mine is None or theirs is None or not jax.dtypes.issubdtype(theirs, jnp.floating):
    return x
  # (not a PRNG key, which optax.add_noise keeps; an integer or bool param's moments start in its
  # dtype and turn floating at the first update)
  if jax.dtypes.issubdtype(mine, jnp.integer) or jax.dtypes.issubdtype(mine, jnp.bool_):
    return x.astype(theirs)
  if jax.dtypes.issubdtype(mine, jnp.floating) and jnp.finfo(theirs).bits > jnp.finfo(mine).bits:
    return x.astype(theirs)
  return x
