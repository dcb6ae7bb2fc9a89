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
import logging
import os
import platform
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_offload as oo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

logger = logging.getLogger("soak")


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
    "rss": _common.rss_bytes(),
    "fds": len(os.listdir("/proc/self/fd")),
    "threads": _common.proc_status("Threads"),
    "ts_pool_threads": _ts_pool_threads(),
  }
  if _LIBC is not None:
    info = _LIBC.mallinfo2()
    s["heap_in_use"] = info.uordblks + info.hblkhd
    s["heap_free"] = info.fordblks
    if trim:
      _LIBC.malloc_trim(0)
      s["rss_trimmed"] = _common.rss_bytes()
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


def make_grads(params: dict, step: int) -> dict:
  """Deterministic, cheap gradients that change every step."""
  scale = jnp.float32(1e-3 * (1 + step % 7))
  return jax.tree.map(lambda p: jnp.full_like(p, scale), params)


def _parser() -> argparse.ArgumentParser:
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
  return parser


class _Soak:
  """The run: a jitted step, the offloaded state, the checkpoint manager, and what is sampled."""

  def __init__(self, args, root: str, trim: bool):
    self.args, self.root, self.trim = args, root, trim
    self.params = jax.device_put(
      _common.make_tree(args.params, args.leaves, cols=512), jax.devices()[0]
    )
    self.n = _common.num_params(self.params)
    self.state_bytes = 8 * self.n  # adamw: mu + nu in fp32
    self.host_limit = int(self.state_bytes * args.host_fraction)
    self.window = max(self.state_bytes // 4, 1)
    tx = self.make_tx(os.path.join(root, "nvme"))
    self.state = tx.init(self.params)
    self.step = _common.make_step(tx)
    options = ocp.CheckpointManagerOptions(max_to_keep=args.keep)
    self.mngr = ocp.CheckpointManager(os.path.join(root, "ckpt"), options=options)
    self.samples, self.step_times, self.save_times = [sample(0, trim)], [], []
    self.quiet: dict[str, dict] = {}

  def make_tx(self, nvme_dir: str):
    return oo.offload(
      optax.adamw(1e-3), host_limit=self.host_limit, nvme_dir=nvme_dir, window_bytes=self.window
    )

  def quiet_sample(self, step: int) -> dict:
    """A sample after `--idle-s` of quiet: no save, no NVMe I/O, TensorStore's idle pool threads gone."""
    self.mngr.wait_until_finished()
    oo.sync_nvme(self.state)
    gc.collect()
    time.sleep(self.args.idle_s)
    return sample(step, self.trim)

  def save(self, step: int) -> None:
    t0 = time.perf_counter()
    self.mngr.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(self.params), opt_state=oo.OffloadSave(self.state)
      ),
    )
    self.save_times.append(time.perf_counter() - t0)  # the blocking part

  def train(self) -> float:
    """Runs every step, saving and sampling on the way; returns the wall time, idle time excluded."""
    args = self.args
    baseline_step = (args.warmup * args.every // args.sample_every + 1) * args.sample_every
    start = time.perf_counter()
    for t in range(args.steps):
      t0 = time.perf_counter()
      self.params, self.state = self.step(self.params, self.state, make_grads(self.params, t))
      jax.block_until_ready(self.state)
      self.step_times.append(time.perf_counter() - t0)
      last = t + 1 == args.steps
      if ((t + 1) % args.every == 0 and not args.no_save) or last:
        self.save(t + 1)
      if t + 1 == baseline_step and not last:
        self.quiet["baseline"] = self.quiet_sample(t + 1)
      if (t + 1) % args.sample_every == 0 and not last:
        self.mngr.wait_until_finished()  # no save in flight: its threads and files are gone
        oo.sync_nvme(self.state)  # no NVMe write in flight either
        gc.collect()
        time.sleep(0.1)  # let finished threads exit
        self.samples.append(sample(t + 1, self.trim))
        if (t + 1) % (10 * args.sample_every) == 0:
          logger.info("step %d: %s", t + 1, self.samples[-1])
    self.mngr.wait_until_finished()
    wall = time.perf_counter() - start - (args.idle_s if "baseline" in self.quiet else 0)
    self.quiet["end"] = self.quiet_sample(args.steps)
    return wall

  def restore_is_exact(self) -> tuple[bool, dict]:
    """Restores the latest checkpoint into a fresh state with another nvme_dir; whether it is bit
    for bit the state it was saved from, and the checkpoint's metadata."""
    latest, inner = self.mngr.latest_step(), oo.to_inner(self.state)
    target = self.make_tx(os.path.join(self.root, "nvme_restore")).init(
      jax.tree.map(jnp.zeros_like, self.params)
    )
    restored = self.mngr.restore(
      latest,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(self.params), opt_state=oo.OffloadRestore(target)
      ),
    )
    exact = all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(inner), jax.tree.leaves(oo.to_inner(restored["opt_state"])))
    )
    manifest = self.mngr.item_metadata(latest)["opt_state"]
    oo.close_nvme(restored["opt_state"])
    return exact, manifest


def _growth(samples: list[dict], args) -> dict:
  """Baseline and end (medians of the first and last few samples after the warm-up), their
  changes, the slopes per 1000 steps and the largest values."""
  # Medians, as RSS moves by a few MiB either way from one sample to the next.
  after_warmup = [x for x in samples if x["step"] > args.warmup * args.every]
  window = max(1, min(5, len(after_warmup) // 3))
  baseline = {k: float(np.median([x[k] for x in after_warmup[:window]])) for k in samples[0]}
  end = {k: float(np.median([x[k] for x in after_warmup[-window:]])) for k in samples[0]}
  steps_axis = np.asarray([x["step"] for x in after_warmup], float)

  def slope(key: str) -> float | None:
    if key not in samples[0] or len(after_warmup) < 2:
      return None
    return 1000 * float(np.polyfit(steps_axis, [x[key] for x in after_warmup], 1)[0])

  return {
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
  }


def main(argv=None) -> dict:
  args = _parser().parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
  if args.malloc_arena_max and _LIBC is not None:
    _LIBC.mallopt(_M_ARENA_MAX, args.malloc_arena_max)
  trim = not args.no_trim and _LIBC is not None

  root = args.dir or tempfile.mkdtemp(prefix="oo_soak_")
  os.makedirs(root, exist_ok=True)
  run = _Soak(args, root, trim)
  wall = run.train()
  footprint = oo.footprint(run.state)
  exact, manifest = run.restore_is_exact()
  run.mngr.close()
  oo.close_nvme(run.state)
  if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)

  growth = _growth(run.samples, args)
  result = {
    "benchmark": "soak",
    "backend": jax.default_backend(),
    "machine": platform.machine(),
    "steps": args.steps,
    "every": args.every,
    "checkpoints": len(run.save_times),
    "params": run.n,
    "state_bytes": run.state_bytes,
    "footprint": footprint,
    "host_limit": run.host_limit,
    "nvme_transfer": manifest["nvme_transfer"],
    "wall_s": wall,
    "step_s_median": float(np.median(run.step_times)),
    "save_blocking_s_median": float(np.median(run.save_times)),
    "malloc": {
      "glibc": _LIBC is not None,
      "arena_max": args.malloc_arena_max if _LIBC is not None else None,
      "trim": trim,
    },
    **growth,
    "restore_bit_exact": bool(exact),
    "samples": run.samples,
  }
  print(_verdict(result, run.quiet, trim, args))
  return _common.write_json(result, args.out)


def _verdict(result: dict, quiet: dict, trim: bool, args) -> str:
  """Sets ``result["pass"]`` (and ``result["quiet"]``); returns the summary line."""
  rss_key = "rss_trimmed" if trim else "rss"
  line = (
    f"{args.steps} steps, {result['checkpoints']} checkpoints ({result['nvme_transfer']}), "
    f"{result['wall_s']:.0f} s: "
  )
  line += describe(result["baseline"], result["end"])
  line += f", restore bit-exact: {result['restore_bit_exact']}"
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
  return line + f"; pass: {result['pass']}"


if __name__ == "__main__":
  main()
