"""Layer stacks on NVMe (`oo.write_nvme_stack`): frozen weights `oo.offloaded_scan` reads from the
drive a layer at a time, from real store files (zarr3, checksummed) in a temporary directory.

The numerics are compared bit for bit with the plain ``lax.scan`` over ``jax.checkpoint(body)``
with the weights in device memory; the GPU program's device bytes and callbacks are read from the
program XLA:GPU builds (compiled without a GPU).
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpu_compile_or_skip
from jax import lax

import optax_offload as oo
from optax_offload._src import nvme_stack

MiB = 1 << 20
ON_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def layers_of(n: int, dtype=np.float32, d: int = 8, seed: int = 0):
  rng = np.random.default_rng(seed)
  base = {
    "w": (rng.normal(size=(n, d, d)) * 0.3).astype(dtype),
    "b": rng.normal(size=(n, d)).astype(dtype),
  }
  lora = {
    "a": (rng.normal(size=(n, d, 2)) * 0.1).astype(dtype),
    "c": (rng.normal(size=(n, 2, d)) * 0.1).astype(dtype),
  }
  return base, lora


def body(x, w):
  h = x @ w["base"]["w"] + w["base"]["b"] + (x @ w["lora"]["a"]) @ w["lora"]["c"]
  return jnp.tanh(h), jnp.sum(h)


def scanned(scan, lora, base, x, scale):
  y, ys = scan(body, x * scale, {"base": base, "lora": lora})
  return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(ys.astype(jnp.float32))


def train_plain(tx, loss, params, base, xs):
  """Plain optax, one step per batch of `xs`: ``loss(params, base, x, scan)`` with the base in
  device memory and ``scan`` the plain ``lax.scan(jax.checkpoint(body), ...)``."""
  plain_scan = lambda f, c, s: lax.scan(jax.checkpoint(f), c, s)  # noqa: E731
  dev_base = jax.tree.map(jnp.asarray, base)

  @jax.jit
  def step(p, s, x):
    g = jax.grad(loss)(p, dev_base, x, plain_scan)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = tx.init(params)
  for x in xs:
    params, state = step(params, state, x)
  return params


@pytest.fixture
def stack_dir(tmp_path):
  yield tmp_path / "base"
  # Close what a test left open (its store holds a lock on the directory).
  for key in [k for k in nvme_stack._OPEN if k.startswith(str(tmp_path))]:
    nvme_stack._OPEN.pop(key).store.close()


@pytest.mark.parametrize("n,dtype", [(1, np.float32), (4, np.float32), (5, jnp.bfloat16)])
def test_a_stack_on_nvme_matches_the_plain_scan(stack_dir, n, dtype):
  base, lora = layers_of(n, dtype)
  on_nvme = oo.write_nvme_stack(stack_dir, base)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8)), dtype)
  scale = jnp.asarray(1.5, dtype)  # closed over by nothing: an argument differentiated too
  plain = lambda body, c, s: lax.scan(jax.checkpoint(body), c, s)  # noqa: E731
  want = jax.jit(
    jax.value_and_grad(
      lambda lora, x, scale: scanned(plain, lora, jax.tree.map(jnp.asarray, base), x, scale),
      argnums=(0, 1, 2),
    )
  )(jax.tree.map(jnp.asarray, lora), x, scale)
  got = jax.jit(
    jax.value_and_grad(
      lambda lora, base, x, scale: scanned(oo.offloaded_scan, lora, base, x, scale),
      argnums=(0, 2, 3),
    )
  )(oo.to_pinned_host(jax.tree.map(jnp.asarray, lora)), on_nvme, x, scale)
  for path, a, b in zip(
    [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)],
    jax.tree.leaves(got),
    jax.tree.leaves(want),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
  assert got[1][0]["a"].sharding.memory_kind == "pinned_host"  # the adapters' gradient
  # Under jax.checkpoint (the read is a pure callback: remat may repeat it).
  remat = jax.jit(
    jax.grad(
      jax.checkpoint(lambda lora, base, x, scale: scanned(oo.offloaded_scan, lora, base, x, scale))
    )
  )(oo.to_pinned_host(jax.tree.map(jnp.asarray, lora)), on_nvme, x, scale)
  for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(got[1][0]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Forward alone (no backward after it) reads the same weights.
  y = jax.jit(lambda b, x: oo.offloaded_scan(body, x, {"base": b, "lora": lora})[0])(on_nvme, x)
  y_want = lax.scan(body, x, {"base": base, "lora": lora})[0]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_want))


def test_adapters_train_on_a_frozen_base_as_with_plain_optax(stack_dir):
  """LoRA-style adapters in pinned host memory, trained by offload(adamw) through
  value_and_update and through jax.value_and_grad + update_and_apply, on a base on NVMe; plain
  optax on the base in device memory gives the same bits."""
  n = 4
  base, lora = layers_of(n)
  on_nvme = oo.write_nvme_stack(stack_dir, base)
  xs = jnp.asarray(np.random.default_rng(2).normal(size=(3, 2, 8)), jnp.float32)

  def loss(params, base, x, scan):
    y, _ = scan(body, x, {"base": base, "lora": params["lora"]})
    return jnp.sum((y - 0.1) ** 2) + jnp.sum(params["head"] ** 2)

  params = {"lora": jax.tree.map(jnp.asarray, lora), "head": jnp.ones((8,))}
  want = train_plain(optax.adamw(1e-2), loss, params, base, xs)

  start = {
    "lora": oo.to_pinned_host(params["lora"]),
    "head": jax.device_put(params["head"], ON_DEVICE),
  }
  tx = oo.offload(optax.adamw(1e-2))
  fused = jax.jit(oo.value_and_update(lambda p, x: loss(p, on_nvme, x, oo.offloaded_scan), tx))
  p, s = start, tx.init(start)
  for x in xs:
    _, p, s = fused(p, s, x)

  @jax.jit
  def unfused(p, s, base, x):
    g = jax.grad(loss)(p, base, x, oo.offloaded_scan)
    return oo.update_and_apply(tx, g, s, p)

  q, r = start, tx.init(start)
  for x in xs:
    q, r = unfused(q, r, on_nvme, x)
  assert unfused._cache_size() == 1
  for got in (p, q):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert p["lora"]["a"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("where", ["nvme", "host"])
def test_adapters_accumulate_over_micro_batches_as_multisteps(stack_dir, where):
  """value_and_update(accumulate=2) with the base closed over (on NVMe, or in pinned host memory):
  the adapters' stack mixes frozen leaves, so it is not fused and its gradient comes back in host
  memory; its accumulator is on the device, as optax.MultiSteps' (it failed with a memory-space
  error before)."""
  base, lora = layers_of(4)
  frozen = (
    oo.write_nvme_stack(stack_dir, base)
    if where == "nvme"
    else oo.to_pinned_host(jax.tree.map(jnp.asarray, base))
  )
  xs = jnp.asarray(np.random.default_rng(3).normal(size=(2, 2, 3, 8)), jnp.float32)

  def loss(params, base, x, scan):
    y, _ = scan(body, x, {"base": base, "lora": params})
    return jnp.sum((y - 0.1) ** 2)

  plain = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)
  want = train_plain(plain, loss, jax.tree.map(jnp.asarray, lora), base, xs.reshape(-1, 3, 8))
  tx = oo.offload(optax.adamw(1e-2))
  step = jax.jit(
    oo.value_and_update(lambda p, x: loss(p, frozen, x, oo.offloaded_scan), tx, accumulate=2)
  )
  p = oo.to_pinned_host(jax.tree.map(jnp.asarray, lora))
  s = tx.init(p)
  for batch in xs:
    _, p, s = step(p, s, batch)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert step._cache_size() == 1


def test_a_stack_written_layer_by_layer_reopens_in_another_store(stack_dir):
  n = 3
  base, _ = layers_of(n)
  made = []

  base["b"] = base["b"].astype(jnp.bfloat16)  # a dtype numpy lacks, stored as uint16

  def layer(i):  # a stack larger than RAM is written as it is made or loaded
    made.append(i)
    return {"w": base["w"][i], "b": base["b"][i]}

  written = oo.write_nvme_stack(stack_dir, layer, num_layers=n)
  assert made == [0, 1, 2]
  assert written["w"].shape == (3, 8, 8) and written["b"].dtype == jnp.bfloat16
  oo.close_nvme_stack(written)
  with pytest.raises(RuntimeError, match="closed"):
    oo.read_nvme_stack(written)
  opened = oo.open_nvme_stack(stack_dir, written)  # the closed stack's leaves describe it
  store = nvme_stack._OPEN[opened["w"].directory].store
  got = oo.read_nvme_stack(opened)
  assert store.stats["fetches"] == n  # each layer read once, every leaf of it at a time
  for k in base:
    assert got[k].dtype == base[k].dtype
    np.testing.assert_array_equal(got[k], base[k])
  doc = json.loads((stack_dir / "stack.json").read_text())
  assert [leaf["path"] for leaf in doc["leaves"]] == ["['b']", "['w']"]
  # Other zarr3 readers read the files as they are: layer 2 of "w" is leaf 1 of group 2.
  import tensorstore as ts

  (leaf,) = (stack_dir / "store").glob("gen_*/leaf1_layer2")
  spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(leaf)}}
  np.testing.assert_array_equal(ts.open(spec).result().read().result(), base["w"][2])


def test_bad_directories_and_structures_are_refused_and_nothing_is_lost(stack_dir, tmp_path):
  base, _ = layers_of(2)
  oo.write_nvme_stack(stack_dir, base)
  before = {p: p.stat().st_mtime_ns for p in stack_dir.rglob("*") if p.is_file()}
  with pytest.raises(FileExistsError, match="holds a layer stack already"):
    oo.write_nvme_stack(stack_dir, base)
  after = {p: p.stat().st_mtime_ns for p in stack_dir.rglob("*") if p.is_file()}
  assert after == before
  wrong = {
    "w": jax.ShapeDtypeStruct((2, 8, 4), jnp.float32),
    "b": jax.ShapeDtypeStruct((2, 8), jnp.float32),
  }
  with pytest.raises(ValueError, match=r"another stack than `like` describes: .*\['w'\]"):
    oo.open_nvme_stack(stack_dir, wrong)
  # Python scalars as `like` (an AttributeError on their dtype before, helper review /tmp/revB).
  with pytest.raises(ValueError, match=r"another stack than `like` describes: .*\['w'\]"):
    oo.open_nvme_stack(stack_dir, {"w": 1.0, "b": 2.0})
  with pytest.raises(FileNotFoundError, match="holds no complete layer stack"):
    oo.open_nvme_stack(tmp_path / "nothing", wrong)
  with pytest.raises(ValueError, match="same leading"):
    oo.write_nvme_stack(tmp_path / "odd", {"w": np.ones((2, 3)), "b": np.ones((3, 3))})
  assert not (tmp_path / "odd" / "stack.json").exists()

  def bad_layer(i):
    return {"w": np.ones((4, 4) if i == 0 else (4, 5), np.float32)}

  with pytest.raises(ValueError, match="layer 1 has leaves"):
    oo.write_nvme_stack(tmp_path / "bad", bad_layer, num_layers=2)
  with pytest.raises(ValueError, match="layer 0 has no leaves"):
    oo.write_nvme_stack(tmp_path / "empty", lambda i: {}, num_layers=2)
  (tmp_path / "file").write_text("")
  with pytest.raises(NotADirectoryError, match="layer stack directory .* pass a directory"):
    oo.write_nvme_stack(tmp_path / "file" / "stack", base)
  with pytest.raises(ValueError, match="layer 1 has the structure"):
    oo.write_nvme_stack(tmp_path / "bad", lambda i: {"w": 1.0} if i else {"v": 1.0}, num_layers=2)
  assert not (tmp_path / "bad" / "stack.json").exists()  # an unfinished write is no stack


def test_a_stack_held_by_another_process_or_written_again_is_refused(stack_dir):
  import subprocess
  import sys

  base, _ = layers_of(2)
  old = oo.write_nvme_stack(stack_dir, base)
  child = (
    "import jax, optax_offload as oo, numpy as np\n"
    f"like = {{'b': jax.ShapeDtypeStruct((2, 8), np.float32), "
    f"'w': jax.ShapeDtypeStruct((2, 8, 8), np.float32)}}\n"
    f"oo.open_nvme_stack({str(stack_dir)!r}, like)\n"
  )
  run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
  assert run.returncode != 0
  assert "in use by another process" in run.stderr and "oo.close_nvme_stack" in run.stderr
  # Deleted while open and written again in its place: the old leaves read nothing of the new.
  import shutil

  shutil.rmtree(stack_dir)
  oo.write_nvme_stack(stack_dir, jax.tree.map(lambda a: a + 1, base))
  with pytest.raises(RuntimeError, match="written again since these leaves were made"):
    oo.read_nvme_stack(old)


def test_stack_leaves_are_refused_where_an_update_or_an_array_is_expected(stack_dir):
  base, _ = layers_of(2)
  on_nvme = oo.write_nvme_stack(stack_dir, base)
  tx = oo.offload(optax.adam(1e-3))
  params = {"base": on_nvme, "head": jnp.ones(3)}
  state = tx.init(params)  # made from the stack's weights, for oo.value_and_update to train
  grads = {"base": jax.tree.map(jnp.zeros_like, base), "head": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"\['base'\]\['w'\].* only oo.value_and_update trains"):
    oo.update_and_apply(tx, grads, state, params)
  with pytest.raises(ValueError, match=r"\['base'\]\['w'\].* only oo.value_and_update trains"):
    tx.update(grads, state, params)
  with pytest.raises(TypeError, match="only oo.offloaded_scan reads it"):
    jnp.asarray(on_nvme["w"])
  # A frozen base passed as a batch argument of an accumulating step: named, with the fix (its
  # generation scalar was said to lack the micro-batch axis, helper review /tmp/revJ).
  adapters = oo.to_pinned_host(jax.tree.map(jnp.asarray, layers_of(2)[1]))
  sgd = oo.offload(optax.sgd(0.1))
  step = oo.value_and_update(
    lambda p, x, base: jnp.sum(oo.offloaded_scan(body, x, {"base": base, "lora": p})[0]),
    sgd,
    accumulate=2,
  )
  with pytest.raises(ValueError, match="layer stack on NVMe .* pass it as a keyword argument"):
    step(adapters, sgd.init(adapters), jnp.ones((2, 3, 8)), on_nvme)


def test_a_corrupted_layer_is_named(stack_dir):
  base, lora = layers_of(3)
  on_nvme = oo.write_nvme_stack(stack_dir, base, options=oo.NvmeOptions(prefetch_depth=0))
  oo.close_nvme_stack(on_nvme)
  chunks = (stack_dir / "store").glob("gen_*/leaf1_layer2/c/**/*")  # layer 2 of "w"
  chunk = next(p for p in sorted(chunks) if p.is_file())
  data = bytearray(chunk.read_bytes())
  data[0] ^= 0xFF
  chunk.write_bytes(bytes(data))
  on_nvme = oo.open_nvme_stack(stack_dir, jax.eval_shape(lambda: base))
  run = jax.jit(lambda b, x: oo.offloaded_scan(body, x, {"base": b, "lora": lora})[0])
  with pytest.raises(Exception, match=r"layer 2 of the layer stack at .*leaf1 = \['w'\]") as e:
    jax.block_until_ready(run(on_nvme, jnp.ones((2, 8))))
  assert "checksum" in str(e.value) and "write it again from its source" in str(e.value)


def test_a_stack_on_nvme_serves_a_mesh(stack_dir):
  """On 4 devices with the carry sharded, the layer read once is replicated: the same bits as the
  plain scan on one device."""
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  base, _ = layers_of(4)
  on_nvme = oo.write_nvme_stack(stack_dir, {"w": base["w"]})
  mlp = lambda x, w: (jnp.tanh(x @ w["w"]), None)  # noqa: E731
  x = jax.device_put(jnp.ones((8, 8)), jax.sharding.NamedSharding(mesh, jax.P("x")))
  got = jax.jit(jax.grad(lambda x, b: oo.offloaded_scan(mlp, x, b)[0].sum()))(x, on_nvme)
  want = jax.grad(lambda x: lax.scan(mlp, x, {"w": base["w"]})[0].sum())(jnp.ones((8, 8)))
  assert got.sharding.spec == jax.P("x")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Written from arrays on a mesh of one of the four devices (as params of one device are placed),
  # and reopened with those leaves: the stack serves the mesh of four too (its generations are
  # left uncommitted where a committed placement could clash).
  oo.close_nvme_stack(on_nvme)
  one = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("d",)), jax.P())
  written = oo.write_nvme_stack(stack_dir.parent / "one", {"w": jax.device_put(base["w"], one)})
  for stack in (written, oo.open_nvme_stack(stack_dir, written)):
    got = jax.jit(jax.grad(lambda x, b: oo.offloaded_scan(mlp, x, b)[0].sum()))(x, stack)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_flax_nnx_stack_on_nvme(stack_dir):
  """A stacked NNX module whose state is written to NVMe, applied by `oo.offloaded_layers`: its
  values and the input's gradient are the plain scan's."""
  from flax import nnx

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return nnx.Linear(4, 4, rngs=nnx.Rngs(key))

  layers = make(jax.random.split(jax.random.key(0), 3))
  graphdef, state = nnx.split(make(jax.random.split(jax.random.key(0), 3)))  # the same, apart

  def plain(x):
    apply = lambda c, p: (nnx.merge(graphdef, p)(c), None)  # noqa: E731
    return lax.scan(jax.checkpoint(apply), x, state)[0]

  nnx.update(layers, oo.write_nvme_stack(stack_dir, nnx.state(layers)))
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 4)), jnp.float32)
  y = jax.jit(lambda m, x: oo.offloaded_layers(m, x))(layers, x)
  g = jax.jit(jax.grad(lambda x: oo.offloaded_layers(layers, x).sum()))(x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(x)))
  np.testing.assert_array_equal(np.asarray(g), np.asarray(jax.grad(lambda x: plain(x).sum())(x)))


def test_read_ahead_follows_the_passes():
  assert nvme_stack.read_ahead(1, 4, "forward", 4) == [2, 3, 0, 1]
  assert nvme_stack.read_ahead(2, 4, "train_forward", 3) == [3, 2, 1]  # 3 read twice in a row
  assert nvme_stack.read_ahead(3, 4, "train_forward", 2) == [2, 1]
  assert nvme_stack.read_ahead(1, 4, "backward", 3) == [0, 1, 2]


def test_a_step_reads_each_layer_ahead_in_program_order(stack_dir, monkeypatch):
  """The reads run in the passes' order, each naming the next ones to read ahead (a token chains
  them: XLA:CPU hoisted the backward's first read before the forward, and swapped a pair's two
  reads, without it). A step reads 2 x 8 layers, 14 from the store: the layers read twice in a
  row where a pass turns, and the next step's first, come from the last read. (Whether the
  prefetch thread has begun a read when its fetch comes depends on the threads' timing.)"""
  n = 8
  base, lora = layers_of(n)
  on_nvme = oo.write_nvme_stack(stack_dir, base)
  store = nvme_stack._OPEN[on_nvme["w"].directory].store
  order = []
  fetch = store.fetch

  def recording(group, generation, then=None):
    order.append((group, [g for g, _ in then][:2]))
    return fetch(group, generation, then)

  monkeypatch.setattr(store, "fetch", recording)
  step = jax.jit(jax.grad(lambda lora, b, x: scanned(oo.offloaded_scan, lora, b, x, 1.0)))
  lora = oo.to_pinned_host(jax.tree.map(jnp.asarray, lora))
  jax.block_until_ready(step(lora, on_nvme, jnp.ones((3, 8))))
  assert [g for g, _ in order] == [*range(8), *range(6, -1, -1)]  # 7 and 7: the last read
  order.clear()
  before = store.stats
  jax.block_until_ready(step(lora, on_nvme, jnp.ones((3, 8))))
  forward = [(i, [i + 1, i + 2] if i < 6 else [7, 6] if i == 6 else [6, 5]) for i in range(1, 8)]
  backward = [
    (i, [i - 1, i - 2] if i > 1 else [0, 1] if i == 1 else [1, 2]) for i in range(6, -1, -1)
  ]
  assert order == forward + backward
  after = store.stats
  assert after["fetches"] - before["fetches"] == 14
  assert after["prefetch_hits"] + after["misses"] == before["prefetch_hits"] + before["misses"] + 14


def test_the_gpu_program_keeps_the_base_off_the_device():
  gpu_compile_or_skip()
  # 16 layers of 16 MiB of bf16 weights (a 256 MiB base) on NVMe, adapters in pinned host memory;
  # value_and_grad for the adapters compiled for the 24 GiB H100 target.
  n, d, f, r = 16, 1024, 4096, 8
  import tempfile

  directory = tempfile.mkdtemp()
  shapes = {"w_in": (d, f), "w_out": (f, d)}
  base = oo.write_nvme_stack(
    directory, lambda i: {k: np.zeros(s, jnp.bfloat16) for k, s in shapes.items()}, num_layers=n
  )
  try:
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    lora = {"a": jax.ShapeDtypeStruct((n, d, r), jnp.bfloat16, sharding=host)}
    x = jax.ShapeDtypeStruct((512, d), jnp.bfloat16, sharding=ON_DEVICE)

    def loss(lora, base, x):
      def mlp(h, w):
        up = h @ w["base"]["w_in"]
        return h + jax.nn.gelu(up) @ w["base"]["w_out"] + (h @ w["lora"]["a"]).sum(), None

      return jnp.sum(oo.offloaded_scan(mlp, x, {"base": base, "lora": lora})[0].astype(jnp.float32))

    program = oo.compile_for_gpu(
      jax.grad(loss), lora, base, x, target="h100_24gb", xla_flags=oo.STREAM_XLA_OPTIONS
    )
  finally:
    oo.close_nvme_stack(base)
  layer_bytes, base_bytes = 2 * d * f * 2, n * 2 * d * f * 2
  # The base is no argument of the program (only its generation, 4 bytes) and never gathers: the
  # device holds the carries and a few layers' weights, less than a third of the base.
  assert program.memory.device < 24 * MiB + 6 * layer_bytes < base_bytes / 2, program.memory
  # One read callback per layer read: the forward's and the backward's loops read two layers an
  # iteration, and each pass reads one more outside its loop.
  schedule = program.schedule
  loops = schedule.loops()
  callbacks = set(schedule.callbacks)
  reads = sum(
    schedule.executions(comp)
    for comp, instrs in schedule.computations.items()
    for i in instrs
    if i.name in callbacks
  )
  assert sorted(loops.values()) == [n // 2, n // 2]
  assert reads == 2 * n + 2, reads


def test_the_benchmark_runs_at_small_sizes(tmp_path):
  """`benchmarks/nvme_stack.py cpu` in miniature, and the figures it reports. (Which step a
  read-ahead's bytes are counted in depends on the threads' timing: the exact reads per step are
  pinned by `test_a_step_reads_each_layer_ahead_in_program_order`.)"""
  from benchmarks import nvme_stack as bench

  out = bench.main(
    ["cpu", "--dir", str(tmp_path), "--stack-bytes", "256KiB", "--d", "64", "--tokens", "8"]
    + ["--repeats", "2", "--json", str(tmp_path / "out.json")]
  )
  assert out["layers"] == 4 and out["layer_bytes"] == 64 * 1024
  assert out["bytes_read_per_step"] >= out["layer_bytes"]
  assert out["store_stats"]["fetches"] >= 3 * (2 * 4 - 2)  # 3 steps at least
  assert out["ratio_nvme_to_host"] > 0 and out["disk_read_rate"] > 0
  assert json.loads((tmp_path / "out.json").read_text())["layers"] == 4
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # the stack deleted (was kept)


LAYERS_PAGE_ROW = (  # docs/layers.md, "Frozen weights on NVMe": the row this test models again
  "| 13B (base 23.63 GiB) | 1 x 2048 | 3.44 GiB | 6.97 s | 1.27 s | 7.69 s | 8.96 s | 229 |"
)


def test_the_13b_row_of_the_layers_page_is_the_compiled_program():
  """`benchmarks/nvme_stack.py gpu --model 13B --batch 1`: the 13B LoRA step compiled for the RTX
  4090 and modelled by `oo.timeline` gives the page's row (the other rows were modelled once, by
  the same command)."""
  gpu_compile_or_skip()
  from benchmarks import nvme_stack as bench

  page = (pathlib.Path(__file__).parents[1] / "docs" / "layers.md").read_text()
  assert LAYERS_PAGE_ROW in page
  out = bench.main(["gpu", "--model", "13B", "--batch", "1"])
  row = (
    f"| 13B (base {oo.format_bytes(out['base_bytes'])}) | 1 x 2048 "
    f"| {oo.format_bytes(out['device_bytes'])} | {out['modelled_disk_s']:.2f} s "
    f"| {out['modelled_compute_s']:.2f} s | {out['modelled_callback_s']:.2f} s "
    f"| {out['modelled_step_s']:.2f} s | {out['modelled_tokens_per_s']:,.0f} |"
  )
  assert row == LAYERS_PAGE_ROW
  assert out["modelled_callbacks"] == 2 * 40 + 2  # a read per layer and pass, one more each
