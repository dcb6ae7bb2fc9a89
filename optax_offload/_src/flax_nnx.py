"""`oo.nnx.Optimizer`: Flax NNX's ``nnx.Optimizer`` whose update is `update_and_apply`."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState
from flax.nnx.training.optimizer import to_opt_state

from optax_offload._src import apply


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for offloaded state: the same arguments and ``update(model, grads)``.

  With ``oo.offload(inner)``, ``optax.chain(optax.clip_by_global_norm(c), oo.offload(inner))`` or
  either inside ``optax.MultiSteps``, the state is built by `optax_offload.init` (accumulators
  where the params live) and ``update`` is `optax_offload.update_and_apply`: the updates are
  applied group by group and never exist whole, the params may live in pinned host memory (an
  `offloaded_layers` stack), clipping and accumulation work there, and the offloaded update runs
  once per optimizer step. The results are bit for bit those of ``nnx.Optimizer`` with the same
  transformation where `update_and_apply`'s are optax's. Any other transformation behaves as in
  ``nnx.Optimizer``.

  Args:
    model: the NNX module.
    tx: the optax transformation.
    wrt: the filter of the variables to optimize (``nnx.Param``), as in ``nnx.Optimizer``.
    graph: as in ``nnx.Optimizer``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_offload as oo
    >>> from flax import nnx
    >>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    >>> tx = optax.MultiSteps(
    ...   optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-3))), 2)
    >>> optimizer = oo.nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> @nnx.jit
    ... def step(model, optimizer, x):
    ...   grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    ...   optimizer.update(model, grads)
    >>> for _ in range(2):
    ...   step(model, optimizer, jnp.ones((8, 64)))
    >>> int(optimizer.opt_state.gradient_step[...])
    1
  """

  def __init__(
    self,
    model: Any,
    tx: optax.GradientTransformation,
    *,
    wrt: Any,
    graph: bool | None = None,
  ):
    self.graph = graph
    params = nnx.state(model, wrt, graph=graph)
    # Committed where the params are (nnx.Optimizer's is not): else the second step compiles again.
    self.step = OptState(apply.scalar_zero(jnp.uint32, nnx.as_pure(params)))
    self.tx = tx
    state = apply.init(tx, params) if apply.recognises(tx) else tx.init(params)
    self.opt_state = nnx.data(to_opt_state(state))
    self.wrt = wrt

  def update(self, model: Any, grads: Any, /, **kwargs) -> None:
    """Updates the optimizer state and the model's params with `update_and_apply`.

    Unlike ``nnx.Optimizer.update`` it returns None for an offloaded transformation: the updates
    never exist whole.

    Args:
      model: the model.
      grads: the gradients from ``nnx.grad``.
      **kwargs: extra arguments of the transformation.
    """
    if not apply.recognises(self.tx):
      return super().update(model, grads, **kwargs)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
    new_params, new_state = apply.update_and_apply(
      self.tx, grads, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
    )
    nnx.update(model, new_params)
    nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
    self.step[...] += 1
    return None
