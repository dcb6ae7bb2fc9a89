"""A layer stack trained on NVMe: `value_and_update` writes each block's new weights to the drive.

The references are those of `test_value_and_update.py`: plain optax on the device, and the same
fused step with the stack in pinned host memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_value_and_update import ON_DEVICE
from test_value_and_update import OPTIMIZERS
from test_value_and_update import assert_bits_equal
from test_value_and_update import decoder
from test_value_and_update import fused
from test_value_and_update import reference
from test_value_and_update import tokens

import optax_offload as oo
from benchmarks.stream_layers import streamed_loss_fn
from optax_offload._src import nvme_stack
from optax_offload._src import nvme_tier


@pytest.fixture
def stack_dir(tmp_path):
  yield tmp_path / "stack"
  for key in [k for k in nvme_stack._OPEN if k.startswith(str(tmp_path))]:
    nvme_stack._OPEN.pop(key).store.close()


def batch_of(step, k):
  return tokens(step, 0, k) if k == 1 else jnp.stack([tokens(step, m, k) for m in range(k)])


def train_on_nvme(directory, cfg, params, inner, *, master, k, steps, **options):
  """The fused step with the stack written to `directory` first; returns (params with the stack
  read back, the state, the params as the step returns them, the generation written)."""
  tx = oo.offload(inner, master_dtype=master, min_size=256, **options)
  # The leaves' generations placed as the other params are (on their one-device mesh), as the step
  # returns them: it compiles once (asserted below). (On this 4-device machine write_nvme_stack
  # leaves them uncommitted: a mesh of one device of four could clash with a frozen stack's use.)
  stack = oo.write_nvme_stack(directory, params["layers"])
  params = dict(params, layers=jax.device_put(stack, ON_DEVICE))
  written = int(jax.tree.leaves(params["layers"])[0])
  state = tx.init(params)
  step = jax.jit(
    oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx, accumulate=k),
    donate_argnums=(0, 1),
  )
  for s in range(steps):
    _, params, state = step(params, state, batch_of(s, k))
  assert step._cache_size() == 1
  return dict(params, layers=oo.read_nvme_stack(params["layers"])), state, params, written


@pytest.mark.parametrize(
  "dtype, layers, k", [("bf16_master", 5, 1), ("fp32", 4, 3)], ids=["bf16-L5", "fp32-L4-k3"]
)
def test_a_stack_trained_on_nvme_equals_plain_optax(stack_dir, dtype, layers, k):
  # sgd with momentum: bit-exact whatever the grouping (numerics rule); an odd layer count with
  # master weights, an even one with accumulation over 3 micro-batches.
  make, _ = OPTIMIZERS["sgd_momentum"]
  cfg, params = decoder(layers, jnp.float32 if dtype == "fp32" else jnp.bfloat16)
  master = None if dtype == "fp32" else jnp.float32
  want = reference(
    cfg, jax.tree.map(jnp.copy, params), make(), master=master, k=k, clip=None, steps=3
  )
  got, _, out, written = train_on_nvme(
    stack_dir, cfg, jax.tree.map(jnp.copy, params), make(), master=master, k=k, steps=3
  )
  assert_bits_equal(got, want)
  # One generation per step, committed; a process that opens the directory later reads it.
  leaves = jax.tree.leaves(out["layers"], is_leaf=nvme_stack.is_leaf)
  assert all(nvme_stack.is_leaf(x) for x in leaves), leaves
  assert [int(x.generation) for x in leaves] == [written + 3] * len(leaves)
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params["layers"])
  oo.close_nvme_stack(out["layers"])
  reopened = oo.read_nvme_stack(oo.open_nvme_stack(stack_dir, like))
  assert_bits_equal(reopened, want["layers"])
  store = nvme_stack._OPEN[str(stack_dir)].store
  assert store.committed_generation == written + 3 and len(store.generations_on_disk) <= 4


def test_adam_with_its_state_on_nvme_too_equals_the_stack_in_host_memory(
  stack_dir, tmp_path, monkeypatch
):
  # Full fine-tuning with nothing of the stack in host memory between steps: its bf16 weights on
  # NVMe and its fp32 master copy and moments in the NVMe tier; two micro-batches a step. Adam's
  # bias correction fuses per group (within RTOL of plain optax), so the reference is the same
  # fused step with the stack in pinned host memory, bit for bit. A window of 512 KiB streams the
  # stack's leaves in row slices of a layer or two.
  make, _ = OPTIMIZERS["adamw"]
  cfg, params = decoder(5, jnp.bfloat16)
  window = 512 * 1024
  want, _ = fused(
    cfg,
    jax.tree.map(jnp.copy, params),
    make(),
    master=jnp.float32,
    k=2,
    clip=None,
    steps=2,
    on_host=True,
    window=window,
  )
  # init makes the state a row slice at a time: it reads each slice's layers, never a matrix whole.
  reads, fetches = [], []
  read_rows, fetch = nvme_stack.read_rows, nvme_stack._Opened.fetch

  def counted_rows(x, a, b, cache):  # init's reads, and the layers they fetch
    reads.append((x.path, a, b))
    before = len(fetches)
    out = read_rows(x, a, b, cache)
    fetches[before:] = [("init", i) for _, i in fetches[before:]]
    return out

  monkeypatch.setattr(nvme_stack, "read_rows", counted_rows)
  monkeypatch.setattr(
    nvme_stack._Opened,
    "fetch",
    lambda self, i, g, then: fetches.append(("step", i)) or fetch(self, i, g, then),
  )
  got, state, _, _ = train_on_nvme(
    stack_dir,
    cfg,
    jax.tree.map(jnp.copy, params),
    make(),
    master=jnp.float32,
    k=2,
    steps=2,
    nvme_dir=str(tmp_path / "state"),
    host_limit=0,
    window_bytes=window,
  )
  assert_bits_equal(got, want)
  # init read each layer once: for the 7 sliced leaves, the two norms' rows kept for their groups.
  assert [i for what, i in fetches if what == "init"] == [0, 1, 2, 3, 4], fetches
  sliced = {p for p, a, b in reads if a is not None}
  assert len(sliced) == 7 and all(b - a <= 2 for _, a, b in reads if a is not None), reads
  # The norms' scales (5 x 64 each) are whole in a group of their own.
  assert {p for p, a, _ in reads if a is None} == {"['attn_norm']", "['mlp_norm']"}, reads
  bytes_per_tier = oo.footprint(state)
  assert bytes_per_tier["host"] == 0 and bytes_per_tier["nvme"] > 0, bytes_per_tier
  oo.close_nvme(state)


def test_what_cannot_be_trained_on_nvme_is_refused_and_the_stack_kept(stack_dir):
  layers = {"a": np.full((2, 4, 4), 0.5, np.float32), "b": np.full((2, 4, 4), 0.25, np.float32)}
  on_nvme = oo.write_nvme_stack(stack_dir, layers)
  params = {"layers": on_nvme, "out": jnp.ones(4)}
  x = jnp.ones((3, 4))

  def body(h, w):
    return jnp.tanh(h @ w["a"] @ w["b"]), None

  def loss(p, x):
    return jnp.sum(oo.offloaded_scan(body, x, p["layers"])[0] @ p["out"])

  def step(tx, loss=loss, params=params):
    return jax.jit(oo.value_and_update(loss, tx))(params, tx.init(params), x)

  clipped = optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.sgd(0.1)))
  with pytest.raises(NotImplementedError, match="clip_by_global_norm with a layer stack trained"):
    step(clipped)

  # One directory's leaves in two stacks: a layer's leaves are written together.
  def two_scans(p, x):
    one = lambda h, w: (jnp.tanh(h @ w["a"]), None)  # noqa: E731
    two = lambda h, w: (jnp.tanh(h @ w["b"]), None)  # noqa: E731
    x = oo.offloaded_scan(one, x, {"a": p["layers"]["a"]})[0]
    return jnp.sum(oo.offloaded_scan(two, x, {"b": p["layers"]["b"]})[0] @ p["out"])

  with pytest.raises(ValueError, match="trained only in part"):
    step(oo.offload(optax.sgd(0.1)), two_scans)

  # One directory applied by two stacks (the same leaves at two places in the params): both
  # began a generation, one committed it, the other's puts failed, and the failed step's half
  # update was the committed one (helper review /tmp/revB).
  def twice(p, x):
    x = oo.offloaded_scan(body, x, p["l1"])[0]
    return jnp.sum(oo.offloaded_scan(body, x, p["l2"])[0] @ p["out"])

  with pytest.raises(ValueError, match="is applied by two oo.offloaded_scan calls"):
    step(oo.offload(optax.sgd(0.1)), twice, {"l1": on_nvme, "l2": on_nvme, "out": jnp.ones(4)})

  # A leaf on NVMe in the params that no stack of params brings to offloaded_scan.
  def mixed(p, x):
    frozen = oo.open_nvme_stack(stack_dir, layers)
    stack = {"a": p["layers"]["a"], "b": frozen["b"]}
    return jnp.sum(oo.offloaded_scan(body, x, stack)[0] @ p["out"])

  with pytest.raises(ValueError, match=r"\['layers'\]\['b'\] are layer stack leaves on NVMe that"):
    step(oo.offload(optax.sgd(0.1)), mixed)
  tx = oo.offload(optax.sgd(0.1))
  grads = {"layers": jax.tree.map(jnp.zeros_like, layers), "out": jnp.ones(4)}
  with pytest.raises(ValueError, match="only oo.value_and_update trains"):
    oo.update_and_apply(tx, grads, tx.init(params), params)
  # Nothing was written: the stack reads as it was, at the generation it was written in.
  assert_bits_equal(oo.read_nvme_stack(on_nvme), layers)
  assert nvme_stack._OPEN[str(stack_dir)].store.committed_generation == int(on_nvme["a"].generation)


def test_the_gpu_program_holds_nothing_of_the_stack_in_host_memory(tmp_path):
  # Full fine-tuning of a 6-layer bf16 decoder compiled for the RTX 4090 (24 GB) without a GPU:
  # the stack's weights on NVMe, its fp32 master copy and moments in the NVMe tier. Between steps
  # neither host nor device memory holds any of it; in the backward loop each iteration reads two
  # layers, fetches and puts the block's state (9 NVMe leaves) and writes its new weights by one
  # callback.
  from helpers import gpu_compile_or_skip

  from optax_offload._src import gpu_program

  gpu_compile_or_skip()
  cfg, params = decoder(6, jnp.bfloat16)
  params = dict(params, layers=oo.write_nvme_stack(tmp_path / "stack", params["layers"]))
  tx = oo.offload(
    optax.adamw(1e-3),
    master_dtype=jnp.float32,
    min_size=256,
    window_bytes=512 * 1024,
    nvme_dir=str(tmp_path / "state"),
    host_limit=0,
  )
  state = tx.init(params)
  try:
    step = oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx)
    program = gpu_program.compile_for_gpu(
      step,
      params,
      state,
      tokens(0, 0, 1),
      donate_argnums=(0, 1),
      target="rtx4090_24gb",
      xla_flags=oo.STREAM_XLA_OPTIONS,
    )
  finally:
    oo.close_nvme(state)
    oo.close_nvme_stack(params["layers"])
  schedule, memory = program.schedule, program.memory
  assert memory.host_argument == memory.host_temp == 0, memory
  per_computation = {}
  for name, instructions in schedule.computations.items():
    n = sum(1 for i in instructions if i.name in schedule.callbacks)
    if n:
      per_computation[name] = (n, schedule.executions(name))
  loops = sorted(v for name, v in per_computation.items() if name != schedule.entry)
  # The forward loop: two reads an iteration, 3 iterations; the backward loop: 2 reads, 2 x 9
  # state callbacks and 1 weights put, 2 iterations (the first pair before it, the last after).
  assert loops == [(2, 3), (2 + 2 * 9 + 1, 2)], per_computation
  puts = [i for c in schedule.computations.values() for i in c if nvme_stack.PUT_SCOPE in i.text]
  assert len(puts) == 2 and not schedule.host_compute  # in the loop and after it: 3 blocks
  # Device temporaries: measured 890,528 bytes.
  assert memory.temp <= 1_000_000, memory


def test_a_host_budget_plans_the_stack_on_nvme_where_it_is(stack_dir, tmp_path):
  # offload(host_memory=...) plans from where the params are: a stack on NVMe holds no pinned
  # host memory between steps, so the plan counts its weights on the drive, not in the budget.
  from optax_offload._src import offload as offload_lib

  cfg, params = decoder(4, jnp.bfloat16)
  stack_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  params = dict(params, layers=oo.write_nvme_stack(stack_dir, params["layers"]))
  tx = oo.offload(
    optax.adamw(1e-3),
    master_dtype=jnp.float32,
    min_size=256,
    host_memory="1GiB",
    nvme_dir=str(tmp_path / "state"),
    accumulate=2,
  )
  state = tx.init(params)
  planned = offload_lib._OFFLOADED[tx.update].host_memory.planned
  assert planned.weights_on == "nvme" and planned.host_weight_bytes == 0
  assert planned.nvme_weight_bytes == stack_bytes
  # The stack's fp32 accumulators live in pinned host memory (value_and_update's, beside it).
  assert planned.accumulate == 2 and planned.accumulator_bytes == 2 * stack_bytes
  step = jax.jit(oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx, accumulate=2))
  loss, params, state = step(params, state, jnp.stack([tokens(0, m, 2) for m in range(2)]))
  assert np.isfinite(float(loss))
  oo.close_nvme(state)
  # oo.estimate of such params plans the stack there too, counting its params whole.
  e = oo.estimate(params, optimizer=optax.adamw(1e-3), master_dtype="fp32", min_size=256)
  assert (e.weights_on, e.params, e.nvme_weight_bytes) == ("nvme", n_params, stack_bytes)
  assert e.weights_on_reason == "the params hold them there (oo.write_nvme_stack)"
  with pytest.raises(ValueError, match="hold a layer stack on NVMe"):
    oo.estimate(params, weights_on="host")


def test_the_modelled_step_of_a_1b_stack_trained_on_nvme(tmp_path):
  # benchmarks/gpu_speed.py's fused_nvme row with --weights-on nvme: the 1B decoder (22 layers of
  # bf16 weights on NVMe, AdamW's state placed by the plan for 12 GiB of host memory) compiled for
  # the RTX 4090 and modelled with the disk. Its own check holds: the callbacks' shapes account for
  # the plan's NVMe bytes (the state once each way; the weights written once, read a layer per read).
  from helpers import gpu_compile_or_skip

  from benchmarks import gpu_speed
  from benchmarks import llama

  gpu_compile_or_skip()
  # 9 GiB holds not the stack's 2.26e9 B of weights beside the NVMe buffers: the plan moves them to
  # NVMe (--weights-on host, the default), and the program compiled is the plan's.
  argv = ["--models", "1B", "--targets", "rtx4090_24gb", "--variants", "fused_nvme"]
  argv += ["--host-memory", "9GiB", "--micro-batch", "1"]
  (row,) = gpu_speed.main([*argv, "--nvme-dir", str(tmp_path)])
  cfg = llama.CONFIGS["1B"]
  stack = cfg.layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d) * 2
  assert row["weights_on"] == "nvme" and row["nvme_weight_bytes"] == stack
  assert row["fits"] and row["host_bytes"] <= 9 * 2**30, row
  # Each pass reads every layer once and one twice (the forward the last, the backward layer 0,
  # where their loops end); one write per pair of layers.
  runs = row["nvme_callbacks_per_step"]
  assert (
    runs["nvme_stack_fetch"] == 2 * cfg.layers + 2 and runs["nvme_stack_put"] == cfg.layers // 2
  )
  assert row["step_s"] >= row["disk_s"] > 0


def test_the_training_benchmark_runs_at_small_sizes(tmp_path):
  # `benchmarks/nvme_stack.py train` in miniature: 4 layers; a step fetches 2 x 4 - 1 layers from
  # the store (the layer where the passes turn once) and writes 4. The bytes it reads depend on
  # the disk's timing: a layer still in the write-behind buffer is not read again (CI once read
  # 5.5 layers a step, this machine 6), and the read-ahead of the next round's first 2 layers
  # can fall either side of a round's end.
  from benchmarks import nvme_stack as bench

  argv = ["train", "--stack-bytes", "1MiB", "--d", "128", "--tokens", "8"]
  out = bench.main([*argv, "--repeats", "1", "--steps", "2", "--dir", str(tmp_path)])
  layer = out["layer_bytes"]
  assert out["layers"] == 4 and layer == 2 * 128 * 512 * 2
  assert out["layer_fetches_per_step"] == 7 and out["bytes_written_per_step"] == 4 * layer
  assert 0 < out["bytes_read_per_step"] <= (7 + 2 / 2) * layer
  assert out["step_s_nvme"] > 0 and out["step_s_host"] > 0


def test_a_checkpoint_of_the_stack_and_the_state_resumes_bit_for_bit(stack_dir, tmp_path):
  # The stack copied at a step (oo.copy_nvme_stack, a layer at a time) beside an Orbax checkpoint
  # of the optimizer state at that step: training resumed from both, in a new optimizer, gives the
  # bits of training on. The copy keeps its weights while the stack trains on.
  import orbax.checkpoint as ocp

  make, _ = OPTIMIZERS["sgd_momentum"]
  cfg, params = decoder(2, jnp.bfloat16)
  loss = lambda p, t: streamed_loss_fn(cfg, p, t)  # noqa: E731
  tx = oo.offload(make(), master_dtype=jnp.float32, min_size=256)
  params = dict(
    params, layers=jax.device_put(oo.write_nvme_stack(stack_dir, params["layers"]), ON_DEVICE)
  )
  state = tx.init(params)
  step = jax.jit(oo.value_and_update(loss, tx))
  for s in range(1):
    _, params, state = step(params, state, tokens(s, 0, 1))
  copy = oo.copy_nvme_stack(params["layers"], tmp_path / "ckpt_stack")
  stack_at_1 = oo.read_nvme_stack(params["layers"])
  rest_at_1 = {k: jnp.copy(v) for k, v in params.items() if k != "layers"}
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(1, args=ocp.args.Composite(opt_state=oo.OffloadSave(state)))
    mngr.wait_until_finished()
  for s in range(1, 3):
    _, params, state = step(params, state, tokens(s, 0, 1))
  want = dict(params, layers=oo.read_nvme_stack(params["layers"]))
  assert_bits_equal(oo.read_nvme_stack(copy), stack_at_1)

  oo.close_nvme_stack(copy)
  # Reopened with the copy's leaves as `like`: placed as they are (as the source's, by the copy).
  resumed = dict(rest_at_1, layers=oo.open_nvme_stack(tmp_path / "ckpt_stack", copy))
  tx = oo.offload(make(), master_dtype=jnp.float32, min_size=256)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    restored = mngr.restore(
      1, args=ocp.args.Composite(opt_state=oo.OffloadRestore(tx.init(resumed)))
    )
  state = restored["opt_state"]
  step = jax.jit(oo.value_and_update(loss, tx))
  for s in range(1, 3):
    _, resumed, state = step(resumed, state, tokens(s, 0, 1))
  assert_bits_equal(dict(resumed, layers=oo.read_nvme_stack(resumed["layers"])), want)
  assert step._cache_size() == 1
  with pytest.raises(ValueError, match="leaves of one stack directory"):
    oo.copy_nvme_stack({"a": resumed["layers"]["wq"], "b": jnp.ones(3)}, tmp_path / "x")


def test_failed_steps_leave_no_generation_on_disk(stack_dir, tmp_path):
  # Steps that raise after a block of new weights was put (the store's second put) left that
  # partial generation on disk until the store was opened again: 7 generations after 5 failed
  # steps, against the documented 4 (helper review /tmp/revB). The next commit deletes them, and
  # the stack reads what the good steps trained. The optimizer state's NVMe tier kept the failed
  # steps' generations in flight, so that exit waited 60 s for them.
  rng = np.random.default_rng(0)
  layers = {
    "w_in": (rng.normal(size=(4, 16, 32)) * 0.1).astype(np.float32),
    "w_out": (rng.normal(size=(4, 32, 16)) * 0.1).astype(np.float32),
  }

  def loss(p, x):
    body = lambda h, w: (h + jnp.tanh(h @ w["w_in"]) @ w["w_out"], None)  # noqa: E731
    return jnp.mean(oo.offloaded_scan(body, x, p["layers"])[0] ** 2)

  x = jnp.linspace(-1, 1, 128, dtype=jnp.float32).reshape(8, 16)
  tx = oo.offload(optax.sgd(0.1, momentum=0.9), min_size=1, nvme_dir=tmp_path / "s", host_limit=0)
  params = {"layers": oo.write_nvme_stack(stack_dir, layers)}
  written = params["layers"]
  state = tx.init(params)
  step = jax.jit(oo.value_and_update(loss, tx))
  _, params, state = step(params, state, x)
  store = nvme_stack._OPEN[str(stack_dir)].store
  put, calls = store.put, []

  def failing_put(*args, **kwargs):
    calls.append(1)
    if len(calls) % 2 == 0:
      raise OSError("injected")
    return put(*args, **kwargs)

  store.put = failing_put
  for _ in range(3):
    with pytest.raises(Exception, match="injected"):
      jax.block_until_ready(step(params, state, x))
  del store.put
  _, params, state = step(params, state, x)
  store.sync()
  on_disk = sorted(p.name for p in (stack_dir / "store").iterdir() if p.name.startswith("gen_"))
  assert on_disk == [f"gen_{g:08d}" for g in store.generations_on_disk], on_disk
  assert len(on_disk) == 2
  # The leaves as written name a generation two commits have dropped: the error says so (it was
  # the store's "neither committed on disk nor put").
  with pytest.raises(ValueError, match="which later steps have replaced"):
    oo.read_nvme_stack(written)
  tier = nvme_tier.lookup(state.nvme_store)
  assert tier.rendezvous.wait_for_updates(0.0)  # (the exit's wait: nothing in flight)
  tier.store.sync()
  state_dirs = sorted(p.name for p in tier.directory.iterdir() if p.name.startswith("gen_"))
  assert state_dirs == [f"gen_{g:08d}" for g in tier.store.generations_on_disk], state_dirs
  # The two good steps, as without the failed ones.
  ref = {"layers": oo.write_nvme_stack(stack_dir.parent / "ref", layers)}
  ref_tx = oo.offload(optax.sgd(0.1, momentum=0.9), min_size=1)
  ref_state = ref_tx.init(ref)
  ref_step = jax.jit(oo.value_and_update(loss, ref_tx))
  for _ in range(2):
    _, ref, ref_state = ref_step(ref, ref_state, x)
  assert_bits_equal(oo.read_nvme_stack(params["layers"]), oo.read_nvme_stack(ref["layers"]))
  oo.close_nvme(state)


def test_a_stack_of_one_layer_is_refused_saying_so():
  # It was refused as an optimizer whose update mixes the layers (adamw's does not).
  params = {"layers": oo.to_pinned_host({"w": jnp.full((1, 4, 4), 0.5)})}
  tx = oo.offload(optax.adamw(1e-2), min_size=1)

  def loss(p, x):
    return jnp.sum(oo.offloaded_scan(lambda h, w: (jnp.tanh(h @ w["w"]), None), x, p["layers"])[0])

  with pytest.raises(ValueError, match="has one layer, and a stack is updated a layer at a time"):
    oo.value_and_update(loss, tx)(params, tx.init(params), jnp.ones((2, 4)))
