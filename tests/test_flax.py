"""`oo.nnx.Optimizer` and `oo.linen.TrainState`: Flax's own with `update_and_apply`, clipping and
accumulation, against Flax's with the plain transformation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from conftest import bits_equal
from flax import nnx
from flax.training import train_state

import optax_offload as oo

CASES = {
  # name: (transformation around the inner one, inner, exact)
  "clip_sgd": (lambda inner: optax.chain(optax.clip_by_global_norm(0.5), inner), "sgd", True),
  "multisteps_clip_adamw": (
    lambda inner: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(0.5), inner), 2),
    "adamw",
    False,  # adamw's bias correction and MultiSteps' `emit * updates` round differently in XLA
  ),
}
INNER = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adamw": lambda: optax.adamw(1e-2)}


class _Model(nnx.Module):
  def __init__(self, host: bool):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
      return nnx.Linear(16, 16, rngs=nnx.Rngs(key))

    self.layers = make(jax.random.split(jax.random.key(0), 3))
    if host:  # the stack in pinned host memory, streamed by oo.offloaded_layers
      nnx.update(self.layers, oo.to_pinned_host(nnx.state(self.layers)))
    self.head = nnx.Linear(16, 4, rngs=nnx.Rngs(1))
    self.host = host

  def __call__(self, x):
    if self.host:
      return self.head(oo.offloaded_layers(self.layers, x))
    graphdef, state = nnx.split(self.layers)
    x, _ = jax.lax.scan(lambda x, layer: (nnx.merge(graphdef, layer)(x), None), x, state)
    return self.head(x)


def _batches(n):
  rng = np.random.default_rng(0)
  return [
    (jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), jnp.asarray(rng.normal(size=(8, 4))))
    for _ in range(n)
  ]


@nnx.jit
def _nnx_step(model, optimizer, x, y):
  grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)


def _values(model):
  return jax.tree.map(lambda v: np.asarray(v), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
  "case, host",
  [("clip_sgd", False), ("clip_sgd", True), ("multisteps_clip_adamw", True)],
)
def test_nnx_optimizer_equals_nnx_optimizer_with_plain_optax(case, host):
  wrap, inner, exact = CASES[case]
  plain_model = _Model(host=False)
  plain = nnx.Optimizer(plain_model, wrap(INNER[inner]()), wrt=nnx.Param)
  model = _Model(host=host)
  optimizer = oo.nnx.Optimizer(model, wrap(oo.offload(INNER[inner](), min_size=16)), wrt=nnx.Param)
  for x, y in _batches(4):
    _nnx_step(plain_model, plain, x, y)
    _nnx_step(model, optimizer, x, y)
  want, got = _values(plain_model), _values(model)
  assert bits_equal(want, got) if exact else (assert_close(want, got) or True)
  assert int(optimizer.step[...]) == 4
  kind = model.layers.kernel[...].sharding.memory_kind
  assert kind == ("pinned_host" if host else "device")
  if isinstance(optimizer.opt_state, optax.MultiStepsState):
    assert optimizer.opt_state.acc_grads["layers"]["kernel"][...].sharding.memory_kind == kind
    assert int(optimizer.opt_state.gradient_step[...]) == 2


def test_nnx_optimizer_with_a_plain_transformation_is_nnx_optimizer():
  plain_model, model = _Model(host=False), _Model(host=False)
  plain = nnx.Optimizer(plain_model, optax.adam(1e-2), wrt=nnx.Param)
  optimizer = oo.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  for x, y in _batches(2):
    _nnx_step(plain_model, plain, x, y)
    _nnx_step(model, optimizer, x, y)
  assert bits_equal(_values(plain_model), _values(model))


@pytest.mark.parametrize("case", sorted(CASES))
def test_linen_train_state_equals_flax_train_state(case):
  wrap, inner, exact = CASES[case]
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32), "b": jnp.zeros(16)}
  batches = _batches(4)

  def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w"][:16] + p["b"])[:, :4] - y) ** 2)

  @jax.jit
  def step(state, x, y):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, x, y))

  plain = train_state.TrainState.create(apply_fn=None, params=params, tx=wrap(INNER[inner]()))
  ours = oo.linen.TrainState.create(
    apply_fn=None, params=params, tx=wrap(oo.offload(INNER[inner](), min_size=16))
  )
  for x, y in batches:
    plain, ours = step(plain, x, y), step(ours, x, y)
  assert (
    bits_equal(plain.params, ours.params)
    if exact
    else (assert_close(plain.params, ours.params) or True)
  )
  assert int(ours.step) == 4
