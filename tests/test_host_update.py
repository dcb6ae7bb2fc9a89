"""update_on="host", master weights, and gradients that leave the device during backward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from conftest import bits_equal
from conftest import make_grads
from conftest import make_params
from conftest import train
from helpers import gpu_compile_or_skip
from helpers import optimizers

import optax_offload as oo

WINDOW = 100_000

_OPTIMIZERS = optimizers("adamw", "adam", "lion", "sgd_momentum", "adafactor", "lamb")


@pytest.mark.parametrize("opt", _OPTIMIZERS, ids=lambda o: o.name)
def test_host_update_equals_device_update_bit_for_bit(opt):
  name, make = opt.name, opt.make
  params = make_params()
  dev_params, dev_state = train(oo.offload(make(), window_bytes=WINDOW), params, 10, donate=True)
  tx = oo.offload(make(), window_bytes=WINDOW, update_on="host")
  host_params, host_state = train(tx, params, 10, donate=True)
  assert bits_equal(dev_params, host_params), name
  assert bits_equal(oo.to_inner(dev_state), oo.to_inner(host_state)), name
  plain_params, _ = train(make(), params, 10)
  assert_close(plain_params, host_params)
  # The state never left the host.
  assert oo.footprint(host_state)["host"] == oo.footprint(dev_state)["host"]


def test_host_update_eager_matches_within_tolerance():
  # Eagerly, device mode runs op by op while the host update is one compiled program per group, so
  # XLA's fusion (and the Adam bias-correction power) may differ by ulps: the numerics rule applies.
  params = make_params()
  dev_params, _ = train(oo.offload(optax.adamw(1e-2), window_bytes=WINDOW), params, 5, jit=False)
  tx = oo.offload(optax.adamw(1e-2), window_bytes=WINDOW, update_on="host")
  host_params, host_state = train(tx, params, 5, jit=False)
  assert_close(dev_params, host_params)
  assert host_state.inner[0].mu["big"].sharding.memory_kind == "pinned_host"


def test_host_update_with_nvme_tier(tmp_path):
  # 'big' goes to NVMe, updated in row slices as on the host tier.
  params = make_params()
  ref_params, ref_state = train(oo.offload(optax.adamw(1e-2), window_bytes=WINDOW), params, 6)
  tx = oo.offload(
    optax.adamw(1e-2),
    window_bytes=WINDOW,
    update_on="host",
    host_limit="200KiB",
    nvme_dir=str(tmp_path),
  )
  got_params, got_state = train(tx, params, 6, donate=True)
  try:
    assert oo.footprint(got_state)["nvme"] > 0
    assert bits_equal(ref_params, got_params)
    assert bits_equal(oo.to_inner(ref_state), oo.to_inner(got_state))
  finally:
    oo.close_nvme(got_state)


def test_gpu_program_keeps_state_on_the_host():
  gpu_compile_or_skip()
  from optax_offload._src import gpu_program

  params = {f"w{i}": jnp.full((64, 128), 0.1, jnp.float32) for i in range(4)}
  grads = jax.tree.map(jnp.ones_like, params)

  def compiled(tx):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    return gpu_program.compile_for_gpu(step, params, tx.init(params), grads, donate_argnums=(0, 1))

  host = compiled(oo.offload(optax.adamw(1e-2), window_bytes=200_000, update_on="host"))
  moved = [(c.direction, c.nbytes) for c in host.schedule.copies]
  leaf = 64 * 128 * 4
  # Grads and params go to the host (two per leaf), updates come back (one per leaf); the moments
  # (8 arrays) never cross the link, and the optimizer's arithmetic runs on the host.
  assert sorted(moved) == sorted([("to_device", leaf)] * 4 + [("to_host", leaf)] * 8)
  assert host.schedule.host_compute
  # Device mode moves each moment in and out.
  device = compiled(oo.offload(optax.adamw(1e-2), window_bytes=200_000))
  assert sum(c.nbytes for c in device.schedule.copies) == 2 * 8 * leaf
  assert not device.schedule.host_compute


# --- master weights ------------------------------------------------------------------------------


def _bf16_grads(params, step):
  """Gradients exactly representable in bf16, for both the fp32 and the bf16 runs."""
  return jax.tree.map(lambda g: g.astype(jnp.bfloat16), make_grads(params, step))


# (name, factory, master bit-equal to the fp32 run). For the Adam family XLA:CPU fuses the bias
# correction's `power` differently once the master arithmetic sits next to the update (the same
# effect as grouping, see test_transform): the master then follows the fp32 run within ulps.
_MASTER_CASES = (
  ("sgd_momentum", lambda: optax.sgd(1e-2, momentum=0.9), True),
  ("lion", lambda: optax.lion(1e-3), True),
  ("adafactor", lambda: optax.adafactor(1e-2), True),
  ("adamw", lambda: optax.adamw(1e-2), False),
)


@pytest.mark.parametrize(
  "name,make,exact,update_on",
  [
    (*_MASTER_CASES[0], "device"),
    (*_MASTER_CASES[1], "host"),
    (*_MASTER_CASES[2], "device"),
    (*_MASTER_CASES[3], "device"),
    (*_MASTER_CASES[3], "host"),
  ],
  ids=["sgd_momentum-device", "lion-host", "adafactor-device", "adamw-device", "adamw-host"],
)
def test_master_weights_follow_the_fp32_run(name, make, exact, update_on):
  # Start from bf16-representable values so (a) fp32 and (b) bf16 params start equal.
  f32 = {
    k: v.astype(jnp.bfloat16).astype(jnp.float32) for k, v in make_params().items() if k != "dense"
  }
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), f32)
  # The same groups for both: one group each ((b) holds more state per leaf, the master, so a small
  # byte window would group them differently).
  tx_a = oo.offload(make(), window_bytes="1GiB", update_on=update_on)
  tx_b = oo.offload(make(), window_bytes="1GiB", update_on=update_on, master_dtype=jnp.float32)

  def run(tx, params):
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    for t in range(50):
      g = _bf16_grads(f32, t)
      params, state = step(params, state, jax.tree.map(lambda g, p: g.astype(p.dtype), g, params))
    return params, state

  a_params, _ = run(tx_a, f32)
  b_params, b_state = run(tx_b, bf16)
  master = oo.master_params(b_state)
  # The returned updates land the bf16 params exactly on the rounded master, whatever the optimizer.
  assert bits_equal(jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), b_params)
  assert jax.tree.map(lambda p: p.dtype, b_params) == jax.tree.map(lambda p: p.dtype, bf16)
  assert master["big"].sharding.memory_kind == "pinned_host"
  if exact:
    assert bits_equal(a_params, master)
    assert bits_equal(jax.tree.map(lambda p: p.astype(jnp.bfloat16), a_params), b_params)
  else:
    assert_close(a_params, master)
  # Against plain optax on fp32 params: the numerics rule.
  plain = make()
  p, s = f32, plain.init(f32)
  for t in range(50):
    g = jax.tree.map(lambda g: g.astype(jnp.float32), _bf16_grads(f32, t))
    u, s = plain.update(g, s, p)
    p = optax.apply_updates(p, u)
  assert_close(p, master)


def test_an_integer_leaf_gets_no_master_copy(tmp_path):
  # master_dtype refused a params tree with an integer leaf; that leaf now gets no master copy (as
  # a float32 leaf) and is updated as by plain optax, the bfloat16 leaf as in one group.
  params = {**make_params(), "ids": jnp.arange(5000, dtype=jnp.int32)}
  plain = train(optax.adamw(1e-2), params, 3)[0]
  one = train(
    oo.offload(optax.adamw(1e-2), window_bytes="1GiB", master_dtype=jnp.float32), params, 3
  )
  assert oo.master_params(one[1])["ids"] is None
  for options in ({}, {"host_limit": 0, "nvme_dir": str(tmp_path / "nvme")}):
    tx = oo.offload(optax.adamw(1e-2), window_bytes=100_000, master_dtype=jnp.float32, **options)
    got = train(tx, params, 3)
    assert bits_equal(plain["ids"], got[0]["ids"])
    assert_close(one[0], got[0])
    oo.close_nvme(got[1])


def test_master_dtype_bad_input():
  params = make_params()
  with pytest.raises(ValueError, match=r"narrower than param \['big'\]"):
    oo.offload(optax.adam(1e-2), master_dtype=jnp.bfloat16).init(params)
  # 16 bits over 16 bits of the other kind kept no master copy, silently (helper revP).
  for param, master in ((jnp.bfloat16, jnp.float16), (jnp.float16, "bf16")):
    with pytest.raises(ValueError, match=r"no wider than param \['w'\].*keep no master copy"):
      oo.offload(optax.adam(1e-2), master_dtype=master).init({"w": jnp.ones((64, 64), param)})
  with pytest.raises(ValueError, match="floating dtype"):
    oo.offload(optax.adam(1e-2), master_dtype=jnp.int32)
  with pytest.raises(ValueError, match="needs jax_enable_x64"):  # it would be a float32 copy
    oo.offload(optax.adam(1e-2), master_dtype=jnp.float64)
  with pytest.raises(ValueError, match="Unknown master_dtype 'fp33'"):
    oo.offload(optax.adam(1e-2), master_dtype="fp33")
  # Short names, as oo.estimate and moment_dtype take them.
  a = oo.offload(optax.adam(1e-2), window_bytes="1GiB", master_dtype="fp32").init(params)
  b = oo.offload(optax.adam(1e-2), window_bytes="1GiB", master_dtype=jnp.float32).init(params)
  assert oo.footprint(a) == oo.footprint(b)


# --- gradients born on the host ------------------------------------------------------------------


def _mlp_loss(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"]) ** 2)


def _mlp():
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(64, 128)) * 0.1, jnp.float32),
    "b1": jnp.zeros(128, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(128, 64)) * 0.1, jnp.float32),
  }
  return params, jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)


def test_value_and_grad_to_host_gives_host_gradients_and_the_same_step():
  params, x = _mlp()
  tx_ref = optax.adamw(1e-2)
  tx = oo.offload(optax.adamw(1e-2), update_on="host")

  @jax.jit
  def ref_step(p, s):
    loss, g = jax.value_and_grad(_mlp_loss)(p, x)
    u, s = tx_ref.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  @jax.jit
  def step(p, s):
    loss, g = oo.value_and_grad_to_host(_mlp_loss)(p, x)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  _, grads = jax.jit(oo.value_and_grad_to_host(_mlp_loss))(params, x)
  assert grads["w1"].sharding.memory_kind == "pinned_host"
  assert grads["w2"].sharding.memory_kind == "pinned_host"
  assert grads["b1"].sharding.memory_kind == "device"
  p_ref, s_ref, p, s = params, tx_ref.init(params), params, tx.init(params)
  for _ in range(5):
    p_ref, s_ref, loss_ref = ref_step(p_ref, s_ref)
    p, s, loss = step(p, s)
    assert float(loss) == float(loss_ref)
  assert bits_equal(p_ref, p)


def _dependencies(mlir: str) -> dict[str, set[str]]:
  """SSA value -> the values it is computed from (transitively), from the MLIR text."""
  direct = {}
  for m in re.finditer(r"^\s*(%[\w#:]+) = (.*)$", mlir, re.M):
    name = m.group(1).split(":")[0]
    direct[name] = {d.split("#")[0] for d in re.findall(r"%[\w#]+", m.group(2))}
  closure: dict[str, set[str]] = {}

  def deps(v):
    if v not in closure:
      closure[v] = set()
      for d in direct.get(v, ()):
        closure[v] |= {d} | deps(d)
    return closure[v]

  for v in direct:
    deps(v)
  return closure


def test_gradient_leaves_the_device_right_after_it_is_computed():
  params, x = _mlp()
  mlir = jax.export.export(jax.jit(oo.value_and_grad_to_host(_mlp_loss)), platforms=["cuda"])(
    params, x
  ).mlir_module()
  deps = _dependencies(mlir)
  dots = re.findall(r"^\s*(%\w+) = stablehlo\.dot_general .*-> tensor<([0-9x]+)x", mlir, re.M)
  moves = re.findall(
    r"^\s*(%\w+) = stablehlo\.custom_call @annotate_device_placement\((%\w+)\).*pinned_host.*"
    r"-> tensor<([0-9x]+)x",
    mlir,
    re.M,
  )
  assert len(moves) == 2  # w1's and w2's gradients; b1 is small
  w1_move = next(m for m, _, shape in moves if shape == "64x128")
  w2_move = next(m for m, _, shape in moves if shape == "128x64")
  # Program order of the dots: forward x@w1, h@w2; backward dW2, dh, dW1.
  assert len(dots) == 5
  (fwd1, _), (dw2, dh, dw1) = [d for d, _ in dots[:2]], [d for d, _ in dots[2:]]
  # w2's transfer needs dW2 and nothing of layer 1's backward pass: XLA can start the copy as soon
  # as that gradient exists, while the rest of the backward pass runs. w1's needs dW1.
  assert dw2 in deps[w2_move] and fwd1 in deps[w2_move]
  assert dh not in deps[w2_move] and dw1 not in deps[w2_move]
  assert dw1 in deps[w1_move] and dh in deps[w1_move]
