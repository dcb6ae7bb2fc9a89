"""`oo.linen.TrainState`: Flax Linen's ``TrainState`` whose ``apply_gradients`` is `update_and_apply`."""

from __future__ import annotations

from typing import Any

import jax
from flax.training import train_state
from flax.training.train_state import OVERWRITE_WITH_GRADIENT

from optax_offload._src import apply


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` for offloaded state: the same fields and methods.

  With ``oo.offload(inner)``, ``optax.chain(optax.clip_by_global_norm(c), oo.offload(inner))`` or
  either inside ``optax.MultiSteps``, ``create`` builds the state with `optax_offload.init` and
  ``apply_gradients`` calls `optax_offload.update_and_apply` (clipping and accumulation with params
  in pinned host memory, the offloaded update once per optimizer step). Any other transformation
  behaves as in Flax's ``TrainState``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_offload as oo
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.sgd(0.1)))
    >>> state = oo.linen.TrainState.create(apply_fn=None, params={"w": jnp.ones((64, 64))}, tx=tx)
    >>> state = state.apply_gradients(grads={"w": jnp.ones((64, 64))})
    >>> float(state.params["w"][0, 0]), int(state.step)
    (0.9984375238418579, 1)
  """

  def apply_gradients(self, *, grads: Any, **kwargs) -> TrainState:
    if not apply.recognises(self.tx):
      return super().apply_gradients(grads=grads, **kwargs)
    owg = OVERWRITE_WITH_GRADIENT in grads
    params = self.params["params"] if owg else self.params
    new_params, new_opt_state = apply.update_and_apply(
      self.tx, grads["params"] if owg else grads, self.opt_state, params
    )
    if owg:
      new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state, **kwargs)

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs) -> TrainState:
    if not apply.recognises(tx):
      return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    owg = not isinstance(params, jax.Array) and OVERWRITE_WITH_GRADIENT in params
    opt_state = apply.init(tx, params["params"] if owg else params)
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state, **kwargs)
