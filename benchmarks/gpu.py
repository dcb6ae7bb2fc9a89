"""One prepared run on a lent GPU: the step-time model against the hardware, in <= 8 minutes.

On a lent GPU (the device tool's ``run``, ``timeout_s=540``; the repo root is the working dir)::

    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT/gpu.json

Send back ``$OUT/gpu.json`` (whole: every figure, with ``flags`` listing where the model was off by
more than 20%), ``$OUT/gpu_hlo.zip`` (the scheduled HLO of every timed program, so the model can be
re-run on it without a GPU) and the printed table. Without a GPU::

    python -m benchmarks.gpu --smoke --out bench_out/gpu_smoke.json   # CPU, tiny sizes, seconds

Sections, each time-boxed, the JSON rewritten after every item (a run cut short still returns
what it measured); they run in the order device, bandwidth, pieces, steps:

* ``device``: JAX's description of the device (kind, memory, SMs) and the `oo.Hardware` the model
  uses: the ``gpu_targets`` file of that kind (``h200_141gb``, ``h100_80gb``, ``rtx4090_24gb``) or,
  for an unknown kind, the one nearest in memory.
* ``bandwidth``: host<->device bytes per second of pinned host memory (``pinned_host``): eager
  `jax.device_put`, a jitted transfer (``out_shardings`` in the other memory kind, as `offload`
  moves state), both directions at once in one jitted call, and pageable numpy for reference.
* ``steps``: the real step time of the Llama-style decoder of `benchmarks.llama` (layers stacked
  under `lax.scan`, remat, bf16 weights) for ``plain_bf16``, ``offload_state``, ``offload_all``,
  ``fused_all`` and ``fused_state`` (`oo.value_and_update`), the variants of
  `benchmarks.gpu_speed`. Each is compiled here, on the device, and the same compiled program's
  scheduled HLO is modelled by `oo.timeline` at the target's rates (``modelled_s``) and at the
  rates with the link measured above (``modelled_measured_link_s``); ``ratio`` is measured /
  modelled.
* ``pieces``: what no compile-only check reaches: the NVMe tier's host callbacks on a real stream
  (state past ``host_limit`` in a temporary directory), the pinned host pool's limit (a child
  process allocates past ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, and past the default 64 GiB, and
  records the error; the plan's warning for a host tier over the pool), and ``update_on="host"``.

Every figure under ``modelled_*`` is a model of the compiled program; every other time is measured.
On the CPU (``--smoke``), the JSON says ``"backend": "cpu"``: its times are CPU times, compared
with a GPU target's model only so that every path runs; they say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

# benchmarks.stream_layers sets JAX_PLATFORMS=cpu when unset, for its compile-only runs; JAX has
# read it already (at import), but the pool's child processes must start on this run's platform.
_JAX_PLATFORMS = os.environ.get("JAX_PLATFORMS")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from benchmarks import gpu_speed  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks._common import write_json  # noqa: E402
from optax_offload._src import plan as plan_lib  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
VARIANTS = ("plain_bf16", "offload_state", "offload_all", "fused_all", "fused_state")
OFF_BY = 0.2
"""A model is flagged when measured / modelled is outside [1 - OFF_BY, 1 + OFF_BY]."""
SECTIONS = ("device", "bandwidth", "pieces", "steps")
"""The sections in the order they run: the pieces' cost is fixed, the steps' compile times are
the unknown, so the steps come last and take what is left."""
BUDGET_SHARES = {"device": 0.02, "bandwidth": 0.10, "pieces": 0.25, "steps": 0.63}
"""Each section's share of ``--budget-s``; a section past its deadline starts no new item, and
what it leaves is given to the next (the budget is checked between items: one compile cannot be
interrupted)."""
POOL_MIN_S = 45
"""Seconds the pinned pool's children get even when the pieces before them ran late (pinning
tens of GiB takes a while)."""

TARGET_KINDS = (("h200", "h200_141gb"), ("h100", "h100_80gb"), ("4090", "rtx4090_24gb"))
"""Substrings of JAX's ``device_kind`` (lowercased) and the ``gpu_targets`` file of their rates."""
TARGET_MEMORY = {"h200_141gb": 141e9, "h100_80gb": 84978434048, "rtx4090_24gb": 24 * GiB}
"""Device memory of each target (datasheets; the H100's from XLA's h100_sxm spec), for an unknown
device kind: the target nearest in memory."""
DEFAULT_TARGET = "h200_141gb"
"""The target of a run without a GPU: the card this run is prepared for."""


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What each section runs: the GPU run's sizes, or the smoke test's."""

  bw_bytes: tuple[int, ...]
  bw_reps: int
  model: llama.Config
  micro_batch: int
  seq: int
  accumulate: int
  window: int
  step_reps: int
  piece_shape: tuple[int, int]
  piece_leaves: int
  piece_reps: int
  pool_limit_gb: float
  pool_chunk: int
  pool_max: int
  pool_default_chunk: int
  pool_default_max: int


GPU_SIZES = Sizes(
  bw_bytes=(256 * MiB, 2 * GiB),
  bw_reps=5,
  model=llama.CONFIGS["1B"],
  micro_batch=4,
  seq=2048,
  accumulate=1,
  window=2 * GiB,
  step_reps=5,
  piece_shape=(2048, 4096),
  piece_leaves=8,
  piece_reps=3,
  pool_limit_gb=2,
  pool_chunk=512 * MiB,
  pool_max=4 * GiB,
  pool_default_chunk=8 * GiB,
  pool_default_max=72 * GiB,
)
SMOKE_SIZES = Sizes(
  bw_bytes=(1 * MiB, 4 * MiB),
  bw_reps=2,
  model=llama.Config(d=64, layers=2, ffn=128, heads=4, vocab=256),
  micro_batch=2,
  seq=16,
  accumulate=1,
  window=512 * 1024,
  step_reps=2,
  piece_shape=(64, 128),
  piece_leaves=4,
  piece_reps=2,
  pool_limit_gb=2,
  pool_chunk=1 * MiB,
  pool_max=3 * MiB,
  pool_default_chunk=1 * MiB,
  pool_default_max=2 * MiB,
)


# --------------------------------------------------------------------------------------------
# Bookkeeping: the budget, the JSON rewritten after every item, errors kept as data.


class Budget:
  """Deadlines of the sections, from the start of the run."""

  def __init__(self, seconds: float):
    self.start = time.perf_counter()
    self.seconds = seconds
    self.ends = {}
    t = 0.0
    for name in SECTIONS:
      t += BUDGET_SHARES[name] * seconds
      self.ends[name] = t

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self, section: str) -> float:
    return self.ends[section] - self.elapsed()


class Recorder:
  """The result dict, written to `path` whenever an item finishes; HLO texts into a zip beside it."""

  def __init__(self, result: dict, path: str | None):
    self.result = result
    self.path = path
    self.hlo: dict[str, str] = {}

  def save(self) -> None:
    if self.path:
      write_json(self.result, self.path)

  def add_hlo(self, name: str, text: str) -> None:
    self.hlo[name] = text
    if self.path:
      zpath = os.path.splitext(self.path)[0] + "_hlo.zip"
      with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        for n, t in self.hlo.items():
          z.writestr(f"{n}.hlo.txt", t)


def _error(e: BaseException) -> dict:
  tb = traceback.format_exc().strip().splitlines()
  return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback_tail": tb[-12:]}


def _guarded(fn, *args, **kwargs) -> dict:
  t0 = time.perf_counter()
  try:
    out = fn(*args, **kwargs)
  except Exception as e:  # a failure is a result: recorded, and the run goes on
    out = _error(e)
  out["wall_s"] = time.perf_counter() - t0
  return out


def _times(fn, reps: int, prepare=None) -> list[float]:
  out = []
  for _ in range(reps):
    arg = prepare() if prepare is not None else None
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg) if prepare is not None else fn())
    out.append(time.perf_counter() - t0)
  return out


def _stats(nbytes: int, times: list[float]) -> dict:
  return {
    "best_Bps": nbytes / min(times),
    "median_Bps": nbytes / statistics.median(times),
    "times_s": times,
  }


# --------------------------------------------------------------------------------------------
# device: what JAX says about the device, and the rates the model uses.


def _memory_stats(device) -> dict:
  try:
    return dict(device.memory_stats() or {})
  except Exception:  # not every backend reports memory stats
    return {}


def nearest_target(device_kind: str, memory_bytes: int | None, backend: str) -> tuple[str, str]:
  """The ``gpu_targets`` file for a device and why it was chosen."""
  kind = device_kind.lower()
  if backend == "gpu":
    for key, target in TARGET_KINDS:
      if key in kind:
        return target, f"device_kind {device_kind!r} contains {key!r}"
    if memory_bytes:
      target = min(TARGET_MEMORY, key=lambda t: abs(TARGET_MEMORY[t] - memory_bytes))
      return target, f"unknown device_kind {device_kind!r}: nearest in memory ({memory_bytes} B)"
  return DEFAULT_TARGET, f"backend {backend!r}, no GPU: the target this run is prepared for"


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def describe_device(device, host: str) -> dict:
  stats = _memory_stats(device)
  backend = jax.default_backend()
  memory = stats.get("bytes_limit")
  target, why = nearest_target(str(device.device_kind), memory, backend)
  hw = oo.hardware(target, host)
  try:
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError):
    host_memory = None
  return {
    "backend": backend,
    "platform": device.platform,
    "device_kind": str(device.device_kind),
    "memory_bytes_limit": memory,
    "memory_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))},
    "compute_capability": getattr(device, "compute_capability", None),
    "core_count": getattr(device, "core_count", None),
    "devices": len(jax.devices()),
    "memory_kinds": [m.kind for m in device.addressable_memories()],
    "jax": jax.__version__,
    "jaxlib": _version("jaxlib"),
    "cuda_plugin": _version("jax-cuda13-plugin") or _version("jax-cuda12-plugin"),
    "python": platform.python_version(),
    "host_cpus": os.cpu_count(),
    "host_memory_bytes": host_memory,
    "pinned_pool_limit_env": os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"),
    "target": target,
    "target_why": why,
    "host_profile": host,
    "hardware": {
      f.name: getattr(hw, f.name) for f in dataclasses.fields(hw) if f.name != "sources"
    },
    "hardware_sources": dict(hw.sources),
  }


# --------------------------------------------------------------------------------------------
# bandwidth


def bandwidth(nbytes: int, device, reps: int) -> dict:
  """Bytes per second between device memory and pinned host memory, and pageable numpy."""
  n = max(nbytes // 4, 1)
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  x = jax.device_put(jnp.ones(n, jnp.float32), on_device)
  h = jax.device_put(x, on_host)
  to_host = jax.jit(lambda a: a, out_shardings=on_host)
  to_device = jax.jit(lambda a: a, out_shardings=on_device)
  both = jax.jit(lambda a, b: (a, b), out_shardings=(on_host, on_device))
  jax.block_until_ready((to_host(x), to_device(h), both(x, h)))  # compile
  size = x.nbytes
  numpy = np.ones(n, np.float32)
  out = {
    "bytes": size,
    "device_put_h2d": _stats(size, _times(lambda: jax.device_put(h, on_device), reps)),
    "device_put_d2h": _stats(size, _times(lambda: jax.device_put(x, on_host), reps)),
    "jit_h2d": _stats(size, _times(lambda: to_device(h), reps)),
    "jit_d2h": _stats(size, _times(lambda: to_host(x), reps)),
    "jit_both_directions": _stats(2 * size, _times(lambda: both(x, h), reps)),
    "pageable_numpy_h2d": _stats(size, _times(lambda: jax.device_put(numpy, on_device), reps)),
    # a fresh array each time: np.asarray caches an array's host copy
    "pageable_numpy_d2h": _stats(
      size, _times(lambda a: np.asarray(a), reps, prepare=lambda: jax.block_until_ready(x + 0))
    ),
  }
  return out


# --------------------------------------------------------------------------------------------
# steps: the decoder's training step, measured and modelled.


def _named(device, memory_kind: str = "device"):
  mesh = jax.sharding.Mesh([device], ("d",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)


def build_variant(variant: str, cfg: llama.Config, sizes: Sizes, device):
  """Real params, state and tokens of `variant`, and its step (as `benchmarks.gpu_speed`)."""
  k = sizes.accumulate
  on_device = _named(device)
  init = jax.jit(llama.init_params, static_argnums=(0, 2), out_shardings=on_device)
  params = init(cfg, jax.random.key(0), jnp.bfloat16)
  if variant in ("offload_all", "fused_all"):
    params = dict(params, layers=jax.device_put(params["layers"], _named(device, "pinned_host")))
  tokens = jax.device_put(
    jax.random.randint(
      jax.random.key(1), (k, sizes.micro_batch, sizes.seq + 1), 0, cfg.vocab, jnp.int32
    ),
    on_device,
  )
  if variant == "plain_bf16":
    tx = optax.adamw(1e-4, mu_dtype=jnp.float32)
  else:
    tx = gpu_speed.offloaded_adamw(sizes.window)
  state = tx.init(params)
  step = gpu_speed.variant_step(cfg, variant, tx, k)
  return step, params, state, tokens, tx


def _compile(step, args, donate, options) -> tuple:
  """The step compiled on this device, its scheduled HLO and compile seconds."""
  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=donate).lower(*args)
  note = None
  try:
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
  except Exception as e:
    if not options:
      raise
    # A backend or XLA release without one of the options: compiled without them, and said so.
    note = f"compiled without {sorted(options)}: {type(e).__name__}: {e}"[:1000]
    compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  try:
    hlo = compiled.as_text()
  except Exception:
    hlo = compiled.runtime_executable().hlo_modules()[0].to_string()
  return compiled, hlo, seconds, note


def _memory_analysis(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
  except Exception:  # not every backend has one
    return {}
  fields = ("argument", "output", "alias", "temp")
  out = {f"{f}_bytes": int(getattr(m, f"{f}_size_in_bytes", 0) or 0) for f in fields}
  out["device_bytes"] = (
    out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  )
  out["host_bytes"] = sum(int(getattr(m, f"host_{f}_size_in_bytes", 0) or 0) for f in fields[:2])
  return out


def modelled(hlo: str, hw: oo.Hardware, hw_link: oo.Hardware | None, **kwargs) -> dict:
  """`oo.timeline` of the program at the target's rates (and with the measured link)."""
  t = oo.timeline(hlo, hw, **kwargs)
  out = {
    "modelled_s": t.step_s,
    "modelled": t.summary(),
    "modelled_top_kernels": [
      {"name": k.name, "op_name": k.op_name[-120:], "kind": k.kind, "seconds": k.seconds}
      for k in t.kernel_costs[:8]
    ],
  }
  if hw_link is not None:
    out["modelled_measured_link_s"] = oo.timeline(hlo, hw_link, **kwargs).step_s
  return out


def compare(row: dict, measured_s: float) -> None:
  """Adds measured / modelled ratios and whether each is off by more than `OFF_BY`."""
  for key in ("modelled_s", "modelled_measured_link_s"):
    if row.get(key):
      ratio = measured_s / row[key]
      name = key.replace("modelled", "ratio").replace("_s", "", 1)
      row[name] = ratio
      row[name.replace("ratio", "off_by_more_than_20pct")] = abs(ratio - 1) > OFF_BY


def _run_steps(step_fn, args, reps: int) -> tuple[list[float], tuple]:
  """Times `reps` steps after one warm-up; args (params, state, *rest) are carried."""
  params, state, *rest = args
  params, state, *_ = jax.block_until_ready(step_fn(params, state, *rest))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    params, state, *_ = jax.block_until_ready(step_fn(params, state, *rest))
    times.append(time.perf_counter() - t0)
  return times, (params, state)


def run_variant(variant, sizes, device, hw, hw_link, rec: Recorder) -> dict:
  cfg = sizes.model
  row = {"variant": variant, "model": dataclasses.asdict(cfg), "params": cfg.params}
  step, params, state, tokens, tx = build_variant(variant, cfg, sizes, device)
  options = oo.STREAM_XLA_OPTIONS if variant != "plain_bf16" else None
  compiled, hlo, compile_s, note = _compile(step, (params, state, tokens), (0, 1), options)
  rec.add_hlo(f"step_{variant}", hlo)
  row["compile_s"] = compile_s
  row["xla_options"] = note or (sorted(options) if options else [])
  row["memory_analysis"] = _memory_analysis(compiled)
  if variant != "plain_bf16":
    row["footprint"] = oo.footprint(state)
  row.update(_guarded(modelled, hlo, hw, hw_link))
  times, (params, state) = _run_steps(compiled, (params, state, tokens), sizes.step_reps)
  measured = statistics.median(times)
  tokens_per_step = sizes.accumulate * sizes.micro_batch * sizes.seq
  row.update(
    measured_s=measured,
    measured_min_s=min(times),
    times_s=times,
    tokens_per_step=tokens_per_step,
    tokens_per_s=tokens_per_step / measured,
    mfu=6 * cfg.params * tokens_per_step / measured / hw.tensor_flops,
    peak_bytes_in_use=_memory_stats(device).get("peak_bytes_in_use"),
  )
  compare(row, measured)
  del params, state, tokens
  return row


# --------------------------------------------------------------------------------------------
# pieces: the NVMe tier on a real stream, the pinned pool's limit, update_on="host".


def _piece_params(sizes: Sizes, device) -> dict:
  rows, cols = sizes.piece_shape
  on_device = _named(device)
  return {
    f"w{i}": jax.device_put(
      jax.random.normal(jax.random.key(i), (rows, cols), jnp.float32) * 0.02, on_device
    )
    for i in range(sizes.piece_leaves)
  }


def _grads(params):
  return jax.tree.map(lambda p: jnp.full_like(p, 1e-3) + 1e-4 * p, params)


def _max_rel(a, b) -> float:
  """The largest difference of a leaf over that leaf's largest magnitude."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30)))
  return worst


def _train_offloaded(tx, params, grads, reps, hw, hw_link, rec, name, disk=None) -> dict:
  """Jitted update_and_apply steps of `tx`: compile, model, time; returns the row and params."""
  state = tx.init(params)
  fp = oo.footprint(state)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  compiled, hlo, compile_s, _ = _compile(step, (params, state, grads), (0, 1), None)
  rec.add_hlo(name, hlo)
  row = {"footprint": fp, "compile_s": compile_s, "memory_analysis": _memory_analysis(compiled)}
  row.update(_guarded(modelled, hlo, hw, hw_link, disk=disk))
  times, (params, state) = _run_steps(compiled, (params, state, grads), reps)
  row.update(measured_s=statistics.median(times), measured_min_s=min(times), times_s=times)
  compare(row, row["measured_s"])
  return row, params, state


@functools.cache
def _plain_reference(sizes: Sizes, device, steps: int):
  """Plain optax AdamW's params after `steps` steps from the pieces' params and gradients."""
  params = _piece_params(sizes, device)
  grads = _grads(params)
  tx = optax.adamw(1e-3)
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return params


def nvme_piece(sizes, device, hw, hw_link, rec) -> dict:
  """The NVMe tier's host callbacks on the device's stream: half the state on disk."""
  params = _piece_params(sizes, device)
  grads = _grads(params)
  steps = 1 + sizes.piece_reps
  want = _plain_reference(sizes, device, steps)
  state_bytes = 2 * 4 * sum(p.size for p in jax.tree.leaves(params))
  window = max(state_bytes // 4, 4096)
  out = {"state_bytes": state_bytes, "window_bytes": window}
  with tempfile.TemporaryDirectory(prefix="oo_gpu_nvme_") as nvme_dir:
    tx = oo.offload(
      optax.adamw(1e-3), window_bytes=window, host_limit=state_bytes // 2, nvme_dir=nvme_dir
    )
    row, got, state = _train_offloaded(
      tx, jax.tree.map(jnp.copy, params), grads, sizes.piece_reps, hw, hw_link, rec, "nvme"
    )
    t0 = time.perf_counter()
    oo.sync_nvme(state)
    row["sync_s"] = time.perf_counter() - t0
    oo.close_nvme(state)
    row["nvme_files"] = sum(len(f) for _, _, f in os.walk(nvme_dir))
  row["max_rel_vs_plain_optax"] = _max_rel(got, want)
  host_tx = oo.offload(optax.adamw(1e-3), window_bytes=window)
  host_row, host_got, _ = _train_offloaded(
    host_tx, jax.tree.map(jnp.copy, params), grads, sizes.piece_reps, hw, hw_link, rec, "host_tier"
  )
  row["bits_equal_host_tier"] = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(host_got))
  )
  row["host_tier_measured_s"] = host_row["measured_s"]
  row["host_tier_modelled_s"] = host_row.get("modelled_s")
  out.update(row)
  return out


def host_update_piece(sizes, device, hw, hw_link, rec) -> dict:
  """``update_on="host"``: the update on the CPU beside the state, against the device update."""
  params = _piece_params(sizes, device)
  grads = _grads(params)
  steps = 1 + sizes.piece_reps
  want = _plain_reference(sizes, device, steps)
  state_bytes = 2 * 4 * sum(p.size for p in jax.tree.leaves(params))
  window = max(state_bytes // 4, 4096)
  tx = oo.offload(optax.adamw(1e-3), update_on="host", window_bytes=window)
  row, got, _ = _train_offloaded(
    tx, jax.tree.map(jnp.copy, params), grads, sizes.piece_reps, hw, hw_link, rec, "update_host"
  )
  row["state_bytes"] = state_bytes
  row["window_bytes"] = window
  row["max_rel_vs_plain_optax"] = _max_rel(got, want)
  return row


def _pool_child(limit_gb: str, chunk: int, most: int) -> dict:
  """In a child process (its environment set before JAX starts): pinned host chunks until an
  allocation fails or `most` bytes are held. Prints a JSON line after every chunk, so that a
  child stopped at its time limit still says how far it got."""
  device = jax.local_devices()[0]
  on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  held = []
  t0 = time.perf_counter()
  out = {
    "backend": jax.default_backend(),
    "limit_env_gb": limit_gb,
    "chunk_bytes": chunk,
    "tried_up_to_bytes": most,
    "allocated_bytes": 0,
    "chunk_seconds": [],
    "failed": False,
    "error": None,
    "plan_warning_at_limit": plan_lib.pinned_pool_warning(most),
  }
  while out["allocated_bytes"] + chunk <= most:
    t = time.perf_counter()
    try:
      held.append(jax.block_until_ready(jax.device_put(np.zeros(chunk, np.uint8), on_host)))
    except Exception as e:  # the error is the result
      out.update(failed=True, error=f"{type(e).__name__}: {e}"[:2000])
      break
    out["chunk_seconds"].append(time.perf_counter() - t)
    out["allocated_bytes"] = sum(a.nbytes for a in held)
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
  out["seconds"] = time.perf_counter() - t0
  return out


def _spawn_pool_child(limit_gb: float | None, chunk: int, most: int) -> subprocess.Popen:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env.pop("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", None)
  env.pop("JAX_PLATFORMS", None)
  if _JAX_PLATFORMS is not None:
    env["JAX_PLATFORMS"] = _JAX_PLATFORMS
  if limit_gb is not None:
    env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = f"{limit_gb:g}"
  cmd = [sys.executable, "-m", "benchmarks.gpu", "--pool-child", f"{chunk}:{most}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen(
    cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _pool_result(proc: subprocess.Popen, limit_gb, t0: float, deadline: float) -> dict:
  timed_out = False
  try:
    stdout, stderr = proc.communicate(timeout=max(deadline - time.perf_counter(), 5))
  except subprocess.TimeoutExpired:
    timed_out = True
    proc.kill()
    stdout, stderr = proc.communicate()
  lines = [line for line in stdout.splitlines() if line.startswith("{")]
  if not lines or (proc.returncode != 0 and not timed_out):
    return {
      "error": f"child exited {proc.returncode}" + (" (timed out)" if timed_out else ""),
      "limit_env_gb": limit_gb,
      "stderr_tail": stderr.strip().splitlines()[-12:],
    }
  out = json.loads(lines[-1])  # the last chunk's line when the child was stopped
  out["timed_out"] = timed_out
  out["child_wall_s"] = time.perf_counter() - t0
  return out


def pinned_pool_piece(sizes, budget_s: float) -> dict:
  """The pinned host pool's limit: allocations past a small set limit and past the default 64
  GiB, and the plan's warning for a host tier larger than the pool."""
  t0 = time.perf_counter()
  limits = {"limited": sizes.pool_limit_gb, "default": None}
  procs = {
    "limited": _spawn_pool_child(sizes.pool_limit_gb, sizes.pool_chunk, sizes.pool_max),
    "default": _spawn_pool_child(None, sizes.pool_default_chunk, sizes.pool_default_max),
  }
  out = {k: _pool_result(p, limits[k], t0, t0 + budget_s) for k, p in procs.items()}
  # The plan's side: a 7B model's host tier (fp32 master and both moments, 12 B a parameter)
  # exceeds the default pool; `offload` and `python -m optax_offload plan` print this warning.
  params = llama.CONFIGS["7B"].params
  host = 12 * params
  out["plan"] = {
    "model": "7B",
    "params": params,
    "host_bytes": host,
    "pool_bytes": plan_lib.gpu_pinned_pool(),
    "warning": plan_lib.pinned_pool_warning(host),
  }
  return out


# --------------------------------------------------------------------------------------------
# The run.


def _print_row(name: str, row: dict) -> None:
  if "error" in row:
    print(f"  {name:14s} ERROR {row['error'][:200]}", flush=True)
    return
  ratio = row.get("ratio")
  flag = " OFF BY >20%" if row.get("off_by_more_than_20pct") else ""
  print(
    f"  {name:14s} measured {row['measured_s'] * 1e3:9.2f} ms  modelled "
    f"{(row.get('modelled_s') or float('nan')) * 1e3:9.2f} ms  ratio "
    f"{ratio if ratio is not None else float('nan'):6.2f}"
    f"  (measured link: {row.get('ratio_measured_link', float('nan')):6.2f}){flag}",
    flush=True,
  )


def run(args) -> dict:
  sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
  if args.model:
    sizes = dataclasses.replace(sizes, model=llama.CONFIGS[args.model])
  if args.layers:
    sizes = dataclasses.replace(sizes, model=sizes.model.with_layers(args.layers))
  if args.micro_batch:
    sizes = dataclasses.replace(sizes, micro_batch=args.micro_batch)
  if args.window:
    sizes = dataclasses.replace(sizes, window=oo.parse_bytes(args.window, "--window"))
  budget = Budget(args.budget_s)
  device = jax.local_devices()[0]
  result = {
    "benchmark": "gpu",
    "backend": jax.default_backend(),
    "smoke": bool(args.smoke),
    "note": (
      "modelled_* figures are models of the compiled program (oo.timeline); every other time is "
      "measured on this backend"
      + ("" if jax.default_backend() == "gpu" else ": a CPU, so they say nothing about a GPU")
    ),
    "budget_s": args.budget_s,
    "sections": {},
  }
  rec = Recorder(result, args.out)
  sections = result["sections"]

  # device
  sections["device"] = desc = describe_device(device, args.host)
  hw = oo.hardware(desc["target"], args.host)
  rec.save()
  print(
    f"device: {desc['backend']} {desc['device_kind']!r}, {desc['memory_bytes_limit']} B;"
    f" model rates: {desc['target']} ({desc['target_why']})",
    flush=True,
  )

  # bandwidth
  bw = sections["bandwidth"] = {"rows": [], "skipped": []}
  for nbytes in sizes.bw_bytes:
    if budget.left("bandwidth") <= 0:
      bw["skipped"].append({"bytes": nbytes, "why": "time box"})
      continue
    row = _guarded(bandwidth, nbytes, device, sizes.bw_reps)
    bw["rows"].append(row)
    rec.save()
    if "error" not in row:
      print(
        f"bandwidth {row['bytes'] / MiB:8.0f} MiB (GB/s, best): "
        + ", ".join(
          f"{k} {row[k]['best_Bps'] / 1e9:.1f}"
          for k in row
          if isinstance(row[k], dict) and "best_Bps" in row[k]
        ),
        flush=True,
      )
  hw_link = None
  measured_rows = [r for r in bw["rows"] if "error" not in r]
  if measured_rows:
    big = max(measured_rows, key=lambda r: r["bytes"])
    hw_link = dataclasses.replace(
      hw,
      h2d_bandwidth=big["jit_h2d"]["best_Bps"],
      d2h_bandwidth=big["jit_d2h"]["best_Bps"],
    )
    bw["model_link"] = {"h2d_Bps": hw.h2d_bandwidth, "d2h_Bps": hw.d2h_bandwidth}
    bw["ratio_measured_vs_model_h2d"] = big["jit_h2d"]["best_Bps"] / hw.h2d_bandwidth
    bw["ratio_measured_vs_model_d2h"] = big["jit_d2h"]["best_Bps"] / hw.d2h_bandwidth
  rec.save()

  # pieces: fixed cost, before the steps, whose compile times are the unknown
  pieces = sections["pieces"] = {}
  print("pieces:", flush=True)
  for name, fn in (
    ("nvme_tier", lambda: nvme_piece(sizes, device, hw, hw_link, rec)),
    ("update_on_host", lambda: host_update_piece(sizes, device, hw, hw_link, rec)),
    ("pinned_pool", lambda: pinned_pool_piece(sizes, max(budget.left("pieces"), POOL_MIN_S))),
  ):
    # The pool's children get POOL_MIN_S even late, unless the whole run's time is spent.
    late = (
      budget.elapsed() > budget.seconds if name == "pinned_pool" else budget.left("pieces") <= 0
    )
    if late:
      pieces[name] = {"skipped": "time box"}
      rec.save()
      continue
    pieces[name] = _guarded(fn)
    rec.save()
    if name != "pinned_pool":
      _print_row(name, pieces[name])
    else:
      p = pieces[name]
      for which in ("limited", "default"):
        c = p.get(which, {}) if "error" not in p else p
        print(
          f"  pinned pool {which}: allocated {c.get('allocated_bytes')} B, failed "
          f"{c.get('failed')}: {(c.get('error') or '')[:160]}",
          flush=True,
        )

  # steps
  steps = sections["steps"] = {
    "tokens_per_step": sizes.accumulate * sizes.micro_batch * sizes.seq,
    "window_bytes": sizes.window,
    "rows": {},
    "skipped": [],
  }
  print(f"steps ({sizes.model.params:,} params, measured vs modelled):", flush=True)
  variants = args.variants.split(",")
  for variant in variants:
    if budget.left("steps") < (0 if args.smoke else 20):
      steps["skipped"].append({"variant": variant, "why": "time box"})
      rec.save()
      continue
    row = _guarded(run_variant, variant, sizes, device, hw, hw_link, rec)
    steps["rows"][variant] = row
    rec.save()
    _print_row(variant, row)

  rows = {f"steps.{k}": v for k, v in steps["rows"].items()}
  rows.update({f"pieces.{k}": v for k, v in pieces.items() if k != "pinned_pool"})
  result["flags"] = sorted(
    f"{name}: measured/modelled {row['ratio']:.2f}"
    for name, row in rows.items()
    if row.get("off_by_more_than_20pct")
  )
  for direction in ("h2d", "d2h"):
    ratio = bw.get(f"ratio_measured_vs_model_{direction}")
    if ratio is not None and abs(ratio - 1) > OFF_BY:
      result["flags"].append(f"bandwidth.{direction}: measured/modelled {ratio:.2f}")
  result["errors"] = sorted(
    [f"bandwidth.{r.get('bytes', i)}" for i, r in enumerate(bw["rows"]) if "error" in r]
    + [name for name, row in rows.items() if "error" in row]
    + [f"pieces.{k}" for k, v in pieces.items() if k == "pinned_pool" and "error" in v]
  )
  result["elapsed_s"] = budget.elapsed()
  rec.save()
  print(f"flags (|measured/modelled - 1| > {OFF_BY:.0%}): {result['flags']}")
  print(f"errors: {result['errors']}; {result['elapsed_s']:.0f} s; JSON: {args.out}")
  return result


def unavailable() -> str | None:
  """Why this run cannot measure here (no GPU), or None; ``python -m benchmarks`` skips it then."""
  if jax.default_backend() == "gpu":
    return None
  return (
    f"no GPU (JAX backend {jax.default_backend()!r}): `python -m benchmarks.gpu --smoke` runs "
    "its paths on the CPU"
  )


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    epilog=__doc__.split("\n\n", 1)[1].split("Sections,")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    allow_abbrev=False,
  )
  default_out = os.path.join(os.environ["OUT"], "gpu.json") if os.environ.get("OUT") else None
  parser.add_argument(
    "--out", default=default_out, help="JSON path (default: $OUT/gpu.json when $OUT is set)"
  )
  parser.add_argument("--smoke", action="store_true", help="every section at tiny sizes (CPU)")
  parser.add_argument("--budget-s", type=float, default=420.0, help="time box of the whole run")
  parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
  parser.add_argument("--model", default=None, choices=sorted(llama.CONFIGS), help="default 1B")
  parser.add_argument("--layers", type=int, default=None, help="override the model's depth")
  parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step")
  parser.add_argument("--window", default=None, help="offload window, e.g. 2GiB")
  parser.add_argument("--host", default="server", help="host profile of the model's rates")
  parser.add_argument("--pool-child", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.pool_child:
    chunk, most = (int(x) for x in args.pool_child.split(":"))
    out = _pool_child(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"), chunk, most)
    print(json.dumps(out))
    return out
  for v in args.variants.split(","):
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
  if unavailable() and not args.smoke:
    parser.error(unavailable())
  if args.out is None:
    args.out = "bench_out/gpu_smoke.json" if args.smoke else "bench_out/gpu.json"
  with contextlib.suppress(AttributeError):
    sys.stdout.reconfigure(line_buffering=True)
  return run(args)


if __name__ == "__main__":
  main()
