"""value_and_update: the layer stack updated inside the backward pass, against plain optax.

The reference is plain optax on the device (``lax.scan`` over ``jax.checkpoint(body)``,
``optax.MultiSteps`` for accumulation, ``optax.clip_by_global_norm`` in a chain), jitted; the fused
step must give the same bits for the optimizers whose arithmetic does not depend on the grouping
(numerics rule in DESIGN.md), and be within `conftest.RTOL` for the Adam family.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from flax import traverse_util
from jax import lax

import optax_offload as oo
from benchmarks import llama
from benchmarks.stream_layers import streamed_loss_fn
from optax_offload._src import compress
from optax_offload._src import fused_scan
from optax_offload._src import inspection
from optax_offload._src import master as master_lib
from optax_offload._src import value_and_update as vau_lib

ON_DEVICE = llama.DEVICE
DEVICE_SPACE, HOST_SPACE = jax.memory.Space.Device, jax.memory.Space.Host


def decoder(layers: int, dtype):
  cfg = llama.Config(d=64, layers=layers, ffn=128, heads=4, vocab=256)
  params = jax.device_put(llama.init_params(cfg, jax.random.key(0), dtype), ON_DEVICE)
  return cfg, params


def tokens(step: int, micro: int, k: int):
  t = jax.random.randint(jax.random.key(100 * step + micro), (2, 17), 0, 256)
  return t


def assert_bits_equal(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


OPTIMIZERS = {
  "sgd_momentum": (lambda: optax.sgd(1e-2, momentum=0.9), True),
  "lion": (lambda: optax.lion(1e-3), True),
  "adamw": (lambda: optax.adamw(1e-2, weight_decay=1e-2), False),
}


def reference(cfg, params, inner, *, master, k, clip, steps):
  """Plain optax: the stack on the device, MultiSteps for k micro-batches, clip in a chain."""
  tx = inner
  if master is not None:
    tx = master_lib.with_master_weights(optax.with_extra_args_support(tx), master)
  if clip is not None:
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  if k > 1:
    tx = optax.MultiSteps(tx, k)
  state = tx.init(params)

  @jax.jit
  def micro_step(params, state, t):
    loss, grads = jax.value_and_grad(lambda p: llama.loss_fn(cfg, p, t))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for s in range(steps):
    for m in range(k):
      params, state, _ = micro_step(params, state, tokens(s, m, k))
  return params


ON_DEVICE_WHEN_MIXED = ("wq", "wo")
"""The stack's leaves a "mixed" placement keeps on the device (a card with room for them)."""


def place_stack(params, on_host):
  """The stack in pinned host memory (True), on the device (False), or "mixed": the leaves
  `ON_DEVICE_WHEN_MIXED` on the device, the others in host memory."""
  if not on_host:
    return params
  layers = {
    name: x if on_host == "mixed" and name in ON_DEVICE_WHEN_MIXED else oo.to_pinned_host(x)
    for name, x in params["layers"].items()
  }
  return dict(params, layers=layers)


def stack_memory(on_host, name):
  if on_host == "mixed":
    return "device" if name in ON_DEVICE_WHEN_MIXED else "pinned_host"
  return "pinned_host" if on_host else "device"


def fused(cfg, params, inner, *, master, k, clip, steps, on_host, window=None):
  tx = oo.offload(inner, master_dtype=master, min_size=256, window_bytes=window)
  if clip is not None:
    tx = optax.chain(optax.clip_by_global_norm(clip), tx)
  params = place_stack(params, on_host)
  state = tx.init(params)
  step = jax.jit(
    oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx, accumulate=k),
    donate_argnums=(0, 1),
  )
  for s in range(steps):
    batch = tokens(s, 0, k) if k == 1 else jnp.stack([tokens(s, m, k) for m in range(k)])
    loss, params, state = step(params, state, batch)
  return params, state


def _placed(on_host) -> str:
  return on_host if isinstance(on_host, str) else "host" if on_host else "device"


CASES = [
  # (optimizer, dtype, layers, accumulate, clip, stack on host): each feature in at least one
  # bit-exact case (master weights, odd layer count, accumulation, a stack on the device, a clip
  # that does not trigger) and the Adam family and a triggering clip within RTOL.
  ("sgd_momentum", "bf16_master", 5, 1, None, True),
  ("lion", "fp32", 4, 3, None, "mixed"),  # some leaves of the stack on the device
  ("sgd_momentum", "fp32", 3, 2, None, False),
  ("sgd_momentum", "fp32", 5, 3, 1e6, True),
  ("adamw", "bf16_master", 5, 3, 0.05, True),
]


@pytest.mark.parametrize(
  "name, dtype, layers, k, clip, on_host",
  CASES,
  ids=[f"{c[0]}-{c[1]}-L{c[2]}-k{c[3]}-clip{c[4]}-{_placed(c[5])}" for c in CASES],
)
def test_the_fused_step_equals_plain_optax(name, dtype, layers, k, clip, on_host):
  make, exact = OPTIMIZERS[name]
  cfg, params = decoder(layers, jnp.float32 if dtype == "fp32" else jnp.bfloat16)
  master = None if dtype == "fp32" else jnp.float32
  steps = 2
  want = reference(
    cfg, jax.tree.map(jnp.copy, params), make(), master=master, k=k, clip=clip, steps=steps
  )
  got, state = fused(
    cfg,
    jax.tree.map(jnp.copy, params),
    make(),
    master=master,
    k=k,
    clip=clip,
    steps=steps,
    on_host=on_host,
  )
  if exact and clip is None or exact and clip == 1e6:
    assert_bits_equal(got, want)
  else:
    # A clip that triggers scales by a norm summed layer by layer (optax sums whole leaves: a
    # different order of float additions), and Adam's bias correction fuses per group.
    assert_close(want, got)
  for name, x in got["layers"].items():
    assert x.sharding.memory_kind == stack_memory(on_host, name), name
  inner = oo.to_inner(state if clip is None else state[1])
  offloaded = [x for x in jax.tree.leaves(inner) if x.size >= 256]
  assert offloaded and all(x.sharding.memory_kind == "pinned_host" for x in offloaded)


def test_several_groups_per_layer_give_the_same_bits():
  # A small window streams each pair of layers in several groups (one per leaf here).
  make, _ = OPTIMIZERS["sgd_momentum"]
  cfg, params = decoder(4, jnp.float32)
  want = reference(
    cfg, jax.tree.map(jnp.copy, params), make(), master=None, k=1, clip=None, steps=2
  )
  got, _ = fused(
    cfg,
    jax.tree.map(jnp.copy, params),
    make(),
    master=None,
    k=1,
    clip=None,
    steps=2,
    on_host=True,
    window=256 * 1024,
  )
  assert_bits_equal(got, want)


@pytest.mark.parametrize("given", ["by_rank", "by_path", "pytree", "prefix", "path_aware_map"])
def test_a_mask_of_the_stack_is_picked_by_shape_or_refused(given):
  # value_and_update updates a stack's leaves as a tuple of their own, where a mask picked by path
  # (the usual "no weight decay on norms") or given as a pytree (in full or as a prefix) is not the
  # params': by path, the stack's norms were decayed (silently, before); as a pytree, the step
  # failed in the backward pass. Both are refused, saying what to do; a mask picked by shape runs
  # as plain optax.
  # (bf16 params with a float32 master copy, at a small learning rate: the updates of either rule
  # round to the same bf16 steps, the master copies differ.)
  cfg, params = decoder(3, jnp.bfloat16)
  by_rank = lambda p: jax.tree.map(lambda x: x.ndim > 2, p)  # noqa: E731  (stacked weights)
  by_path = functools.partial(  # noqa: E731
    jax.tree_util.tree_map_with_path, lambda k, _: "norm" not in jax.tree_util.keystr(k)
  )
  prefix = {k: k == "layers" for k in params}  # (one entry over the whole stack)
  # (flax's way, a function of the params' dicts)
  path_aware = functools.partial(traverse_util.path_aware_map, lambda k, _: "norm" not in k[-1])
  mask = {"by_rank": by_rank, "by_path": by_path, "pytree": by_rank(params), "prefix": prefix,
          "path_aware_map": path_aware}[given]  # fmt: skip
  tx = optax.adamw(1e-3, weight_decay=0.1, mask=mask)
  run = functools.partial(fused, cfg, jax.tree.map(jnp.copy, params), tx, master=jnp.float32,
                          k=1, clip=None, steps=2, on_host=True)  # fmt: skip
  if given == "by_rank":
    want = reference(cfg, jax.tree.map(jnp.copy, params), tx, master=jnp.float32, k=1,
                     clip=None, steps=2)  # fmt: skip
    assert_close(run()[0], want)
    return
  match = "picked by its path" if given == "by_path" else "cannot update a layer stack's leaves"
  with pytest.raises(ValueError, match=match + ".*give the rule by the leaves' shapes"):
    run()


def loss_twice(cfg, p, t):
  x = p["embed"][t[:, :-1]]
  body = lambda x, w: (llama._layer(cfg, x, w), None)  # noqa: E731
  x, _ = oo.offloaded_scan(body, x, p["layers"])
  x, _ = oo.offloaded_scan(body, x, p["layers"])
  return jnp.mean(x.astype(jnp.float32))


def test_bad_input_is_refused_with_the_fix(tmp_path):
  cfg, params = decoder(2, jnp.float32)
  params = dict(params, layers=oo.to_pinned_host(params["layers"]))
  loss = functools.partial(streamed_loss_fn, cfg)
  t = tokens(0, 0, 1)

  multi = optax.MultiSteps(oo.offload(optax.adam(1e-3), min_size=256), 2)
  with pytest.raises(TypeError, match="accumulate=k"):
    oo.value_and_update(loss, multi)

  tx = oo.offload(optax.lamb(1e-3), min_size=256)
  with pytest.raises(ValueError, match="layer by layer"):
    jax.jit(oo.value_and_update(loss, tx))(params, tx.init(params), t)
  # A trust ratio masked to the stack by path: not picked on the tuple the stack is updated as.
  by_path = functools.partial(
    jax.tree_util.tree_map_with_path, lambda p, _: "layers" in jax.tree_util.keystr(p)
  )
  tx = oo.offload(optax.lars(1e-3, trust_ratio_mask=by_path), min_size=256)
  with pytest.raises(ValueError, match="picked by its path"):
    jax.jit(oo.value_and_update(loss, tx))(params, tx.init(params), t)

  tx = oo.offload(optax.adam(1e-3), min_size=256)
  with pytest.raises(ValueError, match="twice"):
    jax.jit(oo.value_and_update(functools.partial(loss_twice, cfg), tx))(params, tx.init(params), t)

  with pytest.raises(ValueError, match="leading micro-batch axis of length 3"):
    jax.jit(oo.value_and_update(loss, tx, accumulate=3))(params, tx.init(params), t)
  with pytest.raises(ValueError, match="accumulator_dtype must be a floating dtype"):
    oo.value_and_update(loss, tx, accumulate=2, accumulator_dtype="int8")

  tx = oo.offload(optax.adam(1e-3), min_size=256, update_on="host")
  with pytest.raises(NotImplementedError, match="update_on='host'"):
    jax.jit(oo.value_and_update(loss, tx))(params, tx.init(params), t)

  # Integer state rides through the backward bit-cast to a float of its width: booleans cannot.
  tx = oo.offload(optax.chain(optax.sgd(1e-2), _flags()), min_size=256)
  with pytest.raises(NotImplementedError, match="holds a bool array.*not booleans"):
    jax.jit(oo.value_and_update(loss, tx))(params, tx.init(params), t)
  # With a clip the stacks are updated after the backward pass: their state needs no carrier.
  clipped = optax.chain(optax.clip_by_global_norm(1.0), tx)
  jax.jit(oo.value_and_update(loss, clipped))(params, clipped.init(params), t)


def _flags() -> optax.GradientTransformation:
  """A transformation with boolean per-parameter state: which entries ever had a gradient."""

  def init(params):
    return {"seen": jax.tree.map(lambda p: jnp.zeros(p.shape, bool), params)}

  def update(updates, state, params=None):
    del params
    return updates, {"seen": jax.tree.map(lambda s, g: s | (g != 0), state["seen"], updates)}

  return optax.GradientTransformation(init, update)


def test_a_loss_without_offloaded_scan_updates_like_update_and_apply():
  # No stack reaches offloaded_scan: every leaf is updated after the backward pass.
  params = {"w": jnp.ones((64, 64)) * 0.1, "b": jnp.zeros(64)}
  x = jnp.ones((4, 64))

  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

  tx = oo.offload(optax.sgd(0.1, momentum=0.9), window_bytes="8KiB")
  state = tx.init(params)
  _, got, _ = jax.jit(oo.value_and_update(loss, tx))(params, state, x)

  @jax.jit
  def plain(p, s, x):
    g = jax.grad(loss)(p, x)
    return oo.update_and_apply(tx, g, s, p)

  want, _ = plain(params, tx.init(params), x)
  assert_bits_equal(got, want)


def test_the_loss_is_the_mean_over_micro_batches():
  cfg, params = decoder(2, jnp.float32)
  tx = oo.offload(optax.sgd(0.0), min_size=256)
  batch = jnp.stack([tokens(0, m, 3) for m in range(3)])
  loss, _, _ = jax.jit(
    oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx, accumulate=3)
  )(dict(params, layers=oo.to_pinned_host(params["layers"])), tx.init(params), batch)
  want = np.mean([float(llama.loss_fn(cfg, params, batch[m])) for m in range(3)])
  np.testing.assert_allclose(float(loss), want, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# 8-bit moments (moment_dtype="int8"): the codes ride through the backward pass bit-cast to floats.


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])  # the signed and the unsigned map's codes
def test_integer_state_comes_back_from_the_backward_bit_for_bit(dtype):
  # Every 8-bit pattern (NaNs and -0 as float8_e4m3fn among them), written as new state by an
  # update inside the backward pass of a stack in host memory, returns unchanged as the state's
  # "cotangent".
  values = np.arange(256).astype(dtype).reshape(4, 64)
  codes = oo.to_pinned_host(jnp.asarray(values))
  stack = oo.to_pinned_host(jnp.full((4, 8, 8), 0.1))
  int8 = (jnp.zeros((), dtype),)

  def update(stack, parts, start, w, g, shared):
    del g, shared
    (codes,) = vau_lib._from_carrier(parts, int8)
    rows = jax.device_put(lax.dynamic_slice_in_dim(codes, start, w[0].shape[0]), DEVICE_SPACE)
    new = jax.device_put(jnp.bitwise_xor(rows, jnp.asarray(0x55, dtype)), HOST_SPACE)
    return stack, vau_lib._to_carrier((lax.dynamic_update_slice_in_dim(codes, new, start, 0),))

  class Fusion:
    def __init__(self, parts):
      self.parts = parts

    def claim(self, _):
      io = {"n": jnp.int32(0), "shared": {}, "parts": self.parts}
      return fused_scan.Consumer("update", update=update), io

  @jax.jit
  def run(stack, codes, x):
    def f(stack, parts):
      with fused_scan.fusing(Fusion(parts)):
        y, _ = oo.offloaded_scan(lambda x, w: (jnp.tanh(x @ w), None), x, stack)
      return jnp.sum(y)

    _, (_, new) = jax.value_and_grad(f, argnums=(0, 1))(stack, vau_lib._to_carrier((codes,)))
    return vau_lib._from_carrier(new, int8)[0]

  got = np.asarray(run(stack, codes, jnp.ones((2, 8))))
  want = np.bitwise_xor(values, dtype(0x55))
  assert got.dtype == dtype and len(set(got.ravel().tolist())) == 256
  np.testing.assert_array_equal(got, want)


INT8_CASES = [
  # (optimizer, dtype, layers, accumulate, clip, stack on host, NVMe): the stack in host memory
  # and on the device, accumulation, a clip (the stack then updated after the backward pass), the
  # state in the NVMe tier (the per-piece callbacks). Bit for bit where the grouping does not
  # change the arithmetic (DESIGN.md's numerics rule): a clip that does not trigger (a triggering
  # one scales by a norm summed layer by layer), sgd's momentum (lion's mu differs by ulps in the
  # leaves outside the stack with the stack on the device and accumulate=2, with fp32 moments too:
  # measured; its params, through a sign, agree).
  ("sgd_momentum", "bf16_master", 3, 1, None, True, False),
  ("sgd_momentum", "fp32", 4, 2, None, False, False),
  ("sgd_momentum", "fp32", 3, 2, 1e6, True, False),
  ("sgd_momentum", "bf16_master", 3, 2, None, "mixed", True),  # wq, wo on the device
]


@pytest.mark.parametrize(
  "name, dtype, layers, k, clip, on_host, nvme",
  INT8_CASES,
  ids=[
    f"{c[0]}-{c[1]}-L{c[2]}-k{c[3]}-clip{c[4]}-{_placed(c[5])}" + ("-nvme" if c[6] else "")
    for c in INT8_CASES
  ],
)
def test_int8_moments_equal_value_and_grad_then_update_and_apply(
  name, dtype, layers, k, clip, on_host, nvme, tmp_path
):
  for got, want in int8_steps(name, dtype, layers, k, clip, on_host, nvme, tmp_path, steps=2):
    assert_bits_equal(got, want)  # params, codes and scales after every step


def test_int8_adam_moments_are_bit_exact_for_a_step_then_within_a_code():
  # Adam's unsigned map (nu: uint8 codes) through the backward pass. Its bias correction fuses
  # per group (DESIGN.md's numerics rule): from the second step on the fp32 master and moments
  # differ by ulps, and where an ulp crosses a rounding threshold a code by one.
  runs = int8_steps("adamw", "bf16_master", 3, 1, None, True, False, None, steps=3)
  got, want = next(runs)
  assert_bits_equal(got, want)
  for got, want in runs:
    assert_close(got[0], want[0])
    flips = 0
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
      if a.dtype in (np.int8, np.uint8):
        diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
        assert diff.max() <= 1
        flips += int(np.count_nonzero(diff))
    assert flips <= 5  # measured: about 1 code in 12,288 moves, from the second step on


def head_in_fp32(make):
  """`make()` with 8-bit moments but for the head's, kept fp32 (docs/tiers.md, "Choosing per
  leaf"); value_and_update passes the stack's leaves as a tuple, whose paths have no keys."""

  def labels(params):  # (as docs/tiers.md's)
    def label(path, _):
      return "fp32" if any(getattr(k, "key", None) == "head" for k in path) else "int8"

    return jax.tree_util.tree_map_with_path(label, params)

  return optax.multi_transform(
    {"int8": oo.with_moment_dtype(make(), "int8"), "fp32": make()}, labels
  )


def test_int8_moments_but_the_heads_equal_value_and_grad_then_update_and_apply(tmp_path):
  steps = int8_steps(
    "sgd_momentum", "bf16_master", 3, 2, None, True, False, tmp_path, steps=2, head_fp32=True
  )
  for got, want in steps:
    assert_bits_equal(got, want)
    trace = got[1].inner.inner_states
    assert trace["fp32"].inner_state[0].trace["head"].dtype == np.float32
    assert compress.is_quantized(trace["int8"].inner_state[0].trace["layers"]["w_gate"])


def int8_steps(name, dtype, layers, k, clip, on_host, nvme, tmp_path, *, steps, head_fp32=False):
  """Per optimizer step, ((params, raw state), the same from `jax.value_and_grad` then
  `oo.update_and_apply`) as numpy arrays; the raw state holds the codes and scales themselves.
  With `head_fp32`, the head's moments are kept fp32 (`head_in_fp32`)."""
  make, _ = OPTIMIZERS[name]
  cfg, params = decoder(layers, jnp.float32 if dtype == "fp32" else jnp.bfloat16)
  params = place_stack(params, on_host)

  def make_tx(nvme_dir=None):
    kwargs = {} if nvme_dir is None else {"nvme_dir": str(nvme_dir), "host_limit": 0}
    master = None if dtype == "fp32" else jnp.float32
    if head_fp32:
      inner = head_in_fp32(make)
    else:
      inner, kwargs["moment_dtype"] = make(), "int8"
    tx = oo.offload(inner, master_dtype=master, min_size=256, **kwargs)
    return tx if clip is None else optax.chain(optax.clip_by_global_norm(clip), tx)

  def loss(p, t):
    return streamed_loss_fn(cfg, p, t)

  def batch(s):
    return tokens(s, 0, k) if k == 1 else jnp.stack([tokens(s, m, k) for m in range(k)])

  tx = make_tx(tmp_path / "nvme" if nvme else None)
  state = tx.init(params)
  step = jax.jit(oo.value_and_update(loss, tx, accumulate=k), donate_argnums=(0, 1))
  plain_tx = make_tx() if k == 1 else optax.MultiSteps(make_tx(), k)
  plain_state = oo.init(plain_tx, params)

  @jax.jit
  def plain(p, st, t):
    # (offloaded_scan's plain backward needs the stack in host memory: lax.scan's on the device.)
    _, g = jax.value_and_grad(loss if on_host else functools.partial(llama.loss_fn, cfg))(p, t)
    return oo.update_and_apply(plain_tx, g, st, p)

  def raw(st):
    st = st.inner_opt_state if isinstance(st, optax.MultiStepsState) else st
    st = st if clip is None else st[1]
    return inspection._materialized(st)  # NVMe arrays read from the store

  got, want = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, params)
  try:
    for s in range(steps):
      _, got, state = step(got, state, batch(s))
      for m in range(k):
        want, plain_state = plain(want, plain_state, batch(s) if k == 1 else batch(s)[m])
      if nvme:
        assert oo.footprint(raw_state(state, clip))["nvme"] > 0
      got_raw = raw(state)
      leaves = jax.tree.leaves(got_raw, is_leaf=compress.is_quantized)
      assert any(compress.is_quantized(x) for x in leaves)
      yield jax.tree.map(np.asarray, ((got, got_raw), (want, raw(plain_state))))
  finally:
    oo.close_nvme(raw_state(state, clip))


def raw_state(state, clip):
  return state if clip is None else state[1]


def test_int8_state_in_host_memory_compiles_to_bitcasts_on_the_gpu():
  # Compiled for an H100, the 8-bit codes' carriers through the backward pass are free bitcasts:
  # no host computation (XLA would otherwise turn arithmetic on pinned-host operands into some),
  # and the state updated in place: no host temporaries (measured: 0 B; 64 KiB with fp32 moments).
  from helpers import gpu_compile_or_skip

  gpu_compile_or_skip()
  cfg, params = decoder(4, jnp.float32)
  params = dict(params, layers=oo.to_pinned_host(params["layers"]))
  tx = oo.offload(optax.adamw(1e-3), min_size=256, moment_dtype="int8")
  step = oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx)
  program = oo.compile_for_gpu(
    step,
    params,
    oo.abstract_state(tx, params),
    tokens(0, 0, 1),
    donate_argnums=(0, 1),
    target="h100_80gb",
  )
  assert not program.schedule.host_compute
  assert program.memory.host_temp == 0


def test_stack_leaves_kept_on_the_device_never_cross_the_link_on_the_gpu():
  # Compiled for an H100 with the attention's four leaves (bf16 [4, 64, 64]) on the device and the
  # MLP's in pinned host memory, two micro-batches a step: no host<->device transfer carries a
  # bf16 row of 64 x 64 (their weights, gradients and accumulators stay on the card: the master
  # copy and momentum are fp32), while the MLP's bf16 rows of 64 x 128 still stream.
  import re

  from helpers import gpu_compile_or_skip

  gpu_compile_or_skip()
  cfg, params = decoder(4, jnp.bfloat16)
  attention = ("wq", "wk", "wv", "wo")
  layers = {
    name: x if name in attention else oo.to_pinned_host(x) for name, x in params["layers"].items()
  }
  params = dict(params, layers=layers)
  tx = oo.offload(optax.sgd(1e-2, momentum=0.9), master_dtype=jnp.float32, min_size=256)
  step = oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx, accumulate=2)
  batch = jnp.stack([tokens(0, m, 2) for m in range(2)])
  program = oo.compile_for_gpu(
    step,
    params,
    oo.abstract_state(tx, params),
    batch,
    donate_argnums=(0, 1),
    target="h100_80gb",
    xla_flags=oo.STREAM_XLA_OPTIONS,
  )
  schedule = program.schedule
  moved = []
  for comp, instrs in schedule.computations.items():
    by_name = {i.name: i for i in instrs}
    for copy in (c for c in schedule.copies if c.computation == comp):
      instr = by_name[copy.name]
      moved.append(
        " ".join([instr.shape, *(by_name[o].shape for o in instr.operands if o in by_name)])
      )
  moved = " ".join(moved)
  assert re.search(r"bf16\[(\d+,)?64,128\]", moved)  # the MLP's rows stream
  assert not re.search(r"bf16\[(\d+,)?64,64\]", moved)  # the attention's never cross
