"""Moments kept in bf16 or 8 bits: `with_moment_dtype`, `offload(moment_dtype=...)`, `estimate`
and `plan`.

The reference is plain optax on fp32 state whose moments are rounded to bf16 after every step (the
same precision, written without the wrapper); the wrapper must give its bits, and `offload` the
wrapper's bits on every tier (one group; several groups for optimizers whose arithmetic does not
depend on the grouping, the numerics rule in DESIGN.md). For 8-bit moments the rounding is a
plain-numpy blockwise quantizer written from bitsandbytes' `create_dynamic_map`, below.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import WHOLE_LEAF_WINDOW
from conftest import assert_close
from conftest import bits_equal
from conftest import make_grads
from conftest import train
from conftest import update_step

import optax_offload as oo
from optax_offload._src import cli
from optax_offload._src import compress
from optax_offload._src import inspection

BF16 = jnp.bfloat16

OPTIMIZERS = {
  "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
  "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
  "lion": lambda: optax.lion(1e-3),
}


def rounded_reference(inner, params, steps: int):
  """Plain optax, fp32 state, its param-shaped fp32 moments rounded to bf16 after each step."""

  def round_moments(state):
    return optax.tree_utils.tree_map_params(
      inner,
      lambda x, p: (
        x.astype(BF16).astype(x.dtype) if x.dtype == jnp.float32 and x.shape == p.shape else x
      ),
      state,
      params,
    )

  state = round_moments(inner.init(params))

  @jax.jit
  def step(p, s, g):
    u, s = inner.update(g, s, p)
    return optax.apply_updates(p, u), round_moments(s)

  for t in range(steps):
    params, state = step(params, state, make_grads(params, t))
  return params, state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_wrapper_equals_optax_with_moments_rounded_to_bf16(params, name):
  want_params, want_state = rounded_reference(OPTIMIZERS[name](), params, steps=4)
  got_params, got_state = train(oo.with_moment_dtype(OPTIMIZERS[name](), "bf16"), params, 4)
  assert bits_equal(got_params, want_params)
  widened = jax.tree.map(lambda x, w: x.astype(w.dtype), got_state, want_state)
  assert bits_equal(widened, want_state)


def test_moments_only_are_narrowed(params):
  # adamw's mu and nu of fp32 leaves; the bf16 leaf's moments are already bf16; the count stays.
  state = oo.with_moment_dtype(optax.adamw(1e-3), "bf16").init(params)
  assert {x.dtype for x in jax.tree.leaves(state[0].mu)} == {jnp.dtype(BF16)}
  assert state[0].count.dtype == jnp.int32
  # adafactor's factored rows and columns are not shaped like their param: kept in fp32.
  factored = oo.with_moment_dtype(optax.adafactor(1e-3), "bf16").init({"w": jnp.ones((256, 128))})
  assert {x.dtype for x in jax.tree.leaves(factored)} == {
    jnp.dtype(jnp.float32),
    jnp.dtype("int32"),
  }


def test_offload_keeps_bf16_moments_on_the_host_and_a_fp32_master():
  params = {"w": jnp.ones((256, 64), BF16)}
  plain = oo.offload(optax.adamw(1e-3), master_dtype=jnp.float32).init(params)
  tx = oo.offload(optax.adamw(1e-3), master_dtype=jnp.float32, moment_dtype="bf16")
  state = tx.init(params)
  assert state.inner.master["w"].dtype == jnp.float32
  assert state.inner.inner[0].mu["w"].dtype == BF16
  assert state.inner.inner[0].nu["w"].sharding.memory_kind == "pinned_host"
  # fp32 master 4 B + mu and nu 2 B each, instead of 4 + 4 + 4.
  assert oo.footprint(state)["host"] == 256 * 64 * 8
  assert oo.footprint(plain)["host"] == 256 * 64 * 12
  _, state = jax.jit(tx.update)(params, state, params)
  assert state.inner.inner[0].nu["w"].dtype == BF16


@pytest.mark.parametrize(
  "name, update_on",
  [("adamw", "device"), ("sgd_momentum", "device"), ("lion", "device"), ("adamw", "host")],
)
def test_offload_equals_the_wrapper_one_group(params, name, update_on):
  want = train(oo.with_moment_dtype(OPTIMIZERS[name](), "bf16"), params, 3)
  got_params, got_state = train(
    oo.offload(OPTIMIZERS[name](), moment_dtype="bf16", update_on=update_on), params, 3
  )
  assert bits_equal(got_params, want[0])
  assert bits_equal(oo.to_inner(got_state, memory_kind="device"), want[1])


def test_update_and_apply_with_bf16_moments(params):
  want = train(oo.with_moment_dtype(OPTIMIZERS["lion"](), "bf16"), params, 2)
  tx = oo.offload(OPTIMIZERS["lion"](), moment_dtype="bf16", window_bytes=WHOLE_LEAF_WINDOW)
  got_params, _ = train(tx, params, 2, apply=True, donate=True)
  assert bits_equal(got_params, want[0])
  abstract = oo.abstract_state(tx, params)
  assert abstract.inner[0].mu["big"].dtype == BF16
  assert abstract.inner[0].mu["big"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("name, exact", [("sgd_momentum", True), ("lion", True), ("adamw", False)])
def test_offload_equals_the_wrapper_in_groups(params, name, exact):
  want = train(oo.with_moment_dtype(OPTIMIZERS[name](), "bf16"), params, 3)
  tx = oo.offload(OPTIMIZERS[name](), moment_dtype="bf16", window_bytes=WHOLE_LEAF_WINDOW)
  got_params, _ = train(tx, params, 3)
  if exact:
    assert bits_equal(got_params, want[0])
  else:
    assert_close(want[0], got_params)


def test_bf16_moments_leave_the_shared_state_in_its_dtypes(params):
  # The update widened every narrowed leaf back to what init gives the group's params, shared
  # leaves too: schedule_free's max_lr takes the narrowest dtype of the params (bfloat16 for
  # these), float32 in a group of float32 leaves, which then became the state's.
  def make():
    return optax.contrib.schedule_free_adamw(1e-3)

  want = train(oo.with_moment_dtype(make(), "bf16"), params, 3)
  assert want[1].max_lr.dtype == BF16
  tx = oo.offload(make(), moment_dtype="bf16", window_bytes=WHOLE_LEAF_WINDOW)
  got = train(tx, params, 3)
  assert oo.to_inner(got[1]).max_lr.dtype == BF16
  assert_close(want[0], got[0])


def test_the_nvme_tier_holds_bf16_moments_with_the_host_tier_bits(params, tmp_path):
  host = train(oo.offload(optax.adamw(1e-2), moment_dtype="bf16"), params, 2)
  tx = oo.offload(optax.adamw(1e-2), moment_dtype="bf16", host_limit=0, nvme_dir=str(tmp_path))
  got_params, got_state = train(tx, params, 2)
  try:
    assert oo.tiers(got_state).inner[0].mu["big"] == "nvme"
    assert bits_equal(got_params, host[0])
    assert bits_equal(
      oo.to_inner(got_state, memory_kind="device"), oo.to_inner(host[1], memory_kind="device")
    )
    # big (300 x 200), conv (4608), dense/kernel (8192), embed (bf16 already): mu, nu in 2 bytes.
    assert oo.footprint(got_state)["nvme"] == (60000 + 4608 + 8192 + 16384) * 2 * 2
  finally:
    oo.close_nvme(got_state)


@pytest.mark.parametrize(
  "dtype, match",
  [
    ("int4", "other integer widths"),
    ("uint8", "other integer widths"),
    ("fp8", "8-bit float"),
    ("bogus", "'bf16', 'fp16' or 'int8'"),
  ],
)
def test_refuses_a_moment_dtype_it_cannot_keep(dtype, match):
  with pytest.raises(ValueError, match=match):
    oo.offload(optax.adam(1e-3), moment_dtype=dtype)
  with pytest.raises(ValueError, match=match):
    oo.with_moment_dtype(optax.adam(1e-3), dtype)
  with pytest.raises(ValueError, match=match):
    oo.estimate("7B", moment_dtype=dtype)


def test_the_7b_plan_moves_half_the_moment_bytes():
  e = oo.estimate("7B", param_dtype="bf16", master_dtype="fp32", moment_dtype="bf16")
  # fp32 master 4 B + bf16 mu and nu 2 B each per param (84 GB with fp32 moments).
  assert e.host_bytes == 56_000_000_000
  assert e.link_bytes == 2 * 56_000_000_000
  assert (e.moment_dtype, e.state_dtype) == ("bf16", "mixed")
  assert "moments in bf16" in str(e)


def test_the_plan_command_takes_moment_dtype(capsys):
  argv = ["plan", "7B", "--param-dtype", "bf16", "--master-dtype", "fp32", "--json"]
  assert cli.main([*argv, "--moment-dtype", "bf16"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["bytes_per_tier"]["host"] == 56_000_000_000
  assert out["moment_dtype"] == "bf16"
  assert cli.main(argv) == 0
  assert json.loads(capsys.readouterr().out)["bytes_per_tier"]["host"] == 84_000_000_000


def test_estimate_from_shapes_is_offloads_plan(params):
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  e = oo.estimate(shapes, optimizer=optax.adam(1e-3), moment_dtype="bf16")
  state = oo.offload(optax.adam(1e-3), moment_dtype="bf16").init(params)
  assert e.host_bytes == oo.footprint(state)["host"]
  assert e.device_state_bytes + 8 == oo.footprint(state)["device"]  # + OffloadState's handles


def test_value_and_update_keeps_bf16_moments():
  from test_value_and_update import decoder
  from test_value_and_update import reference
  from test_value_and_update import tokens

  from benchmarks.stream_layers import streamed_loss_fn

  cfg, params = decoder(3, BF16)
  make = lambda: optax.sgd(1e-2, momentum=0.9)  # noqa: E731
  want = reference(
    cfg,
    jax.tree.map(jnp.copy, params),
    oo.with_moment_dtype(make(), "bf16"),
    master=jnp.float32,
    k=1,
    clip=None,
    steps=2,
  )
  tx = oo.offload(make(), master_dtype=jnp.float32, moment_dtype="bf16", min_size=256)
  params = dict(params, layers=oo.to_pinned_host(params["layers"]))
  state = tx.init(params)
  step = jax.jit(
    oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx), donate_argnums=(0, 1)
  )
  for s in range(2):
    _, params, state = step(params, state, tokens(s, 0, 1))
  assert bits_equal(params, want)
  assert {x.dtype for x in jax.tree.leaves(oo.to_inner(state)[0].trace)} == {jnp.dtype(BF16)}


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_a_checkpoint_of_narrow_moments_resumes_bit_exact(tmp_path, moment_dtype):
  import checkpoint_child as child
  import orbax.checkpoint as ocp

  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", tmp_path / "nvme_a", moment_dtype=moment_dtype)
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=child.save_args(p, s))
    mngr.wait_until_finished()
  want = child.result(*child.run(step, p, s, 3, 5))
  oo.close_nvme(s)
  # Into plain optax's state (the way back for fp32 moments): refused, naming moment_dtype (the
  # error named only the paths, and advised the same optimizer, which it was).
  plain = optax.adamw(1e-3).init(params)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    with pytest.raises(ValueError, match="moment_dtype the checkpoint was saved with"):
      mngr.restore(3, args=child.restore_args(params, plain))

  tx2 = child.make_tx("adamw", "nvme", tmp_path / "nvme_b", moment_dtype=moment_dtype)
  target = tx2.init(params)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(3, args=child.restore_args(params, target))
  raw = inspection._materialized(restored["opt_state"])[0].mu
  if moment_dtype == "bf16":
    assert {x.dtype for x in jax.tree.leaves(raw)} == {jnp.dtype(BF16)}
  else:  # the codes and scales, as saved: the bits of the run that was not interrupted
    assert compress.is_quantized(raw["big"]) and raw["big"].codes.dtype == jnp.int8
  got = child.result(
    *child.run(child.make_step(tx2), restored["params"], restored["opt_state"], 3, 5)
  )
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
  oo.close_nvme(restored["opt_state"])


# ------------------------------------------------------------------------------------------------
# 8-bit block-quantized moments (moment_dtype="int8").


def np_dynamic_map(signed: bool) -> np.ndarray:
  """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, in numpy."""
  data = []
  for i in range(7):
    items = 2**i + 1 if signed else 2 ** (i + 1) + 1
    boundaries = np.linspace(0.1, 1, items)
    means = (boundaries[:-1] + boundaries[1:]) / 2.0
    data += (10 ** (-6 + i) * means).tolist()
    if signed:
      data += (-(10 ** (-6 + i)) * means).tolist()
  data += [0, 1.0]
  assert len(data) == 256
  return np.sort(np.asarray(data, np.float32))


def np_quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
  """Blocks of 256 along the last axis, fp32 absmax scales, the nearest map value by brute force
  (ties to the lower index, as np.argmin picks the first)."""
  x = np.asarray(x, np.float32)
  n = x.shape[-1]
  nb = -(-n // 256)
  padded = np.zeros((*x.shape[:-1], nb * 256), np.float32)
  padded[..., :n] = x
  blocks = padded.reshape(*x.shape[:-1], nb, 256)
  scales = np.abs(blocks).max(-1)
  normed = blocks / np.where(scales > 0, scales, np.float32(1))[..., None]
  m = np_dynamic_map(signed).astype(np.float64)
  index = np.abs(normed[..., None].astype(np.float64) - m).argmin(-1)
  index = index.reshape(*x.shape[:-1], nb * 256)[..., :n]
  codes = (index - 128).astype(np.int8) if signed else index.astype(np.uint8)
  return codes, scales


def np_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  signed = codes.dtype == np.int8
  index = codes.astype(np.int64) + (128 if signed else 0)
  values = np_dynamic_map(signed)[index]
  return values * np.repeat(scales, 256, axis=-1)[..., : codes.shape[-1]]


def int8_params() -> dict:
  """A leaf of two blocks with a padded second one, a stacked 3-D leaf, a 1-D leaf (stays fp32)."""
  rng = np.random.default_rng(3)
  return {
    "w": jnp.asarray(rng.normal(size=(24, 300)) * 0.1, jnp.float32),
    "stack": jnp.asarray(rng.normal(size=(3, 8, 64)) * 0.1, jnp.float32),
    "b": jnp.asarray(rng.normal(size=(50,)) * 0.1, jnp.float32),
  }


def test_the_maps_are_bitsandbytes_dynamic_maps():
  for signed in (True, False):
    assert np.array_equal(compress.dynamic_map(signed), np_dynamic_map(signed))
  # Spot values of bitsandbytes' maps: the signed one has no -1, the unsigned one no negatives.
  signed, unsigned = np_dynamic_map(True), np_dynamic_map(False)
  assert (signed[0], signed[127], signed[255]) == (np.float32(-0.99296875), 0.0, 1.0)
  assert (unsigned[0], unsigned[255], len(np.unique(unsigned))) == (0.0, 1.0, 256)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_int8_equals_a_numpy_quantizer_bit_for_bit(name):
  inner = OPTIMIZERS[name]()
  tx = oo.with_moment_dtype(inner, "int8")
  params = int8_params()
  got_params, got_state = params, tx.init(params)
  want_params, want_state = params, inner.init(params)

  def step(tx):
    @jax.jit
    def run(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    return run

  got_step, want_step = step(tx), step(inner)
  for t in range(4):
    grads = make_grads(params, t)
    got_params, got_state = got_step(got_params, got_state, grads)
    want_params, want_state = want_step(want_params, want_state, grads)
    # The reference's new moments rounded by numpy; the next step starts from what they read back.
    got_flat = jax.tree_util.tree_flatten_with_path(got_state, is_leaf=compress.is_quantized)[0]
    want_flat, want_def = jax.tree_util.tree_flatten_with_path(want_state)
    assert len(got_flat) == len(want_flat)
    read_back, quantized = [], 0
    for (path, got), (_, want) in zip(got_flat, want_flat):
      if not compress.is_quantized(got):
        assert bits_equal(got, want), jax.tree_util.keystr(path)
        read_back.append(want)
        continue
      signed = "nu" not in jax.tree_util.keystr(path)
      codes, scales = np_quantize(np.asarray(want), signed)
      assert np.array_equal(np.asarray(got.codes), codes), jax.tree_util.keystr(path)
      assert bits_equal(got.scales, scales), jax.tree_util.keystr(path)
      read_back.append(jnp.asarray(np_dequantize(codes, scales)))
      quantized += 1
    assert quantized == {"adamw": 4, "sgd_momentum": 2, "lion": 2}[name]  # w and stack
    want_state = want_def.unflatten(read_back)
    assert bits_equal(got_params, want_params)


def test_int8_moments_stay_within_the_maps_resolution_of_fp32_moments():
  """Adam's mu and nu with 8-bit storage against fp32 (the gradients do not depend on the params,
  so the fp32 moments are the exact ones): rounding a block adds at most half the map's widest gap
  times its scale, and the error before decays by b1 (b2) a step, so after T steps
  |mu_int8 - mu| <= sum_t b1**(T - t) * half_gap * scale_t."""
  b1, b2, steps = 0.9, 0.999, 8
  params = int8_params()
  tx = oo.with_moment_dtype(optax.adam(1e-2, b1=b1, b2=b2), "int8")
  exact = optax.adam(1e-2, b1=b1, b2=b2)
  state, exact_state = tx.init(params), exact.init(params)
  bound = {"mu": 0.0, "nu": 0.0}
  gaps = {
    "mu": float(np.max(np.diff(np_dynamic_map(True)))) / 2,
    "nu": float(np.max(np.diff(np_dynamic_map(False)))) / 2,
  }
  assert gaps["mu"] == pytest.approx(0.9 / 64 / 2, rel=1e-5)  # the top decade's 64 steps
  assert gaps["nu"] == pytest.approx(0.9 / 128 / 2, rel=1e-5)
  for t in range(steps):
    grads = make_grads(params, t)
    _, state = jax.jit(tx.update)(grads, state, params)
    _, exact_state = jax.jit(exact.update)(grads, exact_state, params)
    for name, decay in (("mu", b1), ("nu", b2)):
      scales = np.asarray(getattr(state[0], name)["w"].scales)
      bound[name] = decay * bound[name] + gaps[name] * np.repeat(scales, 256, axis=-1)[:, :300]
  for name in ("mu", "nu"):
    got = np.asarray(compress.dequantize(getattr(state[0], name)["w"]), np.float64)
    want = np.asarray(getattr(exact_state[0], name)["w"], np.float64)
    err = np.abs(got - want)
    # fp32 arithmetic of the update: a few ulps of the block's scale per step.
    slack = steps * 4 * np.finfo(np.float32).eps * np.abs(want).max()
    assert np.all(err <= bound[name] * (1 + 1e-6) + slack), name
    # The bound is the map's resolution, not a loose one: the largest error reaches a good part.
    assert np.max(err / bound[name]) > 0.3, name
  # 1-D leaves keep fp32 moments: exact.
  assert bits_equal(state[0].mu["b"], exact_state[0].mu["b"])


def mlp_loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def test_int8_moments_train_an_mlp_as_fp32_moments_do():
  """A small MLP (32-64-4, tanh) fitting a noisy random teacher, 100 steps of adamw: the loss with
  8-bit moments tracks the fp32 one (measured: 0.5% apart at most, at the last step; bf16 moments
  0.005%)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4096, 32)), jnp.float32)
  noise = jnp.asarray(rng.normal(size=(4096, 4)), jnp.float32)
  y = jnp.sin(x @ jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)) + 0.3 * noise
  params = {
    "w1": jnp.asarray(rng.normal(size=(32, 64)) * 0.1, jnp.float32),
    "b1": jnp.zeros(64, jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(64, 4)) * 0.05, jnp.float32),
  }
  losses = {}
  for name, tx in (
    ("fp32", optax.adamw(3e-3)),
    ("int8", oo.with_moment_dtype(optax.adamw(3e-3), "int8")),
  ):

    @jax.jit
    def step(p, s, tx=tx):
      loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, loss

    p, s, run = params, tx.init(params), []
    for _ in range(100):
      p, s, loss = step(p, s)
      run.append(float(loss))
    losses[name] = np.asarray(run)
  fp32, int8 = losses["fp32"], losses["int8"]
  assert fp32[-1] < 0.85 * fp32[0]  # it trains (0.63 -> 0.51)
  assert np.max(np.abs(int8 - fp32) / fp32) < 0.02
  assert not np.array_equal(int8, fp32)  # the moments were rounded


def test_offload_keeps_int8_moments_on_the_host():
  params = {"w": jnp.ones((256, 64), BF16), "b": jnp.ones(64, BF16)}
  tx = oo.offload(optax.adamw(1e-3), master_dtype=jnp.float32, moment_dtype="int8", min_size=64)
  state = tx.init(params)
  mu, nu = state.inner.inner[0].mu["w"], state.inner.inner[0].nu["w"]
  assert (mu.codes.dtype, nu.codes.dtype, mu.scales.dtype) == (jnp.int8, jnp.uint8, jnp.float32)
  assert mu.codes.sharding.memory_kind == "pinned_host"
  assert mu.scales.shape == (256, 1) and mu.scales.sharding.memory_kind == "pinned_host"
  assert state.inner.inner[0].mu["b"].dtype == jnp.float32  # 1-D: fp32
  # fp32 master 4 B + mu and nu 1 B each + a 4 B scale per 64-element block, b: 4 + 4 + 4 B.
  assert oo.footprint(state)["host"] == 256 * 64 * 6 + 2 * 256 * 4 + 64 * 12
  types = jax.tree.map(jax.typeof, state)
  _, state = jax.jit(tx.update)(params, state, params)
  assert jax.tree.map(jax.typeof, state) == types
  abstract = oo.abstract_state(tx, params)
  assert abstract.inner.inner[0].nu["w"].codes.sharding.memory_kind == "pinned_host"
  # to_inner reads the moments back: the plain optimizer's fp32 state.
  plain = oo.to_inner(state)
  assert plain[0].mu["w"].dtype == jnp.float32 and plain[0].mu["w"].shape == (256, 64)
  assert bits_equal(plain[0].nu["w"], compress.dequantized(state.inner.inner[0].nu["w"]))


def test_sm3s_narrow_moments_keep_its_signed_momentum_and_its_accumulators():
  # sm3 keeps one accumulator per axis of a param (a list: not shaped like it) and its momentum in
  # a field named ``nu``: quantizing raised a pytree structure error inside init, and once past
  # it the momentum took the unsigned map of Adam's ``nu`` (its negatives read back as 0).
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(256, 64)), jnp.float32), "b": jnp.ones(64)}
  grads = {k: jnp.asarray(rng.normal(size=p.shape), jnp.float32) for k, p in params.items()}
  tx = oo.with_moment_dtype(optax.sm3(1e-2, momentum=0.9), "int8")
  state = tx.update(grads, tx.init(params), params)[1]
  accumulators, momentum = state[0].mu["w"], state[0].nu["w"]
  assert [a.dtype for a in accumulators] == [jnp.float32, jnp.float32]
  assert momentum.codes.dtype == jnp.int8  # (the signed map)
  want = optax.sm3(1e-2, momentum=0.9).update(grads, optax.sm3(1e-2).init(params), params)[1]
  np.testing.assert_allclose(compress.dequantized(momentum), want[0].nu["w"], atol=2e-3)
  got = train(oo.offload(optax.sm3(1e-2, momentum=0.9), moment_dtype="int8"), params, 3)
  ref = train(tx, params, 3)
  assert bits_equal(got[0], ref[0])
  # bf16 (which raised the same error inside init): the accumulators stay fp32 too.
  tx = oo.with_moment_dtype(optax.sm3(1e-2, momentum=0.9), "bf16")
  state = tx.update(grads, tx.init(params), params)[1]
  assert [a.dtype for a in state[0].mu["w"]] == [jnp.float32, jnp.float32]
  assert [a.dtype for a in state[0].mu["b"]] == [jnp.float32]  # (a list of one: not a moment)
  assert state[0].nu["w"].dtype == BF16
  got = train(oo.offload(optax.sm3(1e-2, momentum=0.9), moment_dtype="bf16"), params, 3)
  assert bits_equal(got[0], train(tx, params, 3)[0])


class _Box(dict):
  """A dict registered as a pytree node without keys (its paths hold flattened indices)."""


jax.tree_util.register_pytree_node(
  _Box, lambda b: (list(b.values()), list(b.keys())), lambda k, v: _Box(zip(k, v))
)


def test_int8_moments_in_a_state_node_its_paths_do_not_index():
  # Finding sm3's signed nu walks the state by its paths: a node whose paths are flattened
  # indices raised a KeyError inside init.
  inner = optax.adam(1e-3)
  tx = optax.GradientTransformation(
    lambda p: _Box(opt=inner.init(p)),
    lambda u, s, p=None: (lambda r: (r[0], _Box(opt=r[1])))(inner.update(u, s["opt"], p)),
  )
  state = oo.with_moment_dtype(tx, "int8").init({"w": jnp.ones((8, 64))})
  assert state["opt"][0].nu["w"].codes.dtype == jnp.uint8


@pytest.mark.parametrize(
  "name, update_on",
  [("adamw", "device"), ("sgd_momentum", "device"), ("lion", "device"), ("adamw", "host")],
)
def test_offload_equals_the_int8_wrapper_one_group(params, name, update_on):
  want = train(oo.with_moment_dtype(OPTIMIZERS[name](), "int8"), params, 3)
  got_params, got_state = train(
    oo.offload(OPTIMIZERS[name](), moment_dtype="int8", update_on=update_on), params, 3
  )
  assert bits_equal(got_params, want[0])
  assert bits_equal(inspection._materialized(got_state), want[1])


@pytest.mark.parametrize("name", ["sgd_momentum", "lion"])
def test_offload_equals_the_int8_wrapper_in_row_slices(params, name):
  # One group against groups of row slices (big: 2 x 150 rows): exact for optimizers whose
  # arithmetic does not depend on the grouping, with update_and_apply.
  one = train(oo.offload(OPTIMIZERS[name](), moment_dtype="int8"), params, 3, apply=True)
  tx = oo.offload(OPTIMIZERS[name](), moment_dtype="int8", window_bytes=100_000)
  sliced = train(tx, params, 3, apply=True)
  assert bits_equal(sliced[0], one[0])
  assert bits_equal(inspection._materialized(sliced[1]), inspection._materialized(one[1]))


def test_the_nvme_tier_holds_int8_moments_with_the_host_tier_bits(tmp_path):
  # wide: codes and scales (4096 x 1, 4096 elements) offloaded and updated in row slices; big: its
  # scales (300 x 1) stay on the device, as every state array under min_size does.
  rng = np.random.default_rng(5)
  params = {
    "wide": jnp.asarray(rng.normal(size=(4096, 64)), jnp.float32),
    "big": jnp.asarray(rng.normal(size=(300, 200)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(300,)), jnp.float32),
  }
  kwargs = dict(moment_dtype="int8", window_bytes=1 << 20)  # wide in row slices
  host = train(oo.offload(optax.adamw(1e-2), **kwargs), params, 2)
  tx = oo.offload(optax.adamw(1e-2), host_limit=0, nvme_dir=str(tmp_path), **kwargs)
  got_params, got_state = train(tx, params, 2)
  try:
    mu = oo.tiers(got_state).inner[0].mu
    assert (mu["wide"].codes, mu["wide"].scales, mu["big"].codes, mu["big"].scales) == (
      "nvme",
      "nvme",
      "nvme",
      "device",
    )
    assert bits_equal(got_params, host[0])
    assert bits_equal(
      inspection._materialized(got_state), jax.device_get(inspection._materialized(host[1]))
    )
    # Codes of wide and big and wide's scales, for mu and nu.
    assert oo.footprint(got_state)["nvme"] == (4096 * 64 + 4096 * 4 + 60000) * 2
  finally:
    oo.close_nvme(got_state)


def fp32_for(name):
  """multi_transform's labels: "fp32" for the params under `name`, "int8" for the others."""

  def labels(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: "fp32" if getattr(path[0], "key", None) == name else "int8", params
    )

  return labels


def int8_but(name):
  """adamw with 8-bit moments but for `name`'s (docs/tiers.md: an output kernel whose last axis
  is the vocabulary mixes frequent and rare tokens in a block)."""
  transforms = {"int8": oo.with_moment_dtype(OPTIMIZERS["adamw"](), "int8")}
  return optax.multi_transform(dict(transforms, fp32=OPTIMIZERS["adamw"]()), fp32_for(name))


@pytest.mark.parametrize("tier", ["host", "host_row_slices", "nvme"])
def test_one_leafs_moments_stay_fp32_through_multi_transform(params, tier, tmp_path):
  import orbax.checkpoint as ocp

  want = train(int8_but("big"), params, 3)
  kwargs = {"host_row_slices": {"window_bytes": 100_000}, "nvme": {"host_limit": 0}}.get(tier, {})
  if tier == "nvme":
    kwargs["nvme_dir"] = str(tmp_path)
  got_params, got_state = train(oo.offload(int8_but("big"), **kwargs), params, 3)
  try:
    if tier == "host_row_slices":  # adam's bias correction fuses per group: DESIGN.md's rule
      assert_close(want[0], got_params)
    else:
      assert bits_equal(got_params, want[0])
      assert bits_equal(jax.device_get(inspection._materialized(got_state)), want[1])
    adam = oo.to_inner(got_state).inner_states
    assert adam["fp32"].inner_state[0].mu["big"].dtype == jnp.float32
    quantized = got_state.inner.inner_states["int8"].inner_state[0].mu["conv"]
    assert compress.is_quantized(quantized)
    # Offloaded (above min_size): big's fp32 moments, codes for kernel and conv, and embed's
    # moments in bf16, its dtype (not fp32: not quantized); the scales stay on the device.
    bytes_ = 300 * 200 * 4 * 2 + (64 * 128 + 3 * 3 * 16 * 32) * 2 + 256 * 64 * 2 * 2
    assert sum(oo.footprint(got_state)[k] for k in ("host", "nvme")) == bytes_
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    if tier == "host":  # estimate from shapes counts the mixed state
      assert oo.estimate(shapes, optimizer=int8_but("big")).host_bytes == bytes_
    # An Orbax checkpoint holds the mixed state; it restores into a fresh one, bit for bit.
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
      mngr.save(3, args=oo.OffloadSave(got_state))
      mngr.wait_until_finished()
    if tier == "nvme":
      kwargs["nvme_dir"] = str(tmp_path / "restored")
    target = oo.offload(int8_but("big"), **kwargs).init(params)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
      restored = mngr.restore(3, args=oo.OffloadRestore(target))
    try:
      assert bits_equal(
        jax.device_get(inspection._materialized(restored)),
        jax.device_get(inspection._materialized(got_state)),
      )
    finally:
      oo.close_nvme(restored)
  finally:
    oo.close_nvme(got_state)


@pytest.mark.parametrize("moment_dtype", ["int8", "bf16"])
def test_moment_dtype_over_a_per_leaf_choice_is_refused(params, moment_dtype):
  # It narrowed every moment again: big's fp32 moments became 8-bit, silently (helper review).
  with pytest.raises(ValueError, match="already keeps moments in 8 bits.*Leave moment_dtype unset"):
    oo.offload(int8_but("big"), moment_dtype=moment_dtype).init(params)


def test_the_7b_plan_with_int8_moments():
  e = oo.estimate("7B", param_dtype="bf16", master_dtype="fp32", moment_dtype="int8")
  # fp32 master 4 B + mu and nu 1 B each + 4 B per 256: 42.2 GB instead of 84 (56 with bf16).
  assert e.host_bytes == 28_000_000_000 + 2 * (7_000_000_000 + 4 * 27_343_750)
  assert (e.moment_dtype, e.state_dtype) == ("int8", "mixed")
  assert "moments in int8" in str(e)
  argv = ["plan", "7B", "--param-dtype", "bf16", "--master-dtype", "fp32", "--json"]
  assert cli.main([*argv, "--moment-dtype", "int8"]) == 0


def test_estimate_from_shapes_is_offloads_int8_plan(params, capsys):
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  e = oo.estimate(shapes, optimizer=optax.adam(1e-3), moment_dtype="int8")
  state = oo.offload(optax.adam(1e-3), moment_dtype="int8").init(params)
  assert e.host_bytes == oo.footprint(state)["host"]
  assert e.device_state_bytes + 8 == oo.footprint(state)["device"]  # + OffloadState's handles


def test_a_flax_nnx_optimizer_keeps_int8_moments():
  # NNX turns a named tuple held in a variable into its own mapping after the first update: the
  # wrapper reads that form too, step after step.
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.full((64, 128), 0.1, jnp.float32))

  def loss(w):
    return jnp.sum((w - jnp.arange(128.0) / 128) ** 2)

  model = Model()
  make = lambda: oo.offload(optax.adam(1e-2), moment_dtype="int8", min_size=256)  # noqa: E731
  optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: loss(m.w[...]))(model)
    optimizer.update(model, grads)

  tx = make()
  params = {"w": jnp.full((64, 128), 0.1, jnp.float32)}
  state = tx.init(params)
  plain = jax.jit(lambda p, s: update_step(tx, False)(p, s, {"w": jax.grad(loss)(p["w"])}))
  for _ in range(3):
    step(model, optimizer)
    params, state = plain(params, state)
  assert bits_equal(model.w[...], params["w"])


def test_int8_never_takes_more_bytes_than_fp32():
  # A last axis of 1 would cost a code and a one-element block's fp32 scale, 5 bytes per element:
  # such moments stay fp32; every other width costs less than fp32's 4 (at most 3 bytes, n = 2).
  tx = oo.with_moment_dtype(optax.adam(1e-3), "int8")
  for n in (1, 2, 3, 255, 256, 257, 1000):
    mu = tx.init({"w": jnp.ones((8, n))})[0].mu["w"]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(mu))
    assert compress.is_quantized(mu) == (n > 1), n
    assert nbytes == (compress.quantized_nbytes((8, n)) if n > 1 else 4 * 8 * n)
    assert nbytes <= (3 if n > 1 else 4) * 8 * n, n
  # And offload moves them as such: an (8192, 1) leaf's moments take fp32's bytes on the host.
  params = {"w": jnp.ones((8192, 1))}
  state = oo.offload(optax.adam(1e-3), moment_dtype="int8").init(params)
  assert oo.footprint(state)["host"] == 2 * 8192 * 4


def test_dequantized_reads_arrays_with_and_without_shardings():
  q = compress.quantize(jnp.asarray(np.linspace(-1.0, 1.0, 600).reshape(2, 300)), signed=True)
  want = np.asarray(compress.dequantize(q))
  host = jax.device_put(q.codes, q.codes.sharding.with_memory_kind("pinned_host"))
  for codes, scales in [
    (q.codes, q.scales),
    (host, np.asarray(q.scales)),  # scales without a sharding
    (np.asarray(q.codes), np.asarray(q.scales)),  # neither has one
  ]:
    got = compress.dequantized({"m": compress.QuantizedMoment(codes, scales)})["m"]
    np.testing.assert_array_equal(np.asarray(got), want)
  got = compress.dequantized({"m": compress.QuantizedMoment(host, np.asarray(q.scales))})["m"]
  assert got.sharding.memory_kind == "pinned_host"  # read back where the codes are
