"""`update_and_apply` with the optax-native training step: ``optax.MultiSteps(optax.chain(
optax.clip_by_global_norm(c), oo.offload(inner)), k)``, with weights on the device or in pinned host
memory, against plain optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from conftest import bits_equal

import optax_offload as oo

OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adamw": lambda: optax.adamw(1e-2)}


def _params():
  """Committed, as the offloaded state is (else a jitted step compiles twice)."""
  rng = np.random.default_rng(0)
  return jax.device_put(_leaves(rng), jax.devices()[0])


def _leaves(rng):
  return {
    "layers": jnp.asarray(rng.normal(size=(4, 16, 32)), jnp.float32),
    "emb": jnp.asarray(rng.normal(size=(32, 32)), jnp.bfloat16),
    "out": jnp.asarray(rng.normal(size=(32,)), jnp.float32),
  }


def _grads(params, steps):
  rng = np.random.default_rng(1)
  return [
    jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    for _ in range(steps)
  ]


def _on_host(tree):
  """The layer stack in pinned host memory, as `oo.offloaded_layers` keeps it."""
  return dict(tree, layers=oo.to_pinned_host(tree["layers"]))


def _wrap(inner, clip, k):
  tx = optax.chain(optax.clip_by_global_norm(clip), inner) if clip is not None else inner
  return optax.MultiSteps(tx, k) if k > 1 else tx


def _plain_run(tx, params, grads):
  state = tx.init(params)

  @jax.jit
  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for g in grads:
    params, state = step(g, state, params)
  return params


def _offloaded_run(tx, params, grads, host):
  params = _on_host(params) if host else params
  state = oo.init(tx, params)
  step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  for g in grads:
    params, state = step(params, state, _on_host(g) if host else g)
  assert step._cache_size() == 1  # the state's scalars are committed like the params
  return params, state


@pytest.mark.parametrize(
  "name, k, host",
  [
    ("sgd", 1, False),
    ("sgd", 1, True),
    ("sgd", 3, True),
    ("adamw", 1, True),
    ("adamw", 3, False),
    ("adamw", 3, True),
  ],
)
def test_clip_and_accumulate_equal_plain_optax(name, k, host):
  params, clip = _params(), 0.5  # the clip triggers: the gradients' norm is ~40
  grads = _grads(params, 2 * k)
  want = _plain_run(_wrap(OPTIMIZERS[name](), clip, k), params, grads)
  tx = _wrap(oo.offload(OPTIMIZERS[name](), min_size=16), clip, k)
  got, state = _offloaded_run(tx, params, grads, host)
  if name == "sgd" and k == 1:
    assert bits_equal(want, got)
  else:  # adamw's bias correction, and MultiSteps' `emit * updates`, round differently in XLA
    assert_close(want, got)
  want_kind = "pinned_host" if host else "device"
  assert got["layers"].sharding.memory_kind == want_kind
  if k > 1:
    assert state.acc_grads["layers"].sharding.memory_kind == want_kind
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


@pytest.mark.parametrize("host", [False, True], ids=["device_weights", "host_weights"])
def test_accumulation_without_clip_is_bit_exact(host):
  params = _params()
  grads = _grads(params, 4)
  inner = lambda: optax.sgd(0.1, momentum=0.9)  # noqa: E731
  want = _plain_run(optax.MultiSteps(inner(), 2), params, grads)
  got, _ = _offloaded_run(
    optax.MultiSteps(oo.offload(inner(), min_size=16), 2), params, grads, host
  )
  assert bits_equal(want, got)


def test_non_triggering_clip_is_bit_exact_with_host_weights():
  params = _params()
  grads = _grads(params, 2)
  want = _plain_run(_wrap(optax.adamw(1e-2), 1e6, 1), params, grads)
  got, _ = _offloaded_run(
    _wrap(oo.offload(optax.adamw(1e-2), min_size=16), 1e6, 1), params, grads, True
  )
  assert bits_equal(want, got)


def test_init_places_accumulators_where_the_params_live():
  params = _on_host(_params())
  tx = optax.MultiSteps(
    optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adam(1e-3))), 4
  )
  state = oo.init(tx, params)
  kinds = jax.tree.map(lambda x: x.sharding.memory_kind, state.acc_grads)
  assert kinds == {"layers": "pinned_host", "emb": "device", "out": "device"}
  assert jax.tree.map(lambda x: x.dtype, state.acc_grads) == jax.tree.map(
    lambda _: jnp.dtype(jnp.float32), params
  )
  assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.acc_grads))
  want = jax.tree.map(jax.typeof, jax.jit(tx.init)(_params()))
  assert jax.tree.structure(want) == jax.tree.structure(state)


def test_nvme_tier_writes_one_generation_per_optimizer_step(tmp_path):
  params = _params()
  k, micro_steps = 2, 4
  grads = _grads(params, micro_steps)
  want = _plain_run(_wrap(optax.adam(1e-2), 0.5, k), params, grads)
  off = oo.offload(optax.adam(1e-2), min_size=16, nvme_dir=str(tmp_path), host_limit=0)
  tx = _wrap(off, 0.5, k)
  state = oo.init(tx, _on_host(params))
  first = int(state.inner_opt_state[1].nvme_generation)
  assert oo.footprint(state.inner_opt_state[1])["nvme"] > 0
  step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
  p, generations = _on_host(params), []
  for g in grads:
    p, state = step(p, state, _on_host(g))
    generations.append(int(state.inner_opt_state[1].nvme_generation) - first)
  oo.close_nvme(state.inner_opt_state[1])
  # optax.MultiSteps' own update runs the offloaded update (and writes a generation) every micro-step.
  assert generations == [0, 1, 1, 2]
  assert_close(want, p)


def test_refuses_what_it_does_not_know():
  tx = optax.chain(optax.scale(0.5), oo.offload(optax.sgd(0.1)))
  params = {"w": jnp.ones((64, 64))}
  with pytest.raises(TypeError, match="clip_by_global_norm"):
    oo.update_and_apply(tx, params, tx.init(params), params)
  skip = optax.MultiSteps(
    oo.offload(optax.sgd(0.1)), 2, should_skip_update_fn=optax.skip_not_finite
  )
  with pytest.raises(NotImplementedError, match="should_skip_update_fn"):
    oo.init(skip, params)


@pytest.mark.parametrize("k", [1, 4])
def test_h100_program_has_no_host_compute(k):
  # Compiled for an H100: the norm's sums, the accumulation and the clip run on the device with the
  # weights in pinned host memory (optax's own norm over host leaves, or a hand-written one, makes
  # XLA turn them into host compute), and with MultiSteps the offloaded update is a conditional.
  from helpers import gpu_compile_or_skip

  gpu_compile_or_skip()
  params = {"layers": oo.to_pinned_host(jnp.zeros((4, 256, 256))), "head": jnp.zeros((256, 64))}
  tx = _wrap(oo.offload(optax.adamw(1e-3), window_bytes="3MiB"), 1.0, k)

  def step(p, s, g):
    return oo.update_and_apply(tx, g, s, p)

  program = oo.compile_for_gpu(step, params, oo.init(tx, params), params, donate_argnums=(0, 1))
  assert program.schedule.host_compute == ()
  assert (" conditional(" in program.hlo) == (k > 1)
