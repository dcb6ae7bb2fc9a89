"""NVMe tier of `offload(adamw)`: step time against the disk, peak RSS against the documented bound.

One run measures, for each state size, in a fresh subprocess (so peak RSS belongs to that size alone):

* the disk's raw sequential bandwidth: ``O_DIRECT`` writes (then ``fdatasync``) and reads of a file the
  size of the NVMe state, from page-aligned (mmap) buffers on a few threads, and the CPU time that took;
* the jitted NVMe-tier step (params and state donated, ``optax.adamw``, grads held fixed), with nearly all
  of the Adam state on NVMe (``host_limit`` = the state of ``--host-leaves`` leaves);
* the store alone (``--store-reps``, after the steps): the same leaves written as one generation
  (put, commit, durable) and read back group by group (fetch, with prefetch), without JAX, each
  after its own raw-disk measurement: the data path against the disk, in GB/s and CPU-s per GB.

Raw bandwidth and tier step alternate (raw, step, raw, step, ...), so disk noise from other tenants hits
both alike; each step is compared with the raw figures measured just before it. Before each timed step the
state's files are evicted from the page cache (``--cache fadvise``: ``POSIX_FADV_DONTNEED`` on the store's
files, after the previous step's data is durable; ``--cache drop``: ``sync; echo 3 >
/proc/sys/vm/drop_caches``, root only, whole machine), so the step reads from the disk, not from memory.
A step is timed from the call until its results are ready *and* its writes are durable
(`optax_offload.sync_nvme`): what the disk must do for one step, no overlap with the next one.

Figures (JSON), per size and for the ``--state-gb`` size as the headline:

* ``io_lower_bound_s`` = bytes read / read bandwidth + bytes written / write bandwidth, with the bytes the
  store actually read and wrote during the step (its ``stats``); ``step_over_io_bound`` = step time / that
  (target <= 1.15);
* ``cpu_s_per_gb_moved`` = the step's process CPU time (less this benchmark's RSS sampler thread)
  / GB read and written (the update's own
  arithmetic and JAX's callback copies included), ``io_cpu_s_per_gb_moved`` = the same less the CPU
  time of the same update with the state in host RAM (what the NVMe tier adds; target <= 0.3), and
  ``raw_cpu_s_per_gb`` the raw disk's; ``store_cpu_s_per_gb_moved``: the CPU time of the store's own
  threads (chunk I/O, writer, prefetcher, committer, fsync; from ``/proc/self/task``) per GB moved,
  the rest being the update's and JAX's (its callbacks copy each fetched group into XLA's buffers
  and each put group out of them); ``tier_read_GBps`` / ``tier_write_GBps``: bytes the store read
  or wrote / the time its reads or writes took (they overlap each other and the update);
* ``disk_busy_over_step``: the part of the step during which the store had a read, write or commit
  under way (its ``disk_busy_ns``); near 1, the step waits for the disk, not for the CPU, and
  ``tier_busy_GBps`` is what its reads and writes, overlapped, moved together meanwhile (the I/O
  bound assumes the raw disk's rates, reading then writing);
* ``moved_over_raw`` = (NVMe state bytes read + written, nominally 2 x NVMe bytes) per second / the raw
  bandwidth of that read/write mix (target >= 0.85);
* ``rss_over_bound`` = peak RSS during the NVMe steps / (host_limit + params + grads + the tier's
  ``host_buffer_bound``: the store's buffers and the put copy a CPU callback fills meanwhile)
  (target <= 1.10); the peak is the kernel's ``VmHWM``, reset with
  ``/proc/self/clear_refs`` after the warm-up step, cross-checked by a thread sampling ``VmRSS``;
* the store's ``stats`` (prefetch hits, misses, waits) per step, and the step's process CPU time and
  minor page faults (first touches of fresh memory): when CPU time is close to the step time, the step
  is CPU-bound, not disk-bound (the page-cache ``warm_cache_step_s`` then matches the cold one);
* note: the first group of the next generation is prefetched at the end of a step, from the page cache
  it was just written to, so about 1/groups of each step's reads do not come from the disk;
* ``host_tier_step_s``: the same update with the whole state in host RAM (same groups), and
  ``step_over_io_bound_plus_compute`` = step time / (I/O bound + that): on a CPU-only machine the
  update's arithmetic and the I/O's CPU work share the same cores, so this says how much the NVMe
  tier adds beyond "compute, then move the bytes";
* across sizes: a least-squares line of step time against NVMe state bytes (slope, intercept, R^2).

    python benchmarks/nvme_tier.py --state-gb 2 --sizes 0.5,1,2 --out bench_out/nvme_tier.json

Sizes are decimal GB of Adam state (mu + nu, fp32: 8 bytes per parameter). Data goes under ``--dir``
(default ``bench_out/nvme_data``; put it on the disk under test, not on tmpfs) and is deleted afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402
from benchmarks._common import GB  # noqa: E402

# -- the tier step -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tier:
  """One state size's NVMe-tier run: the step, its arrays, and what init and warm-up took."""

  step: Any
  params: Any
  grads: Any
  state: Any
  store: Any
  raw: _common.RawDisk
  footprint: dict
  directory: str
  params_count: int
  state_bytes: int
  host_limit: int
  window: int
  init_s: float
  warmup_s: float


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
  keep = ("buffer_bytes", "peak_buffer_bytes")
  return {k: (v if k in keep else v - before.get(k, 0)) for k, v in after.items()}


def _start(state_gb: float, args) -> _Tier:
  """Builds the tree and the tier in a fresh directory, checks the disk, inits and warms up."""
  import jax
  import jax.numpy as jnp
  import optax

  import optax_offload as oo

  params = _common.make_tree(state_gb * GB / 8, args.leaves, jnp.float32, random=False)
  grads = _common.fixed_grads(params)
  jax.block_until_ready((params, grads))
  n = _common.num_params(params)
  leaf_state = 8 * next(iter(params.values())).size
  state_bytes = 8 * n
  host_limit = args.host_leaves * leaf_state
  window = max(2 * state_bytes // args.groups, 1)
  directory = os.path.join(args.dir, f"state_{state_gb:g}gb")
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  # store: up to 4 generations; raw file: 1 more; the store alone: 2 more
  need = (4 + 1 + (2 if args.store_reps else 0)) * state_bytes
  if _common.disk_free_bytes(directory) < need:
    raise SystemExit(
      f"{directory}: needs {need / GB:.1f} GB free, has "
      f"{_common.disk_free_bytes(directory) / GB:.1f}."
    )
  raw = _common.RawDisk(directory, args.block_mib << 20, args.threads)
  tx = oo.offload(
    optax.adamw(1e-3),
    host_limit=host_limit,
    nvme_dir=os.path.join(directory, "store"),
    window_bytes=window,
    nvme_options=_nvme_options(args),
  )
  state, store, init_s = _common.init_nvme(tx, params)
  fp = oo.footprint(state)
  step = _common.make_step(tx)
  t0 = time.perf_counter()
  params, state = step(params, state, grads)  # compile, warm up
  jax.block_until_ready((params, state))
  oo.sync_nvme(state)
  warmup_s = time.perf_counter() - t0
  return _Tier(
    step=step,
    params=params,
    grads=grads,
    state=state,
    store=store,
    raw=raw,
    footprint=fp,
    directory=directory,
    params_count=n,
    state_bytes=state_bytes,
    host_limit=host_limit,
    window=window,
    init_s=init_s,
    warmup_s=warmup_s,
  )


def _nvme_options(args) -> dict:
  import optax_offload as oo

  options = {
    "prefetch_depth": args.prefetch_depth,
    "write_depth": args.write_depth,
    "chunk_bytes": args.chunk_mib << 20,
    "io_threads": args.io_threads,
    "direct_io": not args.no_direct_io,
  }
  # Only the options this version of the store has (to run this against older ones).
  fields = {f.name for f in dataclasses.fields(oo.NvmeOptions)}
  return {k: v for k, v in options.items() if k in fields}


def _timed_rep(t: _Tier, cache: str) -> dict:
  """One (raw disk, evict, step) triple: the step's figures against the disk measured just before."""
  import optax_offload as oo

  nvme = t.footprint["nvme"]
  disk = _raw(t, nvme)
  oo.sync_nvme(t.state)
  _common.evict_cache(t.directory, cache)
  before, threads = t.store.stats, _thread_cpu()
  t.params, t.state, rec = _common.timed_step(t.step, t.params, t.state, t.grads, oo.sync_nvme)
  stats = _delta(t.store.stats, before)
  by_thread = _delta_cpu(_thread_cpu(), threads)
  # The benchmark's own RSS sampler (a /proc read every 5 ms) is not the step's work.
  rec["sampler_cpu_s"] = by_thread.pop("rss-sampler", 0.0)
  rec["cpu_s"] -= rec["sampler_cpu_s"]
  bound = stats["bytes_read"] / disk["read_Bps"] + stats["bytes_written"] / disk["write_Bps"]
  nominal = nvme / disk["read_Bps"] + nvme / disk["write_Bps"]
  moved = (stats["bytes_read"] + stats["bytes_written"]) / GB
  return {
    "raw_write_GBps": disk["write_Bps"] / GB,
    "raw_read_GBps": disk["read_Bps"] / GB,
    "raw_cpu_s_per_gb": disk["cpu_s_per_gb"],
    **rec,
    "io_lower_bound_s": bound,
    "step_over_io_bound": rec["step_s"] / bound,
    "moved_over_raw": nominal / rec["step_s"],
    "moved_gb": moved,
    "step_cpu_s_per_gb_moved": rec["cpu_s"] / moved,
    "cpu_s_by_thread": by_thread,
    "store_cpu_s_per_gb_moved": sum(v for k, v in by_thread.items() if k.startswith("nvme"))
    / moved,
    # None with a store that does not time its reads and writes (to run this against older ones).
    "tier_read_GBps": _rate(stats["bytes_read"], stats.get("read_ns")),
    "tier_write_GBps": _rate(stats["bytes_written"], stats.get("write_ns")),
    # The disk at work (a read, write or commit under way) / the step: near 1, the step waits for
    # the disk, and the tier's reads and writes together move `tier_busy_GBps` while it works.
    "disk_busy_over_step": stats.get("disk_busy_ns", 0) / 1e9 / rec["step_s"] or None,
    "tier_busy_GBps": _rate(
      stats["bytes_read"] + stats["bytes_written"], stats.get("disk_busy_ns")
    ),
    "stats": stats,
  }


def _thread_cpu() -> dict[tuple[int, str], float]:
  """CPU seconds of each thread of this process so far, by (native id, name); {} if unknown."""
  import threading

  names = {t.native_id: t.name for t in threading.enumerate()}
  out = {}
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return out
  tick = os.sysconf("SC_CLK_TCK")
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
      with open(f"/proc/self/task/{tid}/comm") as f:
        comm = f.read().strip()
    except OSError:  # the thread ended
      continue
    out[(int(tid), names.get(int(tid), comm))] = (int(fields[11]) + int(fields[12])) / tick
  return out


def _delta_cpu(after: dict, before: dict) -> dict[str, float]:
  """CPU seconds per kind of thread between two `_thread_cpu` readings (``nvme-read-3`` ->
  ``nvme-read``; threads named by the OS, e.g. XLA's, by that name)."""
  out: dict[str, float] = {}
  for (tid, name), cpu in after.items():
    kind = name.rstrip("0123456789").rstrip("-") if name.startswith("nvme") else name
    out[kind] = out.get(kind, 0.0) + cpu - before.get((tid, name), 0.0)
  return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}


def _rate(nbytes: int, ns: int) -> float | None:
  return nbytes / GB / (ns / 1e9) if ns else None


def _raw(t: _Tier, nbytes: int) -> dict:
  """The raw disk (O_DIRECT write, fdatasync, read of `nbytes`), with its CPU time per GB moved."""
  c0 = _common.cpu_seconds()
  disk = t.raw.measure(nbytes)
  disk["cpu_s_per_gb"] = (_common.cpu_seconds() - c0) / (2 * disk["bytes"] / GB)
  return disk


def _tier_buffer_bound(t: _Tier) -> int:
  from optax_offload._src import nvme_tier

  return nvme_tier.lookup(t.state.nvme_store).host_buffer_bound


def _store_only(t: _Tier, args) -> list[dict]:
  """The store alone, after the steps: write one generation, read it back; raw disk before each."""
  import numpy as np

  from optax_offload._src import nvme

  if not args.store_reps:
    return []
  groups = t.store.groups
  arrays = [[np.full(s.shape, 0.25, s.dtype) for s in group] for group in groups]
  nbytes = sum(a.nbytes for group in arrays for a in group)
  directory = os.path.join(t.directory, "store_only")
  out = []
  with nvme.NvmeStore(directory, groups, **_nvme_options(args)) as store:
    for _ in range(args.store_reps):
      disk = _raw(t, nbytes)
      generation = store.new_generation()
      c0, t0 = _common.cpu_seconds(), time.perf_counter()
      for g, group in enumerate(arrays):
        store.put(g, generation, group)
      store.commit(generation)
      store.sync()
      write_s, write_cpu = time.perf_counter() - t0, _common.cpu_seconds() - c0
      _common.evict_cache(directory, args.cache)
      c0, t0 = _common.cpu_seconds(), time.perf_counter()
      for g in range(len(groups)):
        store.fetch(g, generation)  # dropped at once: its buffers are read into again
      read_s, read_cpu = time.perf_counter() - t0, _common.cpu_seconds() - c0
      out.append(
        {
          "bytes": nbytes,
          "raw_write_GBps": disk["write_Bps"] / GB,
          "raw_read_GBps": disk["read_Bps"] / GB,
          "raw_cpu_s_per_gb": disk["cpu_s_per_gb"],
          "write_GBps": nbytes / GB / write_s,
          "read_GBps": nbytes / GB / read_s,
          "write_cpu_s_per_gb": write_cpu / (nbytes / GB),
          "read_cpu_s_per_gb": read_cpu / (nbytes / GB),
          "write_over_raw": (nbytes / write_s) / disk["write_Bps"],
          "read_over_raw": (nbytes / read_s) / disk["read_Bps"],
        }
      )
  shutil.rmtree(directory, ignore_errors=True)
  return out


def _warm_step_s(t: _Tier, steps: int) -> float | None:
  """Seconds per step back to back, no eviction: what the page cache gives when the state fits."""
  import jax

  import optax_offload as oo

  if not steps:
    return None
  t0 = time.perf_counter()
  for _ in range(steps):
    t.params, t.state = t.step(t.params, t.state, t.grads)
  jax.block_until_ready((t.params, t.state))
  oo.sync_nvme(t.state)
  return (time.perf_counter() - t0) / steps


def run_size(state_gb: float, args) -> dict:
  """One state size, in this process: init, warm-up, then `args.reps` x (raw disk, evict, step)."""
  import jax
  import jax.numpy as jnp
  import optax

  import optax_offload as oo

  jax.block_until_ready(jnp.zeros(8) + 1)  # start the runtime before the baseline
  rss_runtime = _common.rss_bytes()
  t = _start(state_gb, args)
  rss_before_steps = _common.rss_bytes()
  peak_before_steps = _common.peak_rss_bytes()  # includes init and compilation
  peak_reset = _common.reset_peak_rss()
  with _common.RssSampler() as sampler:
    reps = [_timed_rep(t, args.cache) for _ in range(args.reps)]
  peak = _common.peak_rss_bytes() if peak_reset else sampler.peak
  warm = _warm_step_s(t, args.warm_steps)
  # Diagnostic, after every timed step: how much of the RSS is live, and how much glibc keeps freed.
  rss = {
    "runtime": rss_runtime,
    "before_steps": rss_before_steps,
    "peak_steps": peak,
    "peak_source": "VmHWM after clear_refs" if peak_reset else "VmRSS sampler",
    "peak_sampled": sampler.peak,
    "peak_init_and_warmup": peak_before_steps,
    "end": _common.rss_bytes(),
    "end_after_malloc_trim": _common.rss_after_malloc_trim(),
    "params": _common.tree_bytes(t.params),
    "grads": _common.tree_bytes(t.grads),
    # The tier's: the store's buffers and the put copy a CPU callback fills meanwhile.
    "host_buffer_bound": _tier_buffer_bound(t),
    "store_host_buffer_bound": t.store.host_buffer_bound,
  }
  rss["bound"] = t.host_limit + rss["params"] + rss["grads"] + rss["host_buffer_bound"]
  rss["bound_plus_runtime_and_window"] = rss["bound"] + rss_runtime + t.window
  stats_total = t.store.stats
  oo.close_nvme(t.state)
  t.state = None
  # The same update with the whole state in host RAM (same groups): the compute the NVMe-tier step
  # does besides its I/O. On a CPU-only machine both share its cores.
  host = oo.offload(optax.adamw(1e-3), window_bytes=t.window)
  host_runs = _common.time_variants({"host": host}, t.params, t.grads, args.reps, copy=False)
  host_run = host_runs["host"]
  result = _result(
    state_gb, args, t, reps, warm, rss, stats_total, host_run.median(), host_run.median("cpu_s")
  )
  del host_runs, host_run
  result["store_only"] = _store_only(t, args)
  shutil.rmtree(t.directory, ignore_errors=True)
  return result


def _result(
  state_gb, args, t: _Tier, reps, warm, rss, stats_total, host_step_s, host_cpu_s
) -> dict:
  """The figures of one size: medians over `reps`, RSS against its bound, the host-tier step."""

  def med(key):
    values = [r[key] for r in reps if r[key] is not None]
    return statistics.median(values) if values else None

  fp, peak = t.footprint, rss["peak_steps"]
  return {
    "state_gb": state_gb,
    "params": t.params_count,
    "leaves": args.leaves,
    "groups": len(t.store.groups),
    "state_bytes": t.state_bytes,
    "footprint": fp,
    "host_limit": t.host_limit,
    "window_bytes": t.window,
    "init_s": t.init_s,
    "warmup_step_s": t.warmup_s,
    "reps": reps,
    "step_s": med("step_s"),
    "step_return_s": med("step_return_s"),
    "cpu_s": med("cpu_s"),
    "cpu_s_per_gb_moved": med("cpu_s") / (2 * fp["nvme"] / GB),
    "io_cpu_s_per_gb_moved": (med("cpu_s") - host_cpu_s) / (2 * fp["nvme"] / GB),
    "host_tier_cpu_s": host_cpu_s,
    "io_lower_bound_s": med("io_lower_bound_s"),
    "raw_write_GBps": med("raw_write_GBps"),
    "raw_read_GBps": med("raw_read_GBps"),
    "raw_cpu_s_per_gb": med("raw_cpu_s_per_gb"),
    "store_cpu_s_per_gb_moved": med("store_cpu_s_per_gb_moved"),
    "tier_read_GBps": med("tier_read_GBps"),
    "tier_write_GBps": med("tier_write_GBps"),
    "disk_busy_over_step": med("disk_busy_over_step"),
    "tier_busy_GBps": med("tier_busy_GBps"),
    "step_over_io_bound": med("step_over_io_bound"),
    "moved_over_raw": med("moved_over_raw"),
    "warm_cache_step_s": warm,
    "rss": rss,
    "rss_over_bound": peak / rss["bound"],
    "rss_over_bound_plus_runtime_and_window": peak / rss["bound_plus_runtime_and_window"],
    "store_stats_total": stats_total,
    "host_tier_step_s": host_step_s,
    "step_over_io_bound_plus_compute": med("step_s") / (med("io_lower_bound_s") + host_step_s),
  }


# -- driver --------------------------------------------------------------------------------------------


def fit_line(xs, ys) -> dict[str, float]:
  """Least-squares y = slope * x + intercept, and R^2."""
  mx, my = statistics.fmean(xs), statistics.fmean(ys)
  sxx = sum((x - mx) ** 2 for x in xs)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
  intercept = my - slope * mx
  ss_res = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
  ss_tot = sum((y - my) ** 2 for y in ys)
  return {"slope": slope, "intercept": intercept, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def _child(argv, state_gb: float) -> dict:
  """Runs one size in a fresh interpreter, so its peak RSS is its own."""
  with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      *argv,
      "--_child",
      str(state_gb),
      "--_child-out",
      out.name,
    ]
    subprocess.run(cmd, check=True)
    return json.load(out)


def _print_size(r: dict) -> None:
  gib = 1 << 30
  print(
    f"state {r['state_gb']:g} GB ({r['footprint']['nvme'] / GB:.2f} GB on NVMe, {r['groups']} groups): "
    f"step {r['step_s']:.2f} s (returns after {r['step_return_s']:.2f} s), I/O bound "
    f"{r['io_lower_bound_s']:.2f} s -> step/bound {r['step_over_io_bound']:.2f}, moved/raw "
    f"{r['moved_over_raw']:.2f}; raw write {r['raw_write_GBps']:.2f} GB/s, read {r['raw_read_GBps']:.2f} GB/s"
  )
  rss = r["rss"]
  print(
    f"  peak RSS {rss['peak_steps'] / gib:.2f} GiB / bound {rss['bound'] / gib:.2f} GiB = "
    f"{r['rss_over_bound']:.2f} (runtime {rss['runtime'] / gib:.2f} GiB, window "
    f"{r['window_bytes'] / gib:.2f} GiB); warm-cache step "
    + (f"{r['warm_cache_step_s']:.2f} s" if r["warm_cache_step_s"] else "-")
  )
  if rss.get("end_after_malloc_trim"):
    print(
      f"  RSS before the timed steps {rss['before_steps'] / gib:.2f} GiB; after them "
      f"{rss['end'] / gib:.2f} GiB, {rss['end_after_malloc_trim'] / gib:.2f} GiB after malloc_trim(0) "
      "(the rest is live)"
    )
  print(
    f"  same update, whole state in host RAM: {r['host_tier_step_s']:.2f} s; step / (I/O bound + "
    f"that) = {r['step_over_io_bound_plus_compute']:.2f}"
  )
  print(
    f"  CPU per GB moved: step {r['cpu_s_per_gb_moved']:.2f} s, less the host-RAM update's "
    f"{r['io_cpu_s_per_gb_moved']:.2f} s, raw disk {r['raw_cpu_s_per_gb']:.3f} s; the store read "
    f"{_fmt(r['tier_read_GBps'])} GB/s and wrote {_fmt(r['tier_write_GBps'])} GB/s while busy; "
    f"the store's threads {r['store_cpu_s_per_gb_moved']:.2f} s"
  )
  if r.get("disk_busy_over_step"):
    serial = statistics.median(rep["moved_gb"] / rep["io_lower_bound_s"] for rep in r["reps"])
    print(
      f"  the disk worked {r['disk_busy_over_step']:.2f} of the step (a read, write or commit under "
      f"way); reads and writes together moved {r['tier_busy_GBps']:.2f} GB/s while it did (the raw "
      f"disk, reading then writing: {serial:.2f} GB/s)"
    )
  for i, so in enumerate(r.get("store_only", [])):
    print(
      f"  store alone {i}: write {so['write_GBps']:.2f} GB/s ({so['write_over_raw']:.2f} of raw "
      f"{so['raw_write_GBps']:.2f}) at {so['write_cpu_s_per_gb']:.2f} CPU-s/GB, read "
      f"{so['read_GBps']:.2f} GB/s ({so['read_over_raw']:.2f} of raw {so['raw_read_GBps']:.2f}) at "
      f"{so['read_cpu_s_per_gb']:.2f} CPU-s/GB; raw {so['raw_cpu_s_per_gb']:.3f} CPU-s/GB"
    )
  for i, rep in enumerate(r["reps"]):
    s = rep["stats"]
    print(
      f"  rep {i}: step {rep['step_s']:.2f} s (CPU {rep['cpu_s']:.2f} s, page faults "
      f"{rep['minor_fault_bytes'] / GB:.1f} GB), bound "
      f"{rep['io_lower_bound_s']:.2f} s (raw write {rep['raw_write_GBps']:.2f}, read "
      f"{rep['raw_read_GBps']:.2f} GB/s), read "
      f"{s['bytes_read'] / GB:.2f} GB, written {s['bytes_written'] / GB:.2f} GB, fetches {s['fetches']} "
      f"(prefetch hits {s['prefetch_hits']}, buffer hits {s['buffer_hits']}, misses {s['misses']}, "
      f"waits {s['waits']}), commit {s.get('commit_ns', 0) / 1e6:.0f} ms, leaves written over a "
      f"dropped generation's files {s.get('leaves_reused', '-')}"
    )
    print(f"    CPU s by thread: {rep['cpu_s_by_thread']}")


def _fmt(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--state-gb", type=float, default=2.0, help="headline size: GB of Adam state")
  parser.add_argument(
    "--sizes", default="0.5,1,2", help="sizes (GB) for the scaling fit; '' for none"
  )
  parser.add_argument("--leaves", type=int, default=16)
  parser.add_argument("--groups", type=int, default=8, help="window sized for this many groups")
  parser.add_argument(
    "--host-leaves", type=int, default=1, help="host_limit = this many leaves' state"
  )
  parser.add_argument("--reps", type=int, default=3, help="timed (raw disk, step) pairs per size")
  parser.add_argument(
    "--warm-steps", type=int, default=2, help="back-to-back steps, page cache kept"
  )
  parser.add_argument("--cache", choices=("fadvise", "drop", "none"), default="fadvise")
  parser.add_argument("--prefetch-depth", type=int, default=1)
  parser.add_argument("--write-depth", type=int, default=1)
  parser.add_argument("--chunk-mib", type=int, default=16)
  parser.add_argument("--io-threads", type=int, default=4, help="store: chunk I/O threads each way")
  parser.add_argument(
    "--no-direct-io", action="store_true", help="store: through the page cache, not O_DIRECT"
  )
  parser.add_argument(
    "--store-reps", type=int, default=2, help="store-alone write/read rounds after the steps"
  )
  parser.add_argument(
    "--block-mib", type=int, default=4, help="raw disk: bytes per O_DIRECT request"
  )
  parser.add_argument("--threads", type=int, default=4, help="raw disk: requests in flight")
  parser.add_argument(
    "--dir", default="bench_out/nvme_data", help="data directory (on the disk under test)"
  )
  parser.add_argument("--out", default="bench_out/nvme_tier.json")
  parser.add_argument("--_child", type=float, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--_child-out", default=None, help=argparse.SUPPRESS)
  return parser


def main(argv=None) -> dict:
  args = _parser().parse_args(argv)
  if args._child is not None:
    result = run_size(args._child, args)
    with open(args._child_out, "w") as f:
      json.dump(result, f)
    return result

  argv = list(sys.argv[1:] if argv is None else argv)
  sizes = sorted({float(s) for s in args.sizes.split(",") if s.strip()} | {args.state_gb})
  start_load = _common.load()
  runs = {}
  for size in sizes:
    runs[size] = _child(argv, size)
    _print_size(runs[size])
  head = runs[args.state_gb]
  import jax  # only for the description of the machine

  result = {
    "benchmark": "nvme_tier",
    "backend": jax.default_backend(),
    "machine": platform.machine(),
    "cpus": os.cpu_count(),
    "optimizer": "optax.adamw(1e-3), fp32 params, jit, params and state donated",
    "cache": args.cache,
    "raw_disk": {
      "method": "O_DIRECT, mmap buffers",
      "block": args.block_mib << 20,
      "threads": args.threads,
    },
    "nvme_options": _nvme_options(args),
    "malloc_env": _common.malloc_env(),
    "load_start": start_load,
    "load_end": _common.load(),
    "state_gb": args.state_gb,
    "step_over_io_bound": head["step_over_io_bound"],
    "moved_over_raw": head["moved_over_raw"],
    "rss_over_bound": head["rss_over_bound"],
    "io_cpu_s_per_gb_moved": head["io_cpu_s_per_gb_moved"],
    "targets": {
      "step_over_io_bound": "<= 1.15",
      "moved_over_raw": ">= 0.85",
      "rss_over_bound": "<= 1.10",
      "io_cpu_s_per_gb_moved": "<= 0.3",
    },
    "sizes": [runs[s] for s in sizes],
  }
  if len(sizes) >= 2:
    xs = [runs[s]["footprint"]["nvme"] / GB for s in sizes]
    result["step_time_vs_nvme_gb"] = fit_line(xs, [runs[s]["step_s"] for s in sizes])
    result["io_bound_vs_nvme_gb"] = fit_line(xs, [runs[s]["io_lower_bound_s"] for s in sizes])
    fit = result["step_time_vs_nvme_gb"]
    print(
      f"step time vs NVMe GB: slope {fit['slope']:.2f} s/GB, intercept {fit['intercept']:.2f} s, "
      f"R^2 {fit['r2']:.3f}"
    )
  print(
    f"headline ({args.state_gb:g} GB): step/IO-bound {result['step_over_io_bound']:.2f} (<= 1.15), "
    f"moved/raw {result['moved_over_raw']:.2f} (>= 0.85), RSS/bound {result['rss_over_bound']:.2f} "
    f"(<= 1.10), CPU-s per GB moved beyond the host-RAM update "
    f"{result['io_cpu_s_per_gb_moved']:.2f} (<= 0.3); load {start_load['loadavg']} -> "
    f"{result['load_end']['loadavg']}"
  )
  _common.write_json(result, args.out)
  try:
    os.rmdir(args.dir)
  except OSError:
    pass
  return result


if __name__ == "__main__":
  main()
