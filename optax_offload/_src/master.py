"""Master weights: an fp32 copy of low-precision params kept in the optimizer state.

`with_master_weights` wraps an inner transformation so that it updates a master copy in
`master_dtype`; the updates it returns make ``optax.apply_updates(params, updates)`` equal the new
master rounded to the param dtype. `offload` applies it before splitting the state, so the master
copy is offloaded (host or NVMe) like any other per-parameter state.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_offload._src import _compat


class MasterState(NamedTuple):
  """State of `with_master_weights`: master copies (None where none is needed) and the inner state."""

  master: Any
  inner: optax.OptState


def needs_master(dtype: Any, master_dtype: Any) -> bool:
  """Whether a param of `dtype` gets a master copy: a floating dtype narrower than `master_dtype`.

  Examples:
    >>> needs_master(jnp.bfloat16, jnp.float32), needs_master(jnp.float32, jnp.float32)
    (True, False)
  """
  if not jnp.issubdtype(dtype, jnp.floating):
    return False
  return jnp.finfo(dtype).bits < jnp.finfo(master_dtype).bits


def check_master_dtype(params_leaves, paths, master_dtype) -> None:
  """Raises a clear error when a master copy would be narrower than a floating leaf."""
  for path, p in zip(paths, params_leaves):
    dtype = jnp.result_type(p)
    if not jnp.issubdtype(dtype, jnp.floating):
      continue  # (an integer or complex param gets no master copy, as a float32 one)
    if jnp.finfo(dtype).bits == jnp.finfo(master_dtype).bits and dtype != master_dtype:
      raise ValueError(  # (bf16 and fp16: neither holds the other's values; no copy was kept)
        f"master_dtype={jnp.dtype(master_dtype).name} is no wider than param {path}'s dtype "
        f"{dtype.name}, so it would keep no master copy of it. Use master_dtype=jnp.float32 with "
        "bf16/fp16 params, or master_dtype=None."
      )
    if jnp.finfo(dtype).bits > jnp.finfo(master_dtype).bits:
      raise ValueError(
        f"master_dtype={jnp.dtype(master_dtype).name} is narrower than param {path}'s dtype "
        f"{dtype.name}: a master copy must be at least as wide as the params. Use "
        "master_dtype=jnp.float32 with bf16/fp16 params, or master_dtype=None."
      )


def with_master_weights(
  inner: optax.GradientTransformationExtraArgs, master_dtype: Any
) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` on master copies of the params in `master_dtype`.

  Leaves narrower than `master_dtype` get a master copy; the inner transformation sees the master
  as params and the gradients cast to `master_dtype`. The returned updates, in `master_dtype`, are
  ``round(new_master) - params`` computed exactly (both are values of the param dtype), so
  ``optax.apply_updates(params, updates)`` equals the new master rounded to the param dtype.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> tx = with_master_weights(optax.sgd(1e-3), jnp.float32)
    >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.ones(4, jnp.bfloat16)}, state, params)
    >>> state.master["w"].dtype, optax.apply_updates(params, updates)["w"].dtype
    (dtype('float32'), dtype(bfloat16))
    >>> float(state.master["w"][0])  # 1 - 1e-3 in fp32; bf16 cannot hold it
    0.9990000128746033
  """
  master_dtype = jnp.dtype(master_dtype)

  # Trees are mapped with params first: a None master (no copy needed) then reaches the function.
  def init_fn(params):
    master = jax.tree.map(
      lambda p: (
        jnp.asarray(p).astype(master_dtype)
        if needs_master(jnp.result_type(p), master_dtype)
        else None
      ),
      params,
    )
    return MasterState(master, inner.init(_master_or_params(params, master)))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(_compat.NO_PARAMS_MSG)
    grads = jax.tree.map(
      lambda p, g, m: g if m is None else jnp.asarray(g).astype(master_dtype),
      params,
      updates,
      state.master,
    )
    inner_updates, inner_state = inner.update(
      grads, state.inner, _master_or_params(params, state.master), **extra_args
    )
    new_master = jax.tree.map(
      lambda p, m, u: None if m is None else (m + u).astype(master_dtype),
      params,
      state.master,
      inner_updates,
    )
    # round(new_master) - params: both hold values of the param dtype, so the difference is exact in
    # master_dtype (for exponents less than 16 binades apart), and params + it == round(new_master).
    out = jax.tree.map(
      lambda p, m, u: (
        u
        if m is None
        else m.astype(jnp.result_type(p)).astype(master_dtype) - jnp.asarray(p).astype(master_dtype)
      ),
      params,
      new_master,
      inner_updates,
    )
    return out, MasterState(new_master, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _master_or_params(params, master):
  return jax.tree.map(lambda p, m: p if m is None else m, params, master)
