"""Moments in a narrower dtype: `with_moment_dtype`, kept by `offload(moment_dtype=...)`.

The moments of an Adam-style optimizer are most of the bytes `offload` moves: 8 of the 12 bytes
per parameter of fp32 master AdamW. `with_moment_dtype` stores them in bf16 (2 bytes each) and
widens them again for the inner update, so the update computes as it would in fp32 and only the
stored state is rounded (round to nearest even, XLA's ``convert``). `offload` applies it before
planning (`tree_plan.offloaded_inner`), so the plan, `estimate` and the NVMe tier see the narrower
state and the link and disk move half the bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import layout as layout_lib
from optax_offload._src import units


def parse_moment_dtype(value: Any, name: str = "moment_dtype") -> np.dtype | None:
  """The moment dtype `with_moment_dtype` can keep: a float of 16 bits or more; None for None.

  Raises:
    ValueError: for an integer dtype (block-quantized 8-bit moments are not implemented), an
      8-bit float (no per-block scale, most moments would flush to zero) or a non-dtype.

  Examples:
    >>> parse_moment_dtype("bf16"), parse_moment_dtype(None)
    (dtype(bfloat16), None)
  """
  if value is None:
    return None
  try:
    dtype = units.parse_dtype(value, name)
  except ValueError:
    raise ValueError(
      f"{name} must be a floating dtype such as 'bf16' or jnp.bfloat16, got {value!r}."
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"{name}={dtype.name}: only floating moment dtypes are implemented ('bf16', 'fp16'); "
      "8-bit block-quantized moments (bitsandbytes-style int8 with per-block scales) are not. "
      f"Use {name}='bf16' to halve the moments' bytes."
    )
  if jnp.finfo(dtype).bits < 16:
    raise ValueError(
      f"{name}={dtype.name}: an 8-bit float without per-block scales cannot hold the moments "
      f"(Adam's second moment spans more binades than its exponent). Use {name}='bf16'."
    )
  return dtype


def is_moment(x: Any, param: Any, moment_dtype: Any) -> bool:
  """Whether state array `x` of a parameter-shaped subtree is stored in `moment_dtype`: a float
  shaped like its param and wider than `moment_dtype`.

  Examples:
    >>> is_moment(jnp.zeros(3), jnp.zeros(3), jnp.bfloat16)  # fp32 moment of an fp32 param
    True
    >>> is_moment(jnp.zeros(2), jnp.zeros(3), jnp.bfloat16)  # another shape (e.g. adafactor's)
    False
  """
  return jnp.shape(x) == jnp.shape(param) and narrows(jnp.result_type(x), moment_dtype)


def narrows(dtype: Any, moment_dtype: Any) -> bool:
  """Whether a moment of `dtype` is stored in `moment_dtype`: a float wider than it.

  Examples:
    >>> narrows(jnp.float32, jnp.bfloat16), narrows(jnp.bfloat16, jnp.float16)
    (True, False)
  """
  return jnp.issubdtype(dtype, jnp.floating) and (
    jnp.finfo(dtype).bits > jnp.finfo(moment_dtype).bits
  )


def with_moment_dtype(
  inner: optax.GradientTransformation, moment_dtype: Any
) -> optax.GradientTransformationExtraArgs:
  """Keeps the moments of `inner`'s state in `moment_dtype`, computing the update as before.

  The moments are the float arrays of the state's parameter-shaped subtrees (the subtrees
  `optax.tree_utils.tree_map_params` maps) that have their param's shape and a dtype wider than
  `moment_dtype`: Adam's ``mu`` and ``nu``, momentum's ``trace``, Lion's ``mu``, ... . Step counts,
  hyper-parameters, adafactor's factored rows and columns and leaves already narrow are kept as
  they are; under `offload`'s ``master_dtype`` the master copy is outside this state and stays in
  its dtype. (An inner state that keeps a param-shaped copy of the params, e.g. lookahead's slow
  weights, is rounded too: wrap only the part that holds moments.)

  ``update`` widens the moments to the dtype ``inner.init`` gives them for the params (for the
  updates when no params are passed), runs `inner`, and rounds the new moments to `moment_dtype`
  (round to nearest even). So the result equals `inner` on fp32 state whose moments are rounded
  to `moment_dtype` after every step, bit for bit. Optax's own ``mu_dtype`` differs: it computes
  ``b1 * mu`` in bf16 with ``b1`` rounded to bf16 (0.9 becomes 0.8984375), docs/tiers.md.

  Args:
    inner: an optax transformation whose state `optax.tree_utils.tree_map_params` can map.
    moment_dtype: ``"bf16"``, ``jnp.bfloat16``, ``"fp16"``: a float of at least 16 bits.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state has `inner`'s structure.

  Raises:
    ValueError: `moment_dtype` is not a float of at least 16 bits (``"int8"`` is refused).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_offload as oo
    >>> tx = oo.with_moment_dtype(optax.adam(1e-3), "bf16")
    >>> params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> state[0].mu["w"].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"].dtype, state[0].nu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
  """
  dtype = parse_moment_dtype(moment_dtype)
  if dtype is None:
    raise ValueError("moment_dtype must be a floating dtype such as 'bf16', got None.")
  inner = optax.with_extra_args_support(inner)

  def narrow(state, like):
    return optax.tree_utils.tree_map_params(
      inner,
      lambda x, p: x.astype(dtype) if is_moment(x, p, dtype) else x,
      state,
      like,
    )

  def init_fn(params):
    if layout_lib.is_placeholder(params):  # tree_map_params and offload ask for the layout
      return inner.init(params)
    return narrow(inner.init(params), params)

  def update_fn(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    natural = jax.eval_shape(inner.init, like)
    wide = jax.tree.map(
      lambda x, n: x.astype(n.dtype) if jnp.result_type(x) != n.dtype else x, state, natural
    )
    new_updates, new_state = inner.update(updates, wide, params, **extra_args)
    return new_updates, narrow(new_state, like)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
