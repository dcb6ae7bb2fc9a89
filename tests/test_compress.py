"""Moments kept in bf16: `with_moment_dtype`, `offload(moment_dtype=...)`, `estimate` and `plan`.

The reference is plain optax on fp32 state whose moments are rounded to bf16 after every step (the
same precision, written without the wrapper); the wrapper must give its bits, and `offload` the
wrapper's bits on every tier (one group; several groups for optimizers whose arithmetic does not
depend on the grouping, the numerics rule in DESIGN.md).
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

import optax_offload as oo
from optax_offload._src import cli

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
  "dtype, match", [("int8", "block-quantized"), ("fp8", "8-bit float"), ("bogus", "floating")]
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


def test_a_checkpoint_of_bf16_moments_resumes_bit_exact(tmp_path):
  import checkpoint_child as child
  import orbax.checkpoint as ocp

  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", tmp_path / "nvme_a", moment_dtype="bf16")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=child.save_args(p, s))
    mngr.wait_until_finished()
  want = child.result(*child.run(step, p, s, 3, 5))
  oo.close_nvme(s)

  tx2 = child.make_tx("adamw", "nvme", tmp_path / "nvme_b", moment_dtype="bf16")
  target = tx2.init(params)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(3, args=child.restore_args(params, target))
  assert {x.dtype for x in jax.tree.leaves(oo.to_inner(restored["opt_state"])[0].mu)} == {
    jnp.dtype(BF16)
  }
  got = child.result(
    *child.run(child.make_step(tx2), restored["params"], restored["opt_state"], 3, 5)
  )
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
  oo.close_nvme(restored["opt_state"])
