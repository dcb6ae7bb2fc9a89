"""One process of a 2-process CPU run on loopback (2 devices each), or the 1-process 4-device reference.

Usage: python multiprocess_child.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--fault] [--steps N]
       [--nvme] [--save-at STEP] [--restore-from DIR]
Trains make_params() sharded over a 4-device mesh for 10 steps with offloaded (host-tier) AdamW and
writes the gathered params and this process's footprint to OUT_DIR.

--nvme: host and NVMe tiers (`NVME_HOST_LIMIT`, nvme_dir OUT_DIR/nvme); the footprint file also
lists the shard files of this process's last generation.
--save-at STEP: saves an Orbax checkpoint (params and `oo.OffloadSave`) in OUT_DIR/ckpt after STEP steps.
--restore-from DIR: restores the checkpoint of DIR/ckpt (its only step) and trains from there.

--host-memory SIZE: offload(host_memory=SIZE) instead of host_limit (with --nvme: and nvme_dir), and
offload's INFO log (what it planned) on stderr.
--hold-on-0 SIZE: process 0 holds an array of SIZE bytes in pinned host memory before init.
--nvme-dir-on-1 DIR: process 1's nvme_dir (with --nvme), instead of OUT_DIR/nvme.
--lock-on-1: process 1's NVMe store directory is locked (another store's) at the first init,
which both processes log ("init refused: ...") before training with the lock released.
--wide: one more leaf, 'wide' (64 x 200,000, sharded on its columns: 102 MB of Adam state in all,
updated in row slices), and the NVMe store's options of `WIDE_NVME_OPTIONS`.

--fused: instead, the llama decoder of tests/test_value_and_update.py with its layer stack in pinned
host memory, sharded over the 4 devices, updated inside the backward pass (`value_and_update`,
accumulate=2) by offloaded SGD with momentum, planned by offload(host_memory=...) from this
process's shards (the state in pinned host memory: value_and_update refuses a mesh with it on
NVMe); and plain optax on the device (`test_value_and_update.reference`),
written as reference.npz.

--steps N: train N steps instead (benchmarks/multiprocess.py), and write the median step time.
--fault: the kill-one-process test. Short coordination timeouts (`FAULT_TIMEOUTS`); trains with
global-norm clipping outside offload (an all-reduce across processes every step) for up to
`FAULT_MAX_STEPS` steps, writing OUT_DIR/step3_{PROCESS_ID} after step 3, and prints timestamped
progress and the error to stderr. The parent kills one process and times how the other one ends.
"""

import contextlib
import json
import logging
import os
import pathlib
import sys
import time


def _option(name: str, default=None):
  """The value after the flag `name`, or `default`."""
  return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


process_id, num_processes, port, out_dir = (
  int(sys.argv[1]),
  int(sys.argv[2]),
  sys.argv[3],
  sys.argv[4],
)
FAULT = "--fault" in sys.argv[5:]
FUSED = "--fused" in sys.argv[5:]
STEPS = int(_option("--steps", 10))
NVME = "--nvme" in sys.argv[5:]
# Per process: the rest of the offloaded state (164 KiB in 1 process, 82 KiB in each of 2) fits, the
# Adam state of 'big' too (469 KiB in all) does not: it goes to NVMe, with 1 or 2 processes alike.
NVME_HOST_LIMIT = "200KiB"
SAVE_AT = None if _option("--save-at") is None else int(_option("--save-at"))


HOST_MEMORY = _option("--host-memory")
if HOST_MEMORY is not None and HOST_MEMORY.isdigit():  # bytes, as the tests compute them
  HOST_MEMORY = int(HOST_MEMORY)
HOLD_ON_0 = int(_option("--hold-on-0", 0))
RESTORE_FROM = _option("--restore-from")
WIDE = "--wide" in sys.argv
WIDE_NVME_OPTIONS = {"io_threads": 1}
"""One chunk file at a time each way: 4 MiB of write staging instead of 16, so that a spill to NVMe
needs less host memory than 'wide''s state (its groups: `window_bytes`)."""
FAULT_TIMEOUTS = {"heartbeat_timeout_seconds": 10, "shutdown_timeout_seconds": 10}
"""Coordination-service limits in fault mode: a dead peer is declared after 10 s without heartbeats
(JAX's default is 100 s), and a shutdown waits at most 10 s for the others (default 300 s)."""
FAULT_MAX_STEPS = 100_000
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // num_processes}"

import jax  # noqa: E402

if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    **(FAULT_TIMEOUTS if FAULT else {}),
  )

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from conftest import make_grads  # noqa: E402
from conftest import make_params  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_offload as oo  # noqa: E402

SPECS = {
  "embed": P("fsdp"),
  "dense": {"kernel": P(None, "fsdp"), "bias": P()},
  "conv": P(None, None, None, "fsdp"),
  "big": P("fsdp"),
  "scale": P(),
}


@contextlib.contextmanager
def checkpoints(directory):
  options = ocp.CheckpointManagerOptions(
    async_options=ocp.AsyncOptions(create_directories_asynchronously=False)
  )
  mgr = ocp.CheckpointManager(os.path.join(directory, "ckpt"), options=options)
  try:
    yield mgr
    mgr.wait_until_finished()
  finally:
    mgr.close()


def log(msg: str) -> None:
  print(f"[process {process_id} t={time.time():.3f}] {msg}", file=sys.stderr, flush=True)


def global_array(x, spec, mesh):
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def main():
  if HOST_MEMORY is not None:  # what offload planned, on stderr (the test reads it)
    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    logging.getLogger("optax_offload").setLevel(logging.INFO)
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices())
  nvme = {"host_limit": NVME_HOST_LIMIT, "nvme_dir": os.path.join(out_dir, "nvme")} if NVME else {}
  if NVME and process_id == 1 and _option("--nvme-dir-on-1") is not None:
    nvme["nvme_dir"] = _option("--nvme-dir-on-1")
  if HOST_MEMORY is not None:
    nvme = {"host_memory": HOST_MEMORY, **{k: v for k, v in nvme.items() if k == "nvme_dir"}}
  host_params = make_params()
  specs = SPECS
  if WIDE:
    host_params["wide"] = (np.random.default_rng(0).normal(size=(64, 200_000)) * 0.1).astype("f4")
    specs = dict(SPECS, wide=P(None, "fsdp"))
    nvme["nvme_options"] = WIDE_NVME_OPTIONS
  params = jax.tree.map(lambda x, s: global_array(x, s, mesh), host_params, specs)
  held = None
  if HOLD_ON_0 and process_id == 0:
    pinned = jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind="pinned_host")
    held = jax.device_put(np.zeros(HOLD_ON_0, np.uint8), pinned)
  tx = oo.offload(optax.adamw(1e-2), window_bytes=100_000, **nvme)
  if "--lock-on-1" in sys.argv:  # init stops on both processes, then goes on once it is released
    from optax_offload._src.nvme import files
    from optax_offload._src.nvme_tier import process_directory

    store_dir = pathlib.Path(process_directory(nvme["nvme_dir"]))
    store_dir.mkdir(parents=True, exist_ok=True)
    lock = files.DirectoryLock(store_dir) if process_id == 1 else None
    try:
      tx.init(params)
      raise AssertionError("init went on with process 1's NVMe store directory locked")
    except (RuntimeError, ValueError) as e:
      log(f"init refused: {type(e).__name__}: {e}")
    if lock is not None:
      lock.release()
  if FAULT:  # clipping outside offload: every step all-reduces across the processes
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  del held  # what init planned beside
  if FAULT:
    fault(step, params, state, host_params, mesh)
    return
  times, start = [], 0
  if RESTORE_FROM is not None:
    with checkpoints(RESTORE_FROM) as mgr:
      start = mgr.latest_step()
      restored = mgr.restore(
        start,
        args=ocp.args.Composite(
          params=ocp.args.StandardRestore(params), opt=oo.OffloadRestore(state)
        ),
      )
    params, state = restored["params"], restored["opt"]
  for t in range(start, STEPS):
    grads = jax.tree.map(lambda x, s: global_array(x, s, mesh), make_grads(host_params, t), specs)
    t0 = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
    if t + 1 == SAVE_AT:
      with checkpoints(out_dir) as mgr:
        mgr.save(
          SAVE_AT,
          args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt=oo.OffloadSave(state)),
        )
  kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.inner[0].mu)})
  flat = _flat((params, oo.to_inner(state, memory_kind="device")[0].mu))
  if process_id == 0:
    np.savez(os.path.join(out_dir, "result.npz"), **flat)
  files = []
  if NVME:
    oo.sync_nvme(state)
    generation = int(state.nvme_generation)
    gen_dir = os.path.join(out_dir, "nvme", f"process_{process_id}", f"gen_{generation:08d}")
    files = sorted(os.listdir(gen_dir)) if generation >= 0 else []  # (all of it in RAM)
  with open(os.path.join(out_dir, f"footprint_{process_id}.json"), "w") as f:
    json.dump(
      {
        "nvme_files": files,
        "footprint": oo.footprint(state),
        "memory_kinds": kinds,
        "backend": jax.default_backend(),
        "step_s": times,
        "median_step_s": float(np.median(times[1:] if len(times) > 1 else times)),
      },
      f,
    )
  if NVME:
    oo.close_nvme(state)
  if num_processes > 1:
    jax.distributed.shutdown()


def fused_main():
  import test_value_and_update as fused_tests  # (the decoder, its batches and its reference)

  from benchmarks import llama
  from benchmarks.stream_layers import streamed_loss_fn
  from optax_offload._src import memory

  auto = (jax.sharding.AxisType.Auto,)  # the loss's gathers resolve their own shardings
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices(), axis_types=auto)
  cfg = llama.Config(d=64, layers=4, ffn=128, heads=4, vocab=256)
  host_params = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0), np.float32))
  specs = jax.tree.map(
    lambda x: P(*[None] * (x.ndim - 1), "fsdp") if x.ndim > 1 else P(), host_params
  )
  params = jax.tree.map(lambda x, s: global_array(x, s, mesh), host_params, specs)
  k, make = 2, lambda: optax.sgd(1e-2, momentum=0.9)
  batches = [
    global_array(np.stack([fused_tests.tokens(s, m, k) for m in range(k)]), P(), mesh)
    for s in range(STEPS)
  ]
  want = _flat(fused_tests.reference(cfg, params, make(), master=None, k=k, clip=None, steps=STEPS))
  if process_id == 0:
    np.savez(os.path.join(out_dir, "reference.npz"), **want)
  to_host = lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))  # noqa: E731
  params = dict(params, layers=jax.tree.map(to_host, params["layers"]))
  # The run's pinned host memory planned per process: its shards of the stack's weights and of
  # their float32 accumulators, and its shards of the momentum of the leaves offload takes (half
  # of what a plan of the whole stack would need for the stack).
  held = lambda xs: sum(memory.held_bytes(x) for x in xs)  # noqa: E731
  momentum = held(x for x in jax.tree.leaves(params) if x.size >= 256)
  budget = memory.pinned_host_bytes(exclude=params) + 2 * held(jax.tree.leaves(params["layers"]))
  tx = oo.offload(make(), min_size=256, host_memory=budget + momentum - 1, accumulate=k)
  try:  # a byte less: refused on both processes, at once
    tx.init(params)
    raise AssertionError("host_memory a byte short of the plan was not refused")
  except ValueError as e:
    assert "does not fit this model's plan" in str(e), e
  tx = oo.offload(make(), min_size=256, host_memory=budget + momentum, accumulate=k)
  state = tx.init(params)
  loss_fn = lambda p, t: streamed_loss_fn(cfg, p, t)  # noqa: E731
  step = jax.jit(oo.value_and_update(loss_fn, tx, accumulate=k), donate_argnums=(0, 1))
  for batch in batches:
    _, params, state = step(params, state, batch)
  kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(params["layers"])})
  to_device = lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))  # noqa: E731
  flat = _flat(jax.tree.map(to_device, params))
  if process_id == 0:
    np.savez(os.path.join(out_dir, "result.npz"), **flat)
  with open(os.path.join(out_dir, f"footprint_{process_id}.json"), "w") as f:
    json.dump({"footprint": oo.footprint(state), "stack_memory_kinds": kinds}, f)
  if num_processes > 1:
    jax.distributed.shutdown()


def _flat(tree):
  """`tree` gathered from every process, as numpy arrays by key path."""
  gathered = multihost_utils.process_allgather(tree, tiled=True)
  return {
    jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(gathered)
  }


def fault(step, params, state, host_params, mesh):
  """Trains until killed or failed; the error, if any, propagates (non-zero exit)."""
  grads = jax.tree.map(lambda x, s: global_array(x, s, mesh), make_grads(host_params, 0), SPECS)
  log("training")
  for t in range(FAULT_MAX_STEPS):
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    if t == 3:
      with open(os.path.join(out_dir, f"step3_{process_id}"), "w") as f:
        f.write(str(time.time()))
      log("step 3 done")
  log(f"finished {FAULT_MAX_STEPS} steps: the peer was never lost")


if __name__ == "__main__":
  try:
    fused_main() if FUSED else main()
  except BaseException as e:
    if FAULT:
      log(f"failed: {type(e).__name__}: {e}")
    raise
