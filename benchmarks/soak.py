"""Soak test: a long run with host and NVMe tiers and periodic Orbax checkpoints; leaks show up here.

Trains ``offload(adamw)`` for ``--steps`` steps (a jitted, donating step; NVMe generation per step)
and saves a checkpoint (params + `optax_offload.OffloadSave`) every ``--every`` steps with an
asynchronous ``orbax.checkpoint.CheckpointManager`` keeping ``--keep`` checkpoints, so checkpoints are
written, hard-linked and deleted all along. It samples the process's resident memory (``VmRSS``),
open file descriptors (``/proc/self/fd``) and threads (``Threads`` of ``/proc/self/status``: Python's
and native ones).

Samples are taken every ``--sample-every`` steps after ``wait_until_finished`` and `sync_nvme` (no
save and no NVMe write in flight) and a ``gc.collect()``. The baseline is the median of the first few samples after ``--warmup``
checkpoint intervals (compilation, the first checkpoints and Orbax's thread pools are in place by
then), the end the median of the last few (RSS moves by a few MiB either way between samples):

* ``rss_growth`` = (RSS at the end - RSS at the baseline) / RSS at the baseline, and the
  least-squares slope of RSS against steps after the warm-up: raw ``VmRSS``, as the OS sees it;
* ``rss_trimmed_growth`` (target < 1%): the same for the RSS measured right after
  ``malloc_trim(0)``, which hands the pages glibc's malloc keeps free back to the OS (the raw RSS
  is read first; ``--no-trim`` skips the trim);
* ``heap_in_use_growth``: the bytes malloc has handed out and not got back (glibc ``mallinfo2``:
  ``uordblks + hblkhd``), what a native leak grows, whatever the allocator keeps besides;
* ``fd_growth`` (target 0): open file descriptors, end - baseline;
* ``thread_growth``: OS threads, end - baseline, and ``thread_growth_excluding_ts_pool`` (target
  0): the same without TensorStore's shared thread pool (``ts_pool_worker`` threads), which starts
  workers on demand and stops them after 20 s idle, so its size follows the recent I/O load.

Why trim, and why ``--malloc-arena-max 1`` (the default; ``0`` keeps glibc's default of 8 arenas
per core): every step allocates and frees multi-MiB buffers (NVMe reads, XLA buffers, callback
copies) from many threads. glibc serves them from per-thread arenas (its mmap threshold rises to
their size after the first free) and keeps what is freed: raw RSS creeps up by MiBs per 1000 steps
as more arenas reach their peak, and ``malloc_trim`` cannot return the top of a per-thread arena.
That is retention, not a leak (``heap_in_use`` stays flat), but it hides one. With one arena
``malloc_trim`` returns all of it and the trimmed RSS is steady to a MiB. The setting is made with
``mallopt(M_ARENA_MAX)`` before JAX starts its threads and is recorded in the result (``malloc``);
on this 2-core machine it did not change the step time measurably.

Quiet samples (the pass/fail figures): TensorStore's shared thread pool starts a worker whenever work
waits and none is idle, and a worker exits only after 20 s without work, so under a steady load the pool
keeps its high-water mark, and each of its threads keeps glibc's per-thread cache of freed chunks (counted
as in use). So the run also takes two samples after ``--idle-s`` (default 25 s) without saves or NVMe I/O:
one at the first sample step after the warm-up, one at the end. ``pass`` needs, between those two, RSS
growth < 1% (after ``malloc_trim``, unless ``--no-trim``), no growth in open file descriptors or OS threads
(all of them, TensorStore's pool included), and a bit-exact restore. The idle time is not counted in
``wall_s``.

``--no-save`` samples the same way but saves only at the end, to tell the checkpoints' share.

At the end the latest checkpoint is restored into a fresh state (another ``nvme_dir``) and compared
bit for bit with the state it was saved from. Not part of the test suite (opt-in):

    python benchmarks/soak.py --steps 2000 --out bench_out/soak.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import platform
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_offload as oo

logger = logging.getLogger("soak")


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1])
  raise KeyError(key)


class _MallInfo2(ctypes.Structure):
  _fields_ = [
    (name, ctypes.c_size_t)
    for name in (
      "arena",
      "ordblks",
      "smblks",
      "hblks",
      "hblkhd",
      "usmblks",
      "fsmblks",
      "uordblks",
      "fordblks",
      "keepcost",
    )
  ]


def _glibc():
  """glibc's malloc functions (mallinfo2 needs glibc >= 2.33), or None elsewhere."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
  except (OSError, AttributeError):
    return None
  return libc


_LIBC = _glibc()
_M_ARENA_MAX = -8  # mallopt parameter (glibc malloc.h)


def _ts_pool_threads() -> int:
  """Threads of TensorStore's shared pool, which starts and stops them with the I/O load."""
  n = 0
  for tid in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        n += f.read().strip() == "ts_pool_worker"
    except OSError:  # the thread exited
      pass
  return n


def sample(step: int, trim: bool = False) -> dict:
  """RSS (bytes), malloc's heap, open file descriptors and OS threads of this process now.

  With `trim`, also the RSS after ``malloc_trim(0)`` (read after the raw one).
  """
  s = {
    "step": step,
    "rss": _status("VmRSS") * 1024,
    "fds": len(os.listdir("/proc/self/fd")),
    "threads": _status("Threads"),
    "ts_pool_threads": _ts_pool_threads(),
  }
  if _LIBC is not None:
    info = _LIBC.mallinfo2()
    s["heap_in_use"] = info.uordblks + info.hblkhd
    s["heap_free"] = info.fordblks
    if trim:
      _LIBC.malloc_trim(0)
      s["rss_trimmed"] = _status("VmRSS") * 1024
  return s


def changes(baseline: dict, end: dict) -> dict:
  """Relative growth of RSS and malloc's heap, and the change in fds and threads, from `baseline` to `end`."""
  out = {
    f"{k}_growth": (end[k] - baseline[k]) / baseline[k]
    for k in ("rss", "rss_trimmed", "heap_in_use")
    if k in baseline
  }
  out["fd_growth"] = end["fds"] - baseline["fds"]
  out["thread_growth"] = end["threads"] - baseline["threads"]
  out["thread_growth_excluding_ts_pool"] = (end["threads"] - end["ts_pool_threads"]) - (
    baseline["threads"] - baseline["ts_pool_threads"]
  )
  return out


def describe(baseline: dict, end: dict) -> str:
  """One line: RSS (raw, after malloc_trim), malloc in use, fds and threads from `baseline` to `end`."""
  grown = changes(baseline, end)
  labels = {"rss": "RSS raw", "rss_trimmed": "after malloc_trim", "heap_in_use": "malloc in use"}
  parts = [
    f"{label} {baseline[k] / 2**20:.1f} -> {end[k] / 2**20:.1f} MiB ({100 * grown[k + '_growth']:+.2f}%)"
    for k, label in labels.items()
    if k in baseline
  ]
  parts.append(
    f"fds {baseline['fds']:g} -> {end['fds']:g}, threads {baseline['threads']:g} -> {end['threads']:g} "
    f"(TensorStore pool {baseline['ts_pool_threads']:g} -> {end['ts_pool_threads']:g})"
  )
  return ", ".join(parts)


def make_tree(total: float, leaves: int) -> dict:
  cols = 512
  rows = max(int(total / leaves / cols), 1)
  rng = np.random.default_rng(0)
  return {
    f"layer_{i:02d}": jnp.asarray(rng.normal(size=(rows, cols)) * 0.02, jnp.float32)
    for i in range(leaves)
  }


def make_grads(params: dict, step: int) -> dict:
  """Deterministic, cheap gradients that change every step."""
  scale = jnp.float32(1e-3 * (1 + step % 7))
  return jax.tree.map(lambda p: jnp.full_like(p, scale), params)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--every", type=int, default=50, help="checkpoint interval (steps)")
  parser.add_argument(
    "--no-save",
    action="store_true",
    help="sample at the same interval but save only at the end (to tell the checkpoints' share)",
  )
  parser.add_argument("--keep", type=int, default=2, help="checkpoints kept (max_to_keep)")
  parser.add_argument("--warmup", type=int, default=2, help="checkpoints before the baseline")
  parser.add_argument("--sample-every", type=int, default=10, help="sampling interval (steps)")
  parser.add_argument("--params", type=float, default=4e6, help="total parameters")
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument("--host-fraction", type=float, default=0.5, help="of the state on host")
  parser.add_argument("--dir", default=None, help="directory for nvme_dir and checkpoints")
  parser.add_argument(
    "--malloc-arena-max",
    type=int,
    default=1,
    help="glibc malloc arenas (mallopt M_ARENA_MAX) before JAX starts; 0: glibc's default",
  )
  parser.add_argument(
    "--no-trim", action="store_true", help="do not malloc_trim(0) after each raw RSS sample"
  )
  parser.add_argument(
    "--idle-s",
    type=float,
    default=25.0,
    help="quiet time before the baseline and end samples (TensorStore's pool threads exit after 20 s idle)",
  )
  parser.add_argument("--out", default="bench_out/soak.json")
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
  if args.malloc_arena_max and _LIBC is not None:
    _LIBC.mallopt(_M_ARENA_MAX, args.malloc_arena_max)
  trim = not args.no_trim and _LIBC is not None

  root = args.dir or tempfile.mkdtemp(prefix="oo_soak_")
  os.makedirs(root, exist_ok=True)
  params = jax.device_put(make_tree(args.params, args.leaves), jax.devices()[0])
  n = sum(p.size for p in jax.tree.leaves(params))
  state_bytes = 8 * n  # adamw: mu + nu in fp32
  host_limit = int(state_bytes * args.host_fraction)
  window = max(state_bytes // 4, 1)
  make_tx = lambda d: oo.offload(  # noqa: E731
    optax.adamw(1e-3), host_limit=host_limit, nvme_dir=d, window_bytes=window
  )
  tx = make_tx(os.path.join(root, "nvme"))
  state = tx.init(params)

  def train_step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(train_step, donate_argnums=(0, 1))
  options = ocp.CheckpointManagerOptions(max_to_keep=args.keep)
  mngr = ocp.CheckpointManager(os.path.join(root, "ckpt"), options=options)
  samples, step_times, save_times = [sample(0, trim)], [], []
  quiet: dict[str, dict] = {}

  def quiet_sample(step: int) -> dict:
    """A sample after `--idle-s` of quiet: no save, no NVMe I/O, TensorStore's idle pool threads gone."""
    mngr.wait_until_finished()
    oo.sync_nvme(state)
    gc.collect()
    time.sleep(args.idle_s)
    return sample(step, trim)

  baseline_step = (args.warmup * args.every // args.sample_every + 1) * args.sample_every
  start = time.perf_counter()
  for t in range(args.steps):
    t0 = time.perf_counter()
    params, state = step(params, state, make_grads(params, t))
    jax.block_until_ready(state)
    step_times.append(time.perf_counter() - t0)
    last = t + 1 == args.steps
    if ((t + 1) % args.every == 0 and not args.no_save) or last:
      t0 = time.perf_counter()
      mngr.save(
        t + 1,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=oo.OffloadSave(state)
        ),
      )
      save_times.append(time.perf_counter() - t0)  # the blocking part
    if t + 1 == baseline_step and not last:
      quiet["baseline"] = quiet_sample(t + 1)
    if (t + 1) % args.sample_every == 0 and not last:
      mngr.wait_until_finished()  # no save in flight: its threads and files are gone
      oo.sync_nvme(state)  # no NVMe write in flight either
      gc.collect()
      time.sleep(0.1)  # let finished threads exit
      samples.append(sample(t + 1, trim))
      if (t + 1) % (10 * args.sample_every) == 0:
        logger.info("step %d: %s", t + 1, samples[-1])
  mngr.wait_until_finished()
  wall = time.perf_counter() - start - (args.idle_s if "baseline" in quiet else 0)
  quiet["end"] = quiet_sample(args.steps)
  # Baseline: the first `window` samples after the warm-up; end: the last `window` (medians, as
  # RSS moves by a few MiB either way from one sample to the next).
  after_warmup = [x for x in samples if x["step"] > args.warmup * args.every]
  window = max(1, min(5, len(after_warmup) // 3))
  baseline = {k: float(np.median([x[k] for x in after_warmup[:window]])) for k in samples[0]}
  end = {k: float(np.median([x[k] for x in after_warmup[-window:]])) for k in samples[0]}
  steps_axis = np.asarray([x["step"] for x in after_warmup], float)

  def slope(key: str) -> float | None:
    if key not in samples[0] or len(after_warmup) < 2:
      return None
    return 1000 * float(np.polyfit(steps_axis, [x[key] for x in after_warmup], 1)[0])

  saved = (mngr.latest_step(), oo.to_inner(state), params)
  footprint = oo.footprint(state)

  # The latest checkpoint restores bit for bit into a fresh state with another nvme_dir.
  tx2 = make_tx(os.path.join(root, "nvme_restore"))
  target = tx2.init(jax.tree.map(jnp.zeros_like, params))
  restored = mngr.restore(
    saved[0],
    args=ocp.args.Composite(
      params=ocp.args.StandardRestore(params), opt_state=oo.OffloadRestore(target)
    ),
  )
  restored_inner = oo.to_inner(restored["opt_state"])
  exact = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(saved[1]), jax.tree.leaves(restored_inner))
  )
  manifest = mngr.item_metadata(saved[0])["opt_state"]
  mngr.close()
  oo.close_nvme(state)
  oo.close_nvme(restored["opt_state"])
  if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)

  result = {
    "benchmark": "soak",
    "backend": jax.default_backend(),
    "machine": platform.machine(),
    "steps": args.steps,
    "every": args.every,
    "checkpoints": len(save_times),
    "params": n,
    "state_bytes": state_bytes,
    "footprint": footprint,
    "host_limit": host_limit,
    "nvme_transfer": manifest["nvme_transfer"],
    "wall_s": wall,
    "step_s_median": float(np.median(step_times)),
    "save_blocking_s_median": float(np.median(save_times)),
    "malloc": {
      "glibc": _LIBC is not None,
      "arena_max": args.malloc_arena_max if _LIBC is not None else None,
      "trim": trim,
    },
    "baseline": baseline,
    "end": end,
    **changes(baseline, end),
    "rss_slope_bytes_per_1000_steps": slope("rss"),
    "rss_trimmed_slope_bytes_per_1000_steps": slope("rss_trimmed"),
    "heap_in_use_slope_bytes_per_1000_steps": slope("heap_in_use"),
    "rss_max": max(x["rss"] for x in samples),
    "fds_max_after_warmup": max(x["fds"] for x in after_warmup),
    "threads_max_after_warmup": max(x["threads"] for x in after_warmup),
    "ts_pool_threads_max": max(x["ts_pool_threads"] for x in samples),
    "restore_bit_exact": bool(exact),
    "samples": samples,
  }
  rss_key = "rss_trimmed" if trim else "rss"
  line = (
    f"{args.steps} steps, {len(save_times)} checkpoints ({result['nvme_transfer']}), {wall:.0f} s: "
  )
  line += describe(baseline, end) + f", restore bit-exact: {exact}"
  if "baseline" in quiet:
    result["quiet"] = {"idle_s": args.idle_s, **quiet, **changes(quiet["baseline"], quiet["end"])}
    judged, threads_key = result["quiet"], "thread_growth"
    line += (
      f"; after {args.idle_s:g} s quiet at step {quiet['baseline']['step']} and at the end: "
      + describe(quiet["baseline"], quiet["end"])
    )
  else:  # too short a run for a quiet baseline after the warm-up
    judged, threads_key = result, "thread_growth_excluding_ts_pool"
  result["pass"] = (
    judged[rss_key + "_growth"] < 0.01
    and judged["fd_growth"] <= 0
    and judged[threads_key] <= 0
    and result["restore_bit_exact"]
  )
  line += f"; pass: {result['pass']}"
  print(line)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
