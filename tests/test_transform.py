"""Tests of `offload`: numerics against plain optax, placement, composition, donation, bad input."""

import collections
import functools
import re
import sys
import types
import warnings

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
from conftest import update_step
from flax import traverse_util
from helpers import OPTIMIZERS

import optax_offload as oo
from optax_offload._src import plan as plan_lib

# `helpers.OPTIMIZERS` says which are exact when grouped (`exact`), and whose params are exact with
# update_and_apply (`exact_apply`). With one group every
# optimizer is bit-exact. Grouped, the state of the exact ones stays bit for bit; the Adam family's
# does not: XLA fuses the scalar bias correction (`1 - b**count`, a `power`) into each leaf's loop
# or computes it once depending on the group's shape, and the fused `power` is approximated per
# element, so results differ by ulps (measured <= 2e-7 of each leaf's scale after 20 steps; the
# tests allow conftest.RTOL = 1e-6).
# Grouped params: a leaf updated in row slices (here 'big') reaches optax.apply_updates with its
# updates materialized, so XLA no longer contracts plain optax's `p + u` into the update (one FMA):
# within tolerance with tx.update, bit for bit with update_and_apply (which applies in the update),
# adafactor aside (its whole-leaf update fuses differently with the applied params). Measured
# (lamb, bf16 'embed'): tx.update within 1 ulp of bf16 after 20 steps, update_and_apply within 2.

SMALL_WINDOW = 100_000  # several groups for make_params(), 'big' in row slices
STEPS = 20


def _planned_groups(log: str) -> int:
  """Groups of the last plan `offload` logged (INFO, "offload plan:" then one line per group)."""
  plan = log[log.rindex("offload plan:") :]
  return len(re.findall(r"^group \d+:", plan, re.M))


# Eagerly (op by op, loops unrolled: `stream`) for a few optimizers whose state and arithmetic
# differ in kind: the Adam family's bias correction, lamb's per-leaf norms, lion's signs (whose
# state differed when an eager update ran in a compiled loop: `stream`), adafactor's factored
# state; the rest jitted only (the eager path does not otherwise depend on the optimizer; all 12
# eagerly took 83 s of the suite).
EAGER = ("adam", "lamb", "lion", "adafactor")
_MATCH_CASES = [
  pytest.param(opt, jit, id=f"{opt.name}-{'jit' if jit else 'eager'}")
  for opt in OPTIMIZERS
  for jit in (True, False)
  if jit or opt.name in EAGER
]


@pytest.mark.parametrize("opt, jit", _MATCH_CASES)
def test_matches_plain_optax(opt, jit, caplog):
  name, make, exact, exact_apply = opt.name, opt.make, opt.exact, opt.exact_apply
  params = make_params()
  steps = STEPS if jit else 8  # eager is slow; the grouping logic is the same
  ref_params, ref_state = train(make(), params, steps, jit=jit)
  caplog.set_level("INFO", logger="optax_offload._src.offload")
  # One group (window larger than the state): bit for bit, whatever the optimizer, with
  # tx.update + optax.apply_updates and with update_and_apply.
  for apply in (False, True):
    tx = oo.offload(make(), window_bytes="1GiB")
    one_params, one_state = train(tx, params, steps, jit=jit, apply=apply)
    assert _planned_groups(caplog.text) == 1
    assert bits_equal(ref_params, one_params), (name, apply)
    assert bits_equal(ref_state, oo.to_inner(one_state, memory_kind="device")), (name, apply)
  # Several groups: bit for bit where XLA's arithmetic does not depend on the grouping.
  for apply in (False, True):
    tx = oo.offload(make(), window_bytes=SMALL_WINDOW)
    got_params, got_state = train(tx, params, steps, jit=jit, apply=apply)
    assert _planned_groups(caplog.text) > 1, caplog.text[-2000:]  # 12 to 38 groups here
    state = oo.to_inner(got_state, memory_kind="device")
    if exact:
      assert bits_equal(ref_state, state), (name, apply)
    else:
      assert_close(ref_state, state)
    if exact_apply and apply:
      assert bits_equal(ref_params, got_params), name
    else:
      # update_and_apply rounds a bf16 leaf's `p + u` at another fusion boundary than plain optax
      # (up to one ulp per step); lamb's trust ratio feeds that back: two ulps after 20 steps.
      assert_close(ref_params, got_params, ulps=2 if apply else 1)


def test_tx_update_keeps_whole_leaves_exact_on_the_cpu():
  # tx.update runs a group's update in chunks only in a program for a GPU, where the chunks let
  # every copy overlap an update (docs/gpu.md, "tx.update in the compiled program"). On a CPU a
  # whole leaf keeps one update, which XLA fuses with optax.apply_updates as in plain optax: its
  # params stay bit for bit. (Chunked, sgd+momentum's 'conv' and 'dense' differed by ulps after
  # 20 steps.)
  params = make_params()
  make = lambda: optax.sgd(1e-2, momentum=0.9)  # noqa: E731
  ref_params, _ = train(make(), params, STEPS)
  got_params, _ = train(oo.offload(make(), window_bytes=SMALL_WINDOW), params, STEPS)
  for name in ("conv", "dense", "embed", "scale"):  # 'big' is updated in row slices
    assert bits_equal(ref_params[name], got_params[name]), name


def test_a_large_leaf_is_updated_in_row_slices():
  leaves = [oo.LeafInfo("big", 60_000, 480_000, rows=300)]
  plan = oo.make_plan(leaves, min_size=4096, window_bytes=SMALL_WINDOW)
  assert all(len(u) == 1 and not u[0].whole for u in plan.units)
  assert [p.start for (p,) in plan.units][0] == 0 and plan.units[-1][0].stop == 300
  # README, tiers.md: a group holds at most window_bytes / 2.25 ...
  assert max(plan.group_bytes(leaves)) <= plan_lib.group_budget(SMALL_WINDOW) < SMALL_WINDOW / 2.24
  # ... but a leaf whose update cannot be split by rows, which is a group of its own.
  leaves.append(oo.LeafInfo("whole", 60_000, 480_000, rows=0))
  plan = oo.make_plan(leaves, min_size=4096, window_bytes=SMALL_WINDOW)
  assert [u[0].whole for u in plan.units if u[0].leaf == 1] == [True]
  assert max(plan.group_bytes(leaves)) == 480_000


def test_one_group_takes_a_window_of_nine_times_the_state():
  # README and tiers.md: a group holds window / 2.25, small leaves grouped up to a quarter of that.
  leaves = [oo.LeafInfo(f"x{i}", 10_000, 80_000) for i in range(4)]
  groups = {
    w: len(oo.make_plan(leaves, min_size=1, window_bytes=int(w * 320_000)).groups)
    for w in (1.5, 8.9, 9.0)
  }
  assert groups == {1.5: 4, 8.9: 2, 9.0: 1}


def test_groups_are_several():
  leaves = [oo.LeafInfo("x", 10_000, 80_000)] * 5
  plan = oo.make_plan(leaves, min_size=4096, window_bytes=SMALL_WINDOW)
  assert len(plan.groups) == 5


def test_placement_and_types_are_stable(params):
  tx = oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW)
  state = tx.init(params)
  types = jax.tree.map(jax.typeof, state)

  def check(state):
    for name in ("mu", "nu"):
      moments = getattr(state.inner[0], name)
      for key in ("embed", "conv", "big"):
        assert moments[key].sharding.memory_kind == "pinned_host", (name, key)
      assert moments["dense"]["kernel"].sharding.memory_kind == "pinned_host"
      assert moments["dense"]["bias"].sharding.memory_kind == "device"  # 128 < min_size
      assert moments["scale"].sharding.memory_kind == "device"
    assert state.inner[0].count.sharding.memory_kind == "device"

  check(state)
  step = jax.jit(tx.update)
  for t in range(3):
    _, state = step(make_grads(params, t), state, params)
    check(state)
    assert jax.tree.map(jax.typeof, state) == types
  _, state = tx.update(make_grads(params, 3), state, params)  # eager too
  check(state)
  assert jax.tree.map(jax.typeof, state) == types


def test_init_on_shape_dtype_struct(params):
  tx = oo.offload(optax.adam(1e-2))
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  state = tx.init(abstract)
  assert bits_equal(state, tx.init(params))
  assert state.inner[0].mu["big"].sharding.memory_kind == "pinned_host"
  assert jax.tree.map(jax.typeof, state) == jax.tree.map(jax.typeof, tx.init(params))


def test_footprint_counts_tiers(params):
  state = oo.offload(optax.adam(1e-2)).init(params)
  fp = oo.footprint(state)
  host = sum(2 * p.nbytes for p in jax.tree.leaves(params) if p.size >= 4096)
  device = (
    sum(2 * p.nbytes for p in jax.tree.leaves(params) if p.size < 4096) + 4 + 4 + 4
  )  # count, nvme_store, nvme_generation
  assert fp == {"device": device, "host": host, "nvme": 0}
  with pytest.raises(TypeError, match="outside jax.jit"):
    jax.jit(oo.footprint)(state)


def test_min_size_keeps_everything_on_device(params):
  state = oo.offload(optax.adam(1e-2), min_size=10**9).init(params)
  assert oo.footprint(state)["host"] == 0


# --- composition -------------------------------------------------------------------------------


def _compare_setups(plain, offloaded, steps=12, params=None, exact=False):
  params = make_params() if params is None else params
  ref_params, ref_state = train(plain, params, steps)
  got_params, got_state = train(offloaded, params, steps)
  check = bits_equal if exact else None
  if exact:
    assert check(ref_params, got_params)
    assert check(ref_state, oo.to_inner(got_state, memory_kind="device"))
  else:
    assert_close(ref_params, got_params)
    assert_close(ref_state, oo.to_inner(got_state, memory_kind="device"))
  return got_state


def test_chain_with_global_norm_clipping_outside():
  plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  off = optax.chain(
    optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW)
  )
  _compare_setups(plain, off)
  # One group: bit for bit.
  off1 = optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-2)))
  _compare_setups(plain, off1, exact=True)


def test_inject_hyperparams_with_learning_rate_changed_mid_run(params):
  def make():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)

  txs = [make(), oo.offload(make(), window_bytes=SMALL_WINDOW)]
  results = []
  for tx in txs:
    p, state = params, tx.init(params)
    step = jax.jit(lambda p, s, g, tx=tx: tx.update(g, s, p))
    for t in range(10):
      if t == 5:  # change the learning rate in the (shared, on-device) hyper-parameters
        inner = state.inner if isinstance(state, oo.OffloadState) else state
        inner.hyperparams["learning_rate"] = jnp.asarray(3e-3)
      u, state = step(p, state, make_grads(params, t))
      p = optax.apply_updates(p, u)
    results.append((p, state))
  assert_close(results[0][0], results[1][0])
  off_state = results[1][1]
  assert float(off_state.inner.hyperparams["learning_rate"]) == pytest.approx(3e-3)
  assert off_state.inner.hyperparams["learning_rate"].sharding.memory_kind == "device"
  assert off_state.inner.inner_state[0].mu["big"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("lr", [1e-2, optax.linear_schedule(1e-2, 1e-3, 4)], ids=["lr", "schedule"])
def test_a_state_the_update_widens_is_wide_from_init_on(params, lr, tmp_path):
  # inject_hyperparams keeps its hyperparameters in the params' widest dtype (float32 here), so
  # plain optax's moments of the bfloat16 leaf turn float32 at the first update; the NVMe tier's
  # put of such a moment raised (its files kept init's bfloat16). The state now starts widened
  # (update_dtypes), written so group by group on the NVMe tier too.
  def make():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=lr)

  want = train(make(), params, 4)
  assert make().init(params).inner_state[0].mu["embed"].dtype == jnp.bfloat16
  assert want[1].inner_state[0].mu["embed"].dtype == jnp.float32
  for options in ({}, {"host_limit": 0, "nvme_dir": str(tmp_path / "nvme")}):
    tx = oo.offload(make(), window_bytes=SMALL_WINDOW, **options)
    got = train(tx, params, 4)
    assert_close(want[0], got[0])
    assert_close(want[1], oo.to_inner(got[1], memory_kind="device"))
    assert oo.to_inner(got[1]).inner_state[0].mu["embed"].dtype == jnp.float32
    oo.close_nvme(got[1])


def test_an_integer_leafs_moments_are_float_from_init_on(params, tmp_path):
  # Plain optax's moments of an int32 param start int32 and turn float32 at the first update; the
  # NVMe tier's put of such a moment raised (its files kept init's int32).
  params = {**params, "ids": jnp.arange(5000, dtype=jnp.int32)}
  want = train(optax.adamw(1e-2), params, 3)
  assert want[1][0].mu["ids"].dtype == jnp.float32
  for options in ({}, {"host_limit": 0, "nvme_dir": str(tmp_path / "nvme")}):
    got = train(oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW, **options), params, 3)
    assert_close(want[0], got[0])
    assert_close(want[1], oo.to_inner(got[1], memory_kind="device"))
    oo.close_nvme(got[1])


def test_a_leaf_of_no_elements(params):
  # First in the tree, the separability check's step of a gradient that is not finite indexed its
  # first element (IndexError); with 8-bit moments, quantizing it divided by zero.
  params = {"a_empty": jnp.zeros((0, 8)), **params}
  want = train(optax.adamw(1e-2), params, 3)
  assert_close(
    want[0], train(oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW), params, 3)[0]
  )
  int8 = {"moment_dtype": "int8", "master_dtype": jnp.float32}
  want = train(oo.offload(optax.adamw(1e-2), window_bytes="1GiB", **int8), params, 3, apply=True)
  got = train(
    oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW, **int8), params, 3, apply=True
  )
  assert_close(want[0], got[0])


def test_an_update_not_finite_in_plain_optax_is_not_called_not_separable():
  # fp16 params with adam's default eps: plain optax's update is not finite (eps underflows). The
  # separability check counted inf - inf as a difference and refused adamw as not separable.
  rng = np.random.default_rng(0)
  params = {
    k: jnp.asarray(rng.normal(size=(64, 128)) * 0.1, dtype)
    for k, dtype in (("a", jnp.bfloat16), ("b", jnp.float16), ("c", jnp.float32))
  }
  want = train(optax.adamw(1e-2), params, 2)[0]
  got = train(oo.offload(optax.adamw(1e-2), window_bytes=20_000), params, 2)[0]
  assert not np.all(np.isfinite(np.asarray(want["b"], np.float32)))
  assert_close({k: want[k] for k in "ac"}, {k: got[k] for k in "ac"})
  np.testing.assert_allclose(
    np.asarray(want["b"], np.float32),
    np.asarray(got["b"], np.float32),
    rtol=float(jnp.finfo(jnp.float16).eps),
    equal_nan=True,
  )


def test_labels_by_a_function_that_placeholders_mislead_are_refused_with_the_fix(params):
  # On a tree of optax's params placeholders this function labels every leaf "b", so the layout
  # does not fit the state; the refusal said so without saying what to do.
  labels = lambda p: {k: "a" if getattr(v, "ndim", 0) == 2 else "b" for k, v in p.items()}  # noqa: E731
  rules = {"a": optax.adam(1e-2), "b": optax.sgd(1e-2)}
  with pytest.raises(TypeError, match=r"as a pytree instead.*labels_fn\(params\)"):
    oo.offload(optax.multi_transform(rules, labels)).init(params)
  want = train(optax.multi_transform(rules, labels), params, 2)[0]  # (the fix: labels as a tree)
  assert_close(want, train(oo.offload(optax.multi_transform(rules, labels(params))), params, 2)[0])


def test_learning_rate_schedule():
  sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20)
  _compare_setups(optax.adamw(sched), oo.offload(optax.adamw(sched), window_bytes=SMALL_WINDOW))


def test_multisteps_around_offload():
  plain = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=4)
  off = optax.MultiSteps(
    oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW), every_k_schedule=4
  )
  state = _compare_setups(plain, off, steps=10)
  assert state.inner_opt_state.inner[0].mu["big"].sharding.memory_kind == "pinned_host"


def test_multisteps_with_a_scalar_param_offloading_everything():
  """min_size=0 offloads every state array but a scalar one: MultiSteps' lax.cond refused the
  device scalar its jnp.where makes beside the host one the state held."""
  params = jax.device_put({"s": jnp.float32(0.7), "w": jnp.ones((64, 64))}, jax.devices()[0])
  inner = optax.sgd(1e-2, momentum=0.9)
  plain, off = optax.MultiSteps(inner, 2), optax.MultiSteps(oo.offload(inner, min_size=0), 2)
  p, state = params, off.init(params)
  q, plain_state = params, plain.init(params)
  for i in range(4):
    grads = jax.tree.map(lambda x, v=i + 1: jnp.full_like(x, v), params)
    updates, state = jax.jit(off.update)(grads, state, p)
    p = optax.apply_updates(p, updates)
    updates, plain_state = jax.jit(plain.update)(grads, plain_state, q)
    q = optax.apply_updates(q, updates)
  assert bits_equal(q, p)
  trace = state.inner_opt_state.inner[0].trace
  assert trace["w"].sharding.memory_kind == "pinned_host"
  assert trace["s"].sharding.memory_kind == "device"


def test_multi_transform_with_offloaded_branch():
  def labels(p):
    return jax.tree.map(lambda x: "adam" if x.ndim > 1 else "sgd", p)

  plain = optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2)}, labels)
  off = optax.multi_transform(
    {"adam": oo.offload(optax.adam(1e-2), window_bytes=SMALL_WINDOW), "sgd": optax.sgd(1e-2)},
    labels,
  )
  _compare_setups(plain, off)


_FROZEN = {"embed": True, "dense": {"kernel": True, "bias": False}, "conv": True, "big": True,
           "scale": False}  # fmt: skip
_FROZEN_BY_A_PREFIX = {"embed": True, "dense": False, "conv": True, "big": False, "scale": True}
_RULES_AS_PYTREES = {
  # A mask or labels given as a pytree (not a function of the updates) mark the masked-out leaves
  # with optax.MaskedNode in the updates of every group, in the group or not, while a group's
  # state held None at the other leaves: every update of several groups raised a pytree structure
  # error (a callable mask or labels see None there, and passed).
  "masked": lambda: optax.masked(optax.adam(1e-2), _FROZEN),
  "frozen_by_labels": lambda: optax.multi_transform(
    {"train": optax.adamw(1e-2), "freeze": optax.set_to_zero()},
    jax.tree.map(lambda t: "train" if t else "freeze", _FROZEN),
  ),
  "two_rules_by_labels": lambda: optax.multi_transform(
    {"train": optax.adam(1e-2), "other": optax.sgd(1e-2, momentum=0.9)},
    jax.tree.map(lambda t: "train" if t else "other", _FROZEN),
  ),
  # A prefix of the params' tree: optax.masked puts one MaskedNode over the "dense" subtree (the
  # state's parts did not follow the params' tree: refused before).
  "masked_by_a_prefix": lambda: optax.masked(optax.adam(1e-2), _FROZEN_BY_A_PREFIX),
  "frozen_by_labels_of_a_prefix": lambda: optax.multi_transform(
    {"train": optax.adamw(1e-2), "freeze": optax.set_to_zero()},
    jax.tree.map(lambda t: "train" if t else "freeze", _FROZEN_BY_A_PREFIX),
  ),
  # Labels from a function that reads the params' dicts (flax's path_aware_map): its init on
  # optax's params placeholder failed, and offload refused it as "cannot be split per parameter".
  "labels_by_a_function_of_dicts": lambda: optax.multi_transform(
    {"train": optax.adamw(1e-2), "freeze": optax.set_to_zero()},
    lambda p: traverse_util.path_aware_map(
      lambda k, _: "freeze" if k[0] == "dense" else "train", p
    ),
  ),
}


@pytest.mark.parametrize("name", _RULES_AS_PYTREES)
def test_a_mask_or_labels_given_as_a_pytree_work_in_several_groups(name, tmp_path):
  make, params = _RULES_AS_PYTREES[name], make_params()
  want = train(make(), params, 4)
  nvme = {"host_limit": 0, "nvme_dir": str(tmp_path / "nvme")}
  for options, apply in (({}, False), ({}, True), (nvme, False)):
    got = train(oo.offload(make(), window_bytes=SMALL_WINDOW, **options), params, 4, apply=apply)
    assert_close(want[0], got[0])
    assert_close(want[1], oo.to_inner(got[1], memory_kind="device"))
    oo.close_nvme(got[1])
  # 8-bit moments and a float32 master copy of the bfloat16 leaf, bf16 moments (whose init
  # raised on the MaskedNodes, even in one group): as in one group.
  for options in ({"moment_dtype": "int8", "master_dtype": jnp.float32}, {"moment_dtype": "bf16"}):
    want = train(oo.offload(make(), window_bytes="1GiB", **options), params, 4, apply=True)[0]
    got = train(oo.offload(make(), window_bytes=SMALL_WINDOW, **options), params, 4, apply=True)
    assert_close(want, got[0])


def test_to_inner_names_the_memory_kinds_it_takes(params):
  state = oo.offload(optax.adam(1e-2)).init(params)
  # "host", as oo.footprint and oo.tiers name the tier, raised JAX's "Could not find memory".
  with pytest.raises(ValueError, match=r"memory_kind='host'; pass None .* 'pinned_host'"):
    oo.to_inner(state, memory_kind="host")
  host = oo.to_inner(state, memory_kind="pinned_host")
  assert host[0].mu["big"].sharding.memory_kind == "pinned_host"


def test_tree_map_params_over_the_state(params):
  tx = oo.offload(optax.adam(1e-2))
  state = tx.init(params)
  doubled = optax.tree_map_params(tx, lambda v: v + 1, state)
  assert float(doubled.inner[0].mu["big"][0, 0]) == 1.0
  assert int(doubled.inner[0].count) == 0  # not a param-shaped leaf


def test_flax_nnx_optimizer():
  from flax import nnx

  def run(tx):
    model = nnx.Linear(128, 64, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      opt.update(model, grads)
      return loss

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 128)), jnp.float32)
    losses = [float(step(model, opt, x)) for _ in range(5)]
    return losses, nnx.state(model, nnx.Param), opt

  ref_losses, ref_params, _ = run(optax.adamw(1e-2))
  losses, got_params, opt = run(oo.offload(optax.adamw(1e-2)))
  assert losses == ref_losses
  assert bits_equal(ref_params, got_params)
  assert oo.footprint(nnx.state(opt))["host"] == 2 * 128 * 64 * 4


def test_flax_linen_train_state():
  from flax import linen as nn
  from flax.training import train_state

  model = nn.Dense(64)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 128)), jnp.float32)
  variables = model.init(jax.random.key(0), x)

  def run(tx):
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

    @jax.jit
    def step(state):
      grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
      return state.apply_gradients(grads=grads)

    for _ in range(5):
      state = step(state)
    return state

  ref = run(optax.adamw(1e-2))
  got = run(oo.offload(optax.adamw(1e-2)))
  assert bits_equal(ref.params, got.params)
  assert got.opt_state.inner[0].mu["kernel"].sharding.memory_kind == "pinned_host"


# --- donation ----------------------------------------------------------------------------------


def test_donated_state_does_not_grow_live_arrays():
  params = make_params()
  tx = oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW)
  state = tx.init(params)
  grads = make_grads(params, 0)

  @jax.jit
  def _step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(_step, donate_argnums=(0, 1))
  params, state = step(params, state, grads)
  jax.block_until_ready(state)
  baseline = len(jax.live_arrays())
  for _ in range(50):
    params, state = step(params, state, grads)
  jax.block_until_ready(state)
  assert len(jax.live_arrays()) <= baseline
  assert state.inner[0].mu["big"].sharding.memory_kind == "pinned_host"


# --- sharding ----------------------------------------------------------------------------------


def test_sharded_params_keep_their_sharding():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
  params = make_params()
  specs = {
    "embed": P("fsdp"),
    "dense": {"kernel": P(None, "fsdp"), "bias": P()},
    "conv": P(),
    "big": P("fsdp"),
    "scale": P(),
  }
  params = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs)
  tx = oo.offload(optax.adam(1e-2), window_bytes=SMALL_WINDOW)
  state = tx.init(params)
  types = jax.tree.map(jax.typeof, state)

  def same_sharding(x, p):
    return x.sharding.memory_kind == "pinned_host" and x.sharding.is_equivalent_to(
      p.sharding.with_memory_kind("pinned_host"), p.ndim
    )

  mu = state.inner[0].mu
  assert same_sharding(mu["big"], params["big"])
  assert same_sharding(mu["dense"]["kernel"], params["dense"]["kernel"])
  ref_params, _ = train(optax.adam(1e-2), params, 5)
  got_params, got_state = train(tx, params, 5)
  assert_close(ref_params, got_params)
  assert same_sharding(got_state.inner[0].mu["big"], params["big"])
  assert same_sharding(got_state.inner[0].nu["embed"], params["embed"])
  assert jax.tree.map(jax.typeof, got_state) == types
  assert got_params["big"].sharding.is_equivalent_to(params["big"].sharding, 2)


# --- the window, as the GPU program runs it ------------------------------------------------------


# --- bad input ---------------------------------------------------------------------------------


def test_grads_with_a_different_structure_are_refused(params):
  tx = oo.offload(optax.adam(1e-2))
  state = tx.init(params)
  grads = make_grads(params, 0)
  del grads["scale"]
  with pytest.raises(ValueError, match=r"\['scale'\]"):
    tx.update(grads, state, params)
  with pytest.raises(ValueError, match="tree structure"):
    tx.update(grads, state)


def test_grads_with_other_shapes_are_refused(params):
  tx = oo.offload(optax.adam(1e-2))
  state = tx.init(params)
  grads = make_grads(params, 0)
  grads["big"] = jnp.zeros((200, 300))
  with pytest.raises(ValueError, match=r"\['big'\].*same shapes"):
    tx.update(grads, state)


def test_a_state_of_another_transformation_is_named_as_such(tmp_path):
  params = jax.device_put({"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}, jax.devices()[0])
  grads = jax.tree.map(jnp.ones_like, params)
  tx = oo.offload(optax.adamw(1e-2))
  tx.init(params)
  for other, moment_dtype in ((optax.sgd(1e-2, momentum=0.9), None), (optax.adamw(1e-2), "int8")):
    state = oo.offload(other, moment_dtype=moment_dtype).init(params)
    with pytest.raises(ValueError, match="made by another transformation") as e:
      tx.update(grads, state, params)
    assert "inject_hyperparams" not in str(e.value)  # tx made a state
  # Another placement (min_size), either way (helper review /tmp/revH: XLA's memory-space error,
  # or a message about eval_shape).
  small = oo.offload(optax.adamw(1e-2), min_size=1)
  for made, updated in ((small, tx), (tx, small)):
    with pytest.raises(ValueError, match=r"\['b'\].*another min_size, host_limit or host_memory"):
      updated.update(grads, made.init(params), params)
  # Renamed leaves are named, not compared by position.
  with pytest.raises(ValueError, match=r"only in the gradients: \['W'\]"):
    tx.update({"W": grads["w"], "b": grads["b"]}, tx.init(params))
  # An offload built anew at every update (inject_hyperparams around it) never made the state.
  wrapped = optax.inject_hyperparams(
    lambda learning_rate: oo.offload(
      optax.adamw(learning_rate), host_limit=0, nvme_dir=str(tmp_path / "nvme")
    )
  )(learning_rate=1e-2)
  state = wrapped.init(params)
  with (
    pytest.warns(UserWarning, match="updates a state it did not make"),
    pytest.raises(ValueError, match=r"oo.offload\(optax.inject_hyperparams\(optax.adamw\)"),
  ):
    jax.jit(wrapped.update)(grads, state, params)
  oo.close_nvme(state.inner_state)


def test_missing_params_are_reported(params):
  tx = oo.offload(optax.adamw(1e-2))
  state = tx.init(params)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(make_grads(params, 0), state)


def test_non_separable_inner_is_refused(params):
  tx = oo.offload(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
  with pytest.raises(ValueError, match=r"not separable.*clip_by_global_norm\(1.0\), oo.offload"):
    tx.init(params)
  # Noise from one key for the whole tree (a state holding a PRNG key, which init reads)
  noise = optax.chain(optax.add_noise(0.01, 0.55, 0), optax.adam(1e-2))
  with pytest.raises(ValueError, match="not separable"):
    oo.offload(noise).init(params)
  # With jax_debug_nans on (the check's own NaN step then raised, and the check was skipped)
  with jax.debug_nans(True), pytest.raises(ValueError, match=r"not separable"):
    tx.init(params)


def test_apply_if_finite_is_refused_inside_and_trains_as_plain_optax_around(params, tmp_path):
  # Inside offload, a gradient that was not finite skipped the update of its own group only (the
  # other groups updated, the skip counts differed): the check, fed finite gradients, passed.
  inside = oo.offload(optax.apply_if_finite(optax.adam(1e-2), 3), window_bytes=SMALL_WINDOW)
  with pytest.raises(ValueError, match=r"not finite.*apply_if_finite\(oo.offload"):
    inside.init(params)
  with pytest.raises(ValueError, match=r"not finite"):  # (the check's first leaf a scalar)
    inside.init({"a": jnp.ones(()), "b": jnp.ones((64, 64))})

  def run(tx):
    p, s = params, tx.init(params)
    step = jax.jit(update_step(tx, apply=False))
    for t in range(5):
      g = make_grads(p, t)
      if t in (2, 3):  # skipped twice, then updated
        g["conv"] = g["conv"].at[0, 0, 0, 0].set(jnp.nan)
      p, s = step(p, s, g)
    return p

  want = run(optax.apply_if_finite(optax.adam(1e-2), 3))
  for options in ({}, {"host_limit": 0, "nvme_dir": str(tmp_path)}):
    off = oo.offload(optax.adam(1e-2), window_bytes=SMALL_WINDOW, **options)
    assert_close(want, run(optax.apply_if_finite(off, 3)))
  # One leaf, which the check of two cannot see: its split probe's NaN step keeps it whole (in
  # row slices, a NaN in one skipped that slice's update only).
  leaf = {"w": params["big"]}
  tx = optax.apply_if_finite(optax.adam(1e-2), 3)
  step = jax.jit(update_step(tx, apply=False))
  off = oo.offload(optax.apply_if_finite(optax.adam(1e-2), 3), window_bytes=SMALL_WINDOW)
  off_step = jax.jit(update_step(off, apply=False))
  p, s, q, r = leaf, tx.init(leaf), leaf, off.init(leaf)
  for t in range(4):
    g = make_grads(leaf, t)
    if t == 2:
      g["w"] = g["w"].at[250, 0].set(jnp.nan)
    (p, s), (q, r) = step(p, s, g), off_step(q, r, g)
  assert_close(p, q)


def test_lookahead_is_refused_inside_and_trains_as_plain_optax_around(params):
  # Inside, the fast optimizer's state follows the fast params, not the LookaheadParams: init
  # raised "Expected named tuple" from inside the layout.
  slow_and_fast = optax.LookaheadParams.init_synced(params)
  with pytest.raises(TypeError, match=r"optax.lookahead\(oo.offload\(optax.adam"):
    oo.offload(optax.lookahead(optax.adam(1e-2), 2, 0.5)).init(slow_and_fast)

  def run(tx):
    p, s = slow_and_fast, tx.init(slow_and_fast)
    step = jax.jit(update_step(tx, apply=False))
    for t in range(5):
      p, s = step(p, s, make_grads(params, t))
    return p

  want = run(optax.lookahead(optax.adam(1e-2), 2, 0.5))
  off = oo.offload(optax.adam(1e-2), window_bytes=SMALL_WINDOW)
  assert_close(want, run(optax.lookahead(off, 2, 0.5)))


def test_a_transformation_that_waits_is_checked_until_it_moves(params, caplog):
  # The separability check ran 3 steps: MultiSteps of 4 micro-steps around a global-norm clip
  # inside offload passed it (its updates are 0 until the 4th) and trained wrongly.
  waits = lambda k: optax.MultiSteps(  # noqa: E731
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), k
  ).gradient_transformation()
  for k in (4, 16, 256):  # (the check runs 256 steps where no update moved in 16)
    with pytest.raises(ValueError, match=r"not separable"):
      oo.offload(waits(k)).init(params)
  with caplog.at_level("INFO"):  # longer than the check: not checked, nothing split, a warning
    oo.offload(waits(300), window_bytes=SMALL_WINDOW, min_size=16).init(params)
  assert "did not move in the 256 steps" in caplog.text, caplog.text
  assert "MultiSteps around offload" in caplog.text
  assert "][0:" not in caplog.text, caplog.text  # (no row slices)


def test_a_stacks_rules_that_wait_are_compared_over_as_many_steps():
  # value_and_update compares a stack's rules on a tuple of its leaves with those at their paths;
  # over the first 3 steps, where MultiSteps' updates are 0, weight decay masked off by path did
  # not show.
  from optax_offload._src import separable

  params = {"layers": {"w": jnp.ones((4, 8, 8)), "b": jnp.ones((4, 8))}, "head": jnp.ones((8, 8))}
  by_path = functools.partial(
    jax.tree_util.tree_map_with_path, lambda q, _: "layers" in jax.tree_util.keystr(q)
  )
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
  inner = optax.with_extra_args_support(
    optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1, mask=by_path), 4).gradient_transformation()
  )
  same = separable.rules_on_a_tuple(inner, jax.tree.structure(params), avals, [1, 2])
  assert same == [False, False]


def _momentum(scale_of):
  """SGD with momentum whose step is ``scale_of(m, grads)`` (Python code run as each call of
  the update is traced: whole, in groups, in row slices)."""

  def update(u, s, p=None):
    s = jax.tree.map(lambda m, g: 0.9 * m + g, s, u)
    return jax.tree.map(lambda m: -scale_of(m, u) * m, s), s

  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def test_a_transformation_built_again_alike_is_not_probed_again(params, monkeypatch):
  # The separability check and the split probe compile a program each, and for code of other
  # modules (which may pick rules by path) the leaves' rules one more where a leaf would be split;
  # a transformation of optax's code built with equal values (`closure_key`) takes the verdicts
  # found for one before.
  from optax_offload._src import separable

  compiles = []
  real = separable._compiled
  monkeypatch.setattr(separable, "_compiled", lambda t: compiles.append(t) or real(t))
  monkeypatch.setattr(separable, "_LEARNED", type(separable._LEARNED)())

  def probes(tx):  # the probe programs compiled by an init
    before = len(compiles)
    oo.offload(tx).init(params)
    return len(compiles) - before

  assert probes(optax.lamb(1e-3)) == 2
  assert probes(optax.lamb(1e-3)) == 0  # built again alike
  assert probes(optax.lamb(1e-4)) == 2  # another learning rate
  for value, compiled in ((0.25, 2), (0.25, 0), (0.125, 2)):  # an array's value counts
    assert probes(optax.sgd(jnp.asarray(value), momentum=0.9)) == compiled
  for _ in range(2):  # a refusal is not kept
    with pytest.raises(ValueError, match="not separable"):
      probes(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
  # Code of other modules is probed at every build: what it reads may change (a global here).
  assert probes(_momentum(_global_scale)) == 3
  assert probes(_momentum(_global_scale)) == 3
  same = optax.GradientTransformationExtraArgs(*_momentum(_global_scale))  # (offload keeps it)
  assert probes(same) == 3 and probes(same) == 1  # by identity: the split verdicts kept
  monkeypatch.setattr(sys.modules[__name__], "_GLOBAL_NORM", True)
  with pytest.raises(ValueError, match="not separable"):
    probes(_momentum(_global_scale))
  with pytest.raises(ValueError, match="not separable"):  # the same object: checked again
    probes(same)
  # The probes themselves: a step that acts as a constant one's on the whole tree, not in row
  # slices, is not split.
  keys = [(np.dtype("float32"), (256,), (2,), 0, jax.tree.structure((0.0,)))]
  assert separable._probe_program(_momentum(lambda m, u: 0.5), keys)[keys[0]][0]
  sliced = _momentum(lambda m, u: 2.0 if m.shape[0] == 1 else 0.5)  # row [0:1] steps farther
  assert not separable._probe_program(sliced, keys)[keys[0]][0]


_GLOBAL_NORM = False


def _global_scale(m, u):
  """0.5, or (with `_GLOBAL_NORM`) a function of the norm of all the leaves of the call."""
  return 1.0 / (1.0 + sum(jnp.sum(x * x) for x in jax.tree.leaves(u))) if _GLOBAL_NORM else 0.5


def test_closure_key_tells_what_a_transformation_is_built_from():
  from optax_offload._src.closure_key import closure_key

  def key(tx):
    return closure_key(tx)[0]

  values = [2.0, 3.0, 2, np.float32(2), np.float64(2), jnp.bfloat16(1), jnp.float16(1)]
  values += [jnp.asarray(2.0), jnp.float32(2.0)]  # (weak type, or not)
  keys = [key(optax.scale(v)) for v in values]
  assert None not in keys and len(set(keys)) == len(keys)
  assert key(optax.scale(2.0)) == keys[0]
  assert (
    key(optax.scale(jnp.ones(3))) == key(optax.scale(jnp.ones(3))) != key(optax.scale(jnp.ones(4)))
  )
  big = jnp.ones(2**18 + 1)  # over 1 MiB: by identity, not read (it cannot change)
  assert key(optax.scale(big)) == key(optax.scale(big)) != key(optax.scale(jnp.ones(2**18 + 1)))
  held = closure_key(optax.scale(big))[1]
  assert any(x is big for x in held)  # kept alive with the key: its id is not reused
  assert key(optax.scale(np.ones(2**18 + 1, np.float32))) is None  # a numpy array may change
  # Code of other modules, or an object that may change: no key.
  assert key(optax.sgd(lambda step: 1e-2)) is None
  assert key(optax.scale(types.SimpleNamespace(value=2.0))) is None
  assert key(optax.scale(functools.partial(np.multiply, 2.0))) is not None  # numpy's code
  # No key where a value cannot be read, nor where the walk would go too deep.
  assert key(optax.scale(jax.random.key(0))) is None  # a typed PRNG key
  traced = []
  jax.jit(lambda x: traced.append(key(optax.scale(x))) or x)(1.0)
  assert traced == [None]
  deep = []
  for _ in range(5000):
    deep = [deep]
  assert key(optax.scale(deep)) is None
  cycle = [1.0]
  cycle.append(cycle)
  assert key(optax.scale(cycle)) == key(optax.scale(cycle)) is not None
  # A named tuple or enum of another module: its methods are other code.
  assert key(optax.scale(types.SimpleNamespace)) is None  # (a class of Python's, not optax's)
  Pair = collections.namedtuple("Pair", "a b")
  assert key(optax.scale(Pair(1.0, 2.0))) is None
  assert key(optax.scale(optax.EmptyState())) is not None
  # Python's builtins that read other state: no key.
  assert key(optax.scale(functools.partial(getattr, optax, "sgd"))) is None
  assert key(optax.scale(functools.partial(max, 1.0))) is not None


def test_state_that_does_not_split_per_parameter_is_refused(params):
  by_name = optax.GradientTransformation(
    init=lambda p: {"kernel_scale": jnp.ones_like(p["dense"]["kernel"])},
    update=lambda u, s, p=None: (u, s),
  )
  with pytest.raises(TypeError, match="cannot be split per parameter"):
    oo.offload(by_name).init(params)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    ({"host_limit": -1}, ValueError, "host_limit must be >= 0"),
    ({"host_limit": "lots"}, ValueError, "Could not parse host_limit"),
    ({"window_bytes": "12 parsecs"}, ValueError, "Could not parse window_bytes"),
    # A unit forgotten (accepted before: all the state on NVMe, or a window of 8192 groups).
    ({"host_limit": "64"}, ValueError, r"host_limit='64': a string without a unit .* '64GiB'"),
    ({"window_bytes": "1"}, ValueError, "window_bytes='1': a string without a unit"),
    # Bits (read as bytes before: "1Gb" planned a GB, 8 times the gigabit written).
    ({"host_limit": "1Gb"}, ValueError, r"host_limit='1Gb': a lowercase 'b' is bits.*'1GiB'"),
    ({"window_bytes": "64mb"}, ValueError, "'64MB' or '64MiB'"),
    ({"window_bytes": "4096b"}, ValueError, "a lowercase 'b' is bits; give bytes, e.g. '4096B'"),
    # A shell's variable, not expanded (made './$HOME' in the current directory before).
    ({"nvme_dir": "$HOME/nvme"}, ValueError, r"nvme_dir='\$HOME/nvme'.*os.path.expandvars"),
    ({"window_bytes": -5}, ValueError, "window_bytes must be >= 0"),
    ({"window_bytes": 0}, ValueError, "window_bytes must be > 0"),
    ({"window_bytes": 1.5}, TypeError, "window_bytes must be an int"),
    ({"min_size": -1}, ValueError, "min_size"),
    ({"update_on": "gpu"}, ValueError, "update_on must be one of"),
  ],
)
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    oo.offload(optax.adam(1e-2), **kwargs)


def test_an_nvme_dir_under_home_is_expanded(params, tmp_path, monkeypatch):
  # As write_nvme_stack does (a directory './~' in the current one before).
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  state = oo.offload(optax.adam(1e-2), host_limit=0, nvme_dir="~/nvme").init(params)
  oo.close_nvme(state)
  assert (tmp_path / "home" / "nvme" / "process_0" / "MANIFEST.json").is_file()
  assert not (tmp_path / "~").exists()


def test_host_limit_too_small_without_nvme(params):
  tx = oo.offload(optax.adam(1e-2), host_limit="100KiB")
  with pytest.raises(ValueError, match="bytes are missing.*nvme_dir"):
    tx.init(params)


@pytest.mark.parametrize("apply", [False, True], ids=["update", "update_and_apply"])
def test_a_jitted_step_compiles_once_with_committed_params(apply):
  # Host-memory arrays are always committed, so a step's outputs are: params that start
  # uncommitted come back committed and the second step would compile again (docs/gpu.md). With
  # committed params, one compile, as with plain optax.
  params = jax.device_put(make_params(), jax.devices()[0])
  tx = oo.offload(optax.adamw(1e-2), window_bytes=SMALL_WINDOW)

  step = jax.jit(update_step(tx, apply), donate_argnums=(0, 1))
  state = tx.init(params)
  for t in range(3):
    params, state = step(params, state, make_grads(make_params(), t))
  assert step._cache_size() == 1


@pytest.mark.parametrize(
  "name,make,exact",
  [
    ("adamw", lambda: optax.adamw(1e-2), False),
    ("sgd_momentum", lambda: optax.sgd(1e-2, momentum=0.9), True),
    # Moments factored over the last two axes, per layer; its default clipping and parameter scale
    # take an RMS over the whole leaf (not separable along the layers: the probe keeps such a
    # leaf whole).
    (
      "adafactor",
      lambda: optax.adafactor(1e-2, clipping_threshold=None, multiply_by_parameter_scale=False),
      False,
    ),
  ],
  ids=lambda x: x if isinstance(x, str) else "",
)
def test_a_stacked_leaf_is_streamed_in_row_slices(name, make, exact, caplog):
  # One leaf of 8 stacked layers, as lax.scan models keep them; a window of about two layers.
  rng = np.random.default_rng(0)
  params = {"layers": jnp.asarray(rng.normal(size=(8, 256, 256)) * 0.1, jnp.float32)}
  layer = jax.eval_shape(make().init, {"layers": jnp.zeros((1, 256, 256))})
  layer_state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layer) if x.size >= 256)
  tx = oo.offload(make(), window_bytes=int(2.25 * 2 * layer_state), min_size=256)
  with caplog.at_level("INFO", logger="optax_offload._src.offload"):
    tx.init(params)
  assert caplog.text.count("['layers'][") >= 3, caplog.text  # planned in row slices of layers
  ref_params, ref_state = train(make(), params, 10)
  got_params, got_state = train(tx, params, 10, apply=True)
  if exact:
    assert bits_equal(ref_params, got_params)
    assert bits_equal(ref_state, oo.to_inner(got_state, memory_kind="device"))
  else:
    assert_close(ref_params, got_params)
    assert_close(ref_state, oo.to_inner(got_state, memory_kind="device"))


def test_nvme_dir_without_host_limit_warns(params, tmp_path):
  with pytest.warns(UserWarning, match="host_limit is None.*nothing goes to NVMe"):
    tx = oo.offload(optax.adam(1e-2), nvme_dir=str(tmp_path))
  assert oo.footprint(tx.init(params))["nvme"] == 0


def _in_host_memory(tree, host_leaves):
  """`tree` with the leaves named in `host_leaves` put in pinned_host memory (one CPU device; the
  SingleDeviceSharding that `oo.to_pinned_host` gives a one-device array)."""

  def put(path, x):
    kind = "pinned_host" if jax.tree_util.keystr(path) in host_leaves else "device"
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
    return jax.device_put(np.asarray(x), sharding)

  return jax.tree_util.tree_map_with_path(put, tree)


@pytest.mark.parametrize("dtype", ["fp32", "bf16_master"])
@pytest.mark.parametrize(
  "name,make",
  [("adamw", lambda: optax.adamw(1e-2)), ("sgd_momentum", lambda: optax.sgd(1e-2, momentum=0.9))],
  ids=lambda x: x if isinstance(x, str) else "",
)
def test_params_and_grads_in_host_memory_stream_with_the_state(name, make, dtype):
  # Weights offloaded too: a stacked leaf's params and gradients live in pinned_host and stream
  # through the window in row slices with its state; the new params go back to host memory.
  rng = np.random.default_rng(0)
  param_dtype = jnp.float32 if dtype == "fp32" else jnp.bfloat16
  master = None if dtype == "fp32" else jnp.float32
  params = {
    "layers": jnp.asarray(rng.normal(size=(8, 64, 128)) * 0.1, param_dtype),
    "head": jnp.asarray(rng.normal(size=(64, 32)) * 0.1, param_dtype),
    # Under min_size: its state stays on the device.
    "scale": jnp.asarray(rng.normal(size=(3, 64)) * 0.1, param_dtype),
  }
  host = {"['layers']", "['scale']"}

  def run(host_leaves):
    tx = oo.offload(make(), window_bytes=3 * 64 * 128 * 16, min_size=256, master_dtype=master)
    p = _in_host_memory(params, host_leaves)
    state = tx.init(p)
    step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p), donate_argnums=(0, 1))
    for t in range(20):
      p, state = step(p, state, _in_host_memory(make_grads(params, t), host_leaves))
    return p, oo.to_inner(state, memory_kind="device")

  ref_params, ref_state = run(set())
  got_params, got_state = run(host)
  assert got_params["layers"].sharding.memory_kind == "pinned_host"
  assert got_params["head"].sharding.memory_kind == "device"
  assert bits_equal(ref_params, got_params)
  assert bits_equal(ref_state, got_state)


def test_params_in_host_memory_need_update_and_apply():
  params = _in_host_memory({"w": jnp.ones((64, 128))}, {"['w']"})
  tx = oo.offload(optax.sgd(1e-2, momentum=0.9), min_size=256)
  state = tx.init(params)
  with pytest.raises(ValueError, match="update_and_apply"):
    jax.jit(tx.update)(params, state, params)
  small = oo.offload(optax.sgd(1e-2, momentum=0.9), min_size=256, window_bytes=4 * 128 * 4)
  with pytest.raises(ValueError, match=r"smaller than one layer \(row\) of \['w'\].*at least"):
    small.init(params)  # a row: 128 fp32 of weight, gradient and momentum each (1.5 KiB)
  host_tx = oo.offload(optax.sgd(1e-2, momentum=0.9), min_size=256, update_on="host")
  with pytest.raises(NotImplementedError, match="update_on='device'"):
    jax.jit(lambda p, s: oo.update_and_apply(host_tx, p, s, p))(params, host_tx.init(params))


def test_many_unrolled_groups_warn_about_compile_time(caplog):
  # A window of about one layer's state. 100 stacked layers: 100 row slices, 98 of them in a
  # loop, no warning; 100 separate leaves: 100 unrolled groups, a warning.
  window = int(2.25 * 64 * 64 * 4)
  tx = oo.offload(optax.sgd(1e-2, momentum=0.9), window_bytes=window, min_size=256)
  with caplog.at_level("WARNING", logger="optax_offload._src.offload"):
    tx.init({"layers": jnp.zeros((100, 64, 64))})
  assert "groups unrolled" not in caplog.text
  tx = oo.offload(optax.sgd(1e-2, momentum=0.9), window_bytes=window, min_size=256)
  with caplog.at_level("WARNING", logger="optax_offload._src.offload"):
    tx.init({f"w{i:03d}": jnp.zeros((64, 64)) for i in range(100)})
  assert "100 of 100 groups unrolled" in caplog.text and "raise window_bytes" in caplog.text


def test_uncommitted_params_on_an_accelerator_warn_once(monkeypatch):
  # The CPU stands in for an accelerator: the check is which devices hold uncommitted params.
  from optax_offload._src import offload as offload_lib

  monkeypatch.setattr(offload_lib, "_is_accelerator", lambda device: True)
  monkeypatch.setattr(offload_lib, "_UNCOMMITTED_WARNED", False)
  tx = oo.offload(optax.sgd(0.1, momentum=0.9))
  committed = jax.device_put({"w": jnp.zeros((128, 64))}, jax.devices()[0])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.init(committed)
  with pytest.warns(UserWarning, match=r"compile twice.*jax.device_put\(params"):
    tx.init({"w": jnp.zeros((128, 64))})
  with warnings.catch_warnings():  # once per process
    warnings.simplefilter("error")
    tx.init({"w": jnp.zeros((128, 64))})


def test_a_rule_picked_by_path_is_probed_with_that_rule():
  # optax.multi_transform picks lamb for 'w' by its path; the split probe's own tree has other
  # paths, so its leaf gets adam's state, not lamb's: 'w' is not split in row slices (lamb's trust
  # ratio takes the whole leaf; split, it was 3% off plain optax).
  def labels(params):
    return jax.tree_util.tree_map_with_path(
      lambda path, _: "lamb" if "w" in jax.tree_util.keystr(path) else "adam", params
    )

  def make():
    return optax.multi_transform({"adam": optax.adam(1e-2), "lamb": optax.lamb(1e-2)}, labels)

  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=(64, 64)), jnp.float32) for k in ("w", "b")}
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  grads["w"] = grads["w"].at[0].multiply(1e3)
  tx = oo.offload(make(), window_bytes=2 * 64 * 64 * 4, min_size=16)
  got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  want, _ = make().update(grads, make().init(params), params)
  assert_close(got, want)


def _by_path_w(params):
  return jax.tree_util.tree_map_with_path(lambda p, _: "w" in jax.tree_util.keystr(p), params)


_WARM_UP = optax.linear_schedule(0.0, 1e-2, 10)


def _wait_3_steps():
  """Zero gradients for the first 3 steps (a transformation keeping only a count)."""

  def update(updates, state, params=None):
    del params
    scale = (state >= 3).astype(jnp.float32)
    return jax.tree.map(lambda u: u * scale.astype(u.dtype), updates), state + 1

  return optax.GradientTransformation(lambda p: jnp.zeros([], jnp.int32), update)


_PATH_RULES = {
  # (make, params as a list, the leaves split in rows): a rule without a state of its own, picked
  # by path, changes nothing on the probes' own tree (whose paths the mask does not pick): lars'
  # trust ratio on 'w' was probed without it, and 'w' split in row slices (its update up to 132x
  # plain optax's). Rules that are zero at the first step (a warm-up from 0, MultiSteps) and list
  # params (paths like the probes') hid it from a first check; weight decay picked by path is
  # elementwise, so both leaves still split.
  "lars": (lambda: optax.lars(1e-2, trust_ratio_mask=_by_path_w), False, ["b"]),
  "lars_warm_up": (lambda: optax.lars(_WARM_UP, trust_ratio_mask=_by_path_w), False, ["b"]),
  "masked_trust_ratio": (
    lambda: optax.chain(
      optax.scale_by_adam(),
      optax.masked(optax.scale_by_trust_ratio(), _by_path_w),
      optax.scale_by_learning_rate(_WARM_UP),
    ),
    False,
    ["b"],
  ),
  "multi_steps": (
    lambda: optax.MultiSteps(
      optax.lars(1e-2, trust_ratio_mask=_by_path_w), 2
    ).gradient_transformation(),
    False,
    ["b"],
  ),
  "list_params": (
    lambda: optax.lars(
      1e-2,
      trust_ratio_mask=functools.partial(
        jax.tree_util.tree_map_with_path, lambda p, _: p[-1].idx == 0
      ),
    ),
    True,
    [],  # (not [1]: where no probe on the probes' own tree splits, no leaf is probed further)
  ),
  "weight_decay": (lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_by_path_w), False, ["b", "w"]),
  # Older: an update that waits longer than the probes' first steps, where only a state moved
  # (MultiSteps' sum of the gradients) or nothing did, was taken as separable: lamb was split. The
  # probes of such a transformation now run until its update moves (up to 16 steps).
  "waiting_lamb": (
    lambda: optax.chain(_wait_3_steps(), optax.lamb(1e-2)),
    False,
    [],
  ),
  "multi_steps_4_lamb": (
    lambda: optax.MultiSteps(optax.lamb(1e-2), 4).gradient_transformation(),
    False,
    [],
  ),
  "lamb_lr_0_for_3_steps": (
    lambda: optax.lamb(
      optax.join_schedules([optax.constant_schedule(0.0), optax.constant_schedule(1e-2)], [3])
    ),
    False,
    [],
  ),
  "multi_steps_4_lars": (
    lambda: optax.MultiSteps(
      optax.lars(1e-2, trust_ratio_mask=_by_path_w), 4
    ).gradient_transformation(),
    False,
    ["b"],
  ),
  # A mask given as a pytree is probed at the params' paths; the rules were compared over the
  # probes' first 3 steps, where two rules that both wait look alike: 'w' took 'b's verdict.
  "multi_steps_4_pytree_mask": (
    lambda: optax.MultiSteps(
      optax.lars(1e-2, trust_ratio_mask={"w": True, "b": False}), 4
    ).gradient_transformation(),
    False,
    ["b"],
  ),
  "lr_0_for_3_steps_pytree_mask": (
    lambda: optax.lars(
      optax.join_schedules([optax.constant_schedule(0.0), optax.constant_schedule(1e-2)], [3]),
      trust_ratio_mask={"w": True, "b": False},
    ),
    False,
    ["b"],
  ),
  "multi_steps_4_adamw": (
    lambda: optax.MultiSteps(optax.adamw(1e-2), 4).gradient_transformation(),
    False,
    ["b", "w"],
  ),
  # Older: a mask given as a tuple fits the probes' tuple tree (params a tuple of dicts).
  "tuple_mask": (lambda: optax.lars(1e-2, trust_ratio_mask=(True, False)), "tuple", ["b"]),
}


@pytest.mark.parametrize("rule", list(_PATH_RULES))
def test_a_rule_picked_by_path_is_probed_at_the_leafs_path(rule, caplog):
  make, as_list, split = _PATH_RULES[rule]
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.normal(size=(8, 64)) + 0.5, jnp.float32) for k in ("w", "b")}
  params["w"] = params["w"].at[0].multiply(8.0)
  if as_list == "tuple":
    params = ({"w": params["w"]}, {"b": params["b"][:, :32]})  # (b's probe first: [0])
  elif as_list:
    params = [params["w"], params["b"]]
  tx = oo.offload(make(), window_bytes=2 * 64 * 4 * 2, min_size=16)
  with caplog.at_level("INFO"):
    state = tx.init(params)
  names = ["0", "1"] if as_list is True else ["w", "b"]
  got = sorted(n for n in names if f"[{n!r}][" in caplog.text or f"[{n}][" in caplog.text)
  assert got == sorted(split), caplog.text
  ref, ref_state = params, make().init(params)
  mine = params
  step = jax.jit(tx.update)
  for _ in range(8):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    want, ref_state = make().update(grads, ref_state, ref)
    have, state = step(grads, state, mine)
    ref, mine = optax.apply_updates(ref, want), optax.apply_updates(mine, have)
  assert_close(ref, mine)


@pytest.mark.parametrize("given", ["function", "pytree"])
def test_a_mask_given_as_a_pytree_splits_as_a_function_does(given, caplog):
  # The split probes run on a tuple tree of their own, which a mask (or labels) given as a pytree
  # does not fit: their probes failed (a warning at every init) and the leaves stayed whole. They
  # now run at the params' own paths, where the mask picks each leaf's rule.
  rng = np.random.default_rng(0)
  params = {"layers": jnp.asarray(rng.normal(size=(8, 64, 64)), jnp.float32), "b": jnp.zeros(64)}
  by_rank = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
  mask = by_rank if given == "function" else by_rank(params)
  window = int(2.25 * 2 * 64 * 64 * 4 * 2)  # two layers of state
  tx = oo.offload(optax.adamw(1e-2, mask=mask), window_bytes=window, min_size=256)
  with caplog.at_level("INFO"):
    tx.init(params)
  assert "['layers'][" in caplog.text, caplog.text  # in row slices
  assert "WARNING" not in caplog.text, caplog.text
  ref_params, _ = train(optax.adamw(1e-2, mask=mask), params, 3)
  got_params, _ = train(tx, params, 3, apply=True)
  assert_close(ref_params, got_params)


def test_an_integer_leaf_does_not_stop_the_others_splitting(caplog):
  # The leaves' rules are compared over a few steps of a scan; adam's state of an int leaf changes
  # dtype after the first step, which the scan refused: nothing was split (a warning).
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 64, 64)), jnp.float32), "n": jnp.zeros(8, int)}
  by_rank = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731  (user code)
  tx = oo.offload(optax.adamw(1e-2, mask=by_rank), window_bytes=2 * 64 * 64 * 12, min_size=256)
  with caplog.at_level("INFO"):
    tx.init(params)
  assert "['w'][" in caplog.text and "WARNING" not in caplog.text, caplog.text


def test_bfloat16_params_are_split_only_where_the_update_allows():
  # The split probe allows 2 eps of the params only to updates computed wider than them (master
  # weights): lamb's trust ratio over the leaf moves a bfloat16 update by less than that, so its
  # rows passed before as split; adamw's update is elementwise. Columns (applied in place by
  # update_and_apply) were compared as steps applied to the params, less a rounding to the params'
  # dtype, which hid lamb's columns on bfloat16 params (below).
  from optax_offload._src import separable
  from optax_offload._src import tree_plan

  avals = [jax.ShapeDtypeStruct((512, 256), jnp.bfloat16) for _ in range(2)]

  def splits(tx, master=None):  # (rows, columns) of each leaf
    inner = tree_plan.offloaded_inner(tx, master)
    tree = tree_plan.derive_leaves(
      inner, jax.tree.structure(["a", "b"]), ["[0]", "[1]"], avals, [None, None], min_size=1024,
      check_separable=False,
    )  # fmt: skip
    cols = separable.splittable(inner, avals, tree.parts, tree.dims, 1024, axis=1)
    return [(leaf.rows, c) for leaf, c in zip(tree.leaves, cols)]

  assert splits(optax.lamb(1e-3)) == [(0, 0)] * 2
  assert splits(optax.lamb(1e-3), jnp.float32) == [(0, 0)] * 2
  assert splits(optax.adamw(1e-3)) == [(512, 256)] * 2
  assert splits(optax.adamw(1e-3), jnp.float32) == [(512, 256)] * 2
  # Columns were compared as steps applied to the params: at a small learning rate (a warm-up from
  # 0) lamb's bfloat16 steps round to nothing there, and its columns were split (its updates up to
  # 0.86 of the params' movement off after 2000 steps). The probe now compares the chunks' updates.
  avals[:] = [jax.ShapeDtypeStruct((256, 128), jnp.bfloat16) for _ in range(2)]
  assert splits(optax.lamb(optax.linear_schedule(0.0, 1e-3, 1000))) == [(0, 0)] * 2
  assert splits(optax.adamw(1e-6)) == [(256, 128)] * 2
  # With a float32 master copy the master moved by far less than its value's tolerance there,
  # and lamb was split in rows and columns: masters are compared by their moves now.
  assert splits(optax.lamb(optax.linear_schedule(0.0, 1e-3, 1000)), jnp.float32) == [(0, 0)] * 2
  assert splits(optax.adamw(1e-6), jnp.float32) == [(256, 128)] * 2
  avals[:] = [jax.ShapeDtypeStruct((512, 256), jnp.bfloat16) for _ in range(2)]
  # At a small learning rate the bfloat16 updates round to 0 in the probe's steps while the master
  # copy moves: still split (a probe in which nothing moves splits nothing).
  avals[:] = [jax.ShapeDtypeStruct((8192,), jnp.bfloat16) for _ in range(2)]  # (norm scales)
  assert splits(optax.adamw(1e-5), jnp.float32) == [(8192, 0)] * 2


def test_a_master_copy_is_compared_over_the_leaf_not_element_by_element():
  # Master copies are compared by their moves (a small learning rate hides nothing), over the
  # leaf: element by element, an 8-bit moment's code rounded the other way in the probe's split
  # run (5 of 327,680 elements, 2% of their moves) kept amsgrad's stacked leaves whole.
  from optax_offload._src import compress
  from optax_offload._src import tree_plan

  shapes = {"layers": {"wq": (4, 256, 256), "w1": (4, 256, 512)}, "embed": (1000, 256)}
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    shapes, is_leaf=lambda x: isinstance(x, tuple)
  )
  avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for _, s in flat]
  inner = tree_plan.offloaded_inner(
    optax.amsgrad(1e-3), jnp.float32, compress.parse_moment_dtype("int8")
  )
  tree = tree_plan.derive_leaves(
    inner, treedef, [jax.tree_util.keystr(p) for p, _ in flat], avals, [None] * 3, min_size=4096,
    check_separable=False,
  )  # fmt: skip
  assert [leaf.rows for leaf in tree.leaves] == [1000, 4, 4]


def test_master_copies_compared_over_the_leaf_keep_their_non_finite_values_apart():
  # (a norm over the leaf would hide a NaN or an infinity in one master copy only)
  from optax_offload._src import master
  from optax_offload._src import separable

  def alike(a, b):
    state = [master.MasterState([np.asarray(x, np.float32)], None) for x in (a, b)]
    try:
      separable._compare_master(*state, jax.tree.structure([0]), np.ones(4), 0)
      return True
    except separable._NotSeparable:
      return False

  inf, nan = np.inf, np.nan
  assert alike([1.5, nan, 1, 1], [1.5, nan, 1, 1]) and alike([1.5, inf, 1, 1], [1.5, inf, 1, 1])
  assert not alike([1.5, 1, 1, 1], [1.5, nan, 1, 1])
  assert not alike([1.5, inf, 1, 1], [1.5, -inf, 1, 1])
  assert not alike([1.5, 1.5, 1, 1], [1.5, 1.75, 1, 1])


def test_a_split_probes_values_do_not_depend_on_the_keys_probed_beside_it():
  from optax_offload._src import separable

  inner = optax.adamw(1e-3)
  a = (np.dtype("float32"), (64,), (2, 2), 0, jax.tree.structure((0.0, 0.0)))
  b = (np.dtype("bfloat16"), (32, 16), (2, 2), 0, jax.tree.structure((0.0, 0.0)))
  probes = [separable._Probe.make(inner, keys, 0) for keys in ([a], [b, a])]
  np.testing.assert_array_equal(probes[0].params[0], probes[1].params[1])
  for g0, g1 in zip(probes[0].grads, probes[1].grads):
    np.testing.assert_array_equal(g0[0], g1[1])


def test_closure_key_of_user_code_dressed_as_the_librarys():
  from optax_offload._src.closure_key import closure_key

  base = optax.sgd(1e-2)

  @functools.wraps(base.update)  # __module__ says optax; its globals are this module's
  def update(u, s, p=None):
    return base.update(u, s, p)

  assert update.__module__.startswith("optax")
  assert closure_key(optax.GradientTransformation(base.init, update))[0] is None

  # optax's own objects around a schedule (inject_hyperparams' WrappedSchedule) get one.
  def make():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-3, 0, 9))

  assert closure_key(make())[0] == closure_key(make())[0] is not None


def test_a_new_trace_reads_the_inner_optimizers_python_values_again(params):
  # A schedule reading a Python value (a sweep's learning rate): a new jax.jit of the step, or an
  # eager update, sees its current value as plain optax does. The inner update's jitted call was
  # kept for the process: the second learning rate was never read, and a new offload's
  # separability check compared a fresh trace with the stale one ("not separable", helper revP).
  lr = {"v": 1e-2}
  base = optax.sgd(lambda count: lr["v"])
  for value in (1e-2, 1.0):
    lr["v"] = value
    for update_on in ("device", "host"):
      tx = oo.offload(base, update_on=update_on)
      state = tx.init(params)  # (raised 'not separable' at the second value)
      for step in (jax.jit(tx.update), tx.update):
        got = step(params, state, params)[0]
        want = base.update(params, base.init(params), params)[0]
        assert bits_equal(got, want), (value, update_on)


def test_a_mask_chosen_by_shape_keeps_its_leaf_whole(caplog):
  # The split probes' miniatures do not have the leaf's shape: a mask by shape gave row slices of
  # 'w' no trust ratio, and the update was 539 times off (helper revP). The leaf is now updated
  # whole, with a warning; a mask by path is still cut.
  def inner(by_shape):
    mask = (
      (lambda p: jax.tree.map(lambda x: x.shape == (128, 64), p))
      if by_shape
      else {"w": True, "b": False}
    )
    trust = optax.masked(optax.scale_by_trust_ratio(), mask)
    return optax.chain(trust, optax.sgd(0.1, momentum=0.9))

  rows = jnp.where(jnp.arange(128)[:, None] < 64, 8.0, 1.0)
  params = {"w": jax.random.normal(jax.random.key(0), (128, 64)) * rows, "b": jnp.ones(64)}
  grads = jax.tree.map(jnp.sin, params)
  want = inner(True).update(grads, inner(True).init(params), params)[0]
  for by_shape in (True, False):
    tx = oo.offload(inner(by_shape), min_size=16, window_bytes="8KiB")
    with caplog.at_level("WARNING", logger="optax_offload"):
      caplog.clear()
      got = jax.jit(tx.update)(grads, tx.init(params), params)[0]
    assert_close(want, got, rtol=1e-6)
    warned = "changes when they are cut in row slices" in caplog.text
    assert warned == by_shape, caplog.text
