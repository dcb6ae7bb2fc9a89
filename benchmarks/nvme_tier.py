"""NVMe tier of `offload(adamw)`: step time against the disk, peak RSS against the documented bound.

One run measures, for each state size, in a fresh subprocess (so peak RSS belongs to that size alone):

* the disk's raw sequential bandwidth: ``O_DIRECT`` writes (then ``fdatasync``) and reads of a file the
  size of the NVMe state, from page-aligned (mmap) buffers on a few threads;
* the jitted NVMe-tier step (params and state donated, ``optax.adamw``, grads held fixed), with nearly all
  of the Adam state on NVMe (``host_limit`` = the state of ``--host-leaves`` leaves).

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
* ``moved_over_raw`` = (NVMe state bytes read + written, nominally 2 x NVMe bytes) per second / the raw
  bandwidth of that read/write mix (target >= 0.85);
* ``rss_over_bound`` = peak RSS during the NVMe steps / (host_limit + params + grads + the store's
  ``host_buffer_bound``) (target <= 1.10); the peak is the kernel's ``VmHWM``, reset with
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
(default ``/work/bench_nvme``; put it on the disk under test, not on tmpfs) and is deleted afterwards.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

GB = 1e9
_COLS = 2048


# -- process memory ------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def rss_bytes() -> int:
  """Resident set size of this process now."""
  return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
  """Peak resident set size since the process started or since `reset_peak_rss`."""
  return _status_kib("VmHWM") * 1024


def cpu_seconds() -> float:
  """CPU time of this process, all threads (user + system)."""
  t = os.times()
  return t.user + t.system


def minor_faults() -> int:
  """Page faults served without I/O so far: mostly first touches of freshly allocated memory."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _malloc_trim_rss() -> int | None:
  """RSS after glibc's ``malloc_trim(0)`` (freed memory handed back to the OS), or None without glibc."""
  try:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    return None
  return rss_bytes()


def reset_peak_rss() -> bool:
  """Resets the kernel's peak-RSS counter (``VmHWM``) to the current RSS; False if not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


class RssSampler:
  """Samples ``VmRSS`` on a thread; `peak` is the largest value seen (a cross-check of ``VmHWM``)."""

  def __init__(self, interval_s: float = 0.005):
    self.interval_s = interval_s
    self.peak = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, rss_bytes())
      self._stop.wait(self.interval_s)

  def __enter__(self) -> RssSampler:
    self.peak = rss_bytes()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


# -- disk ----------------------------------------------------------------------------------------------


def evict_cache(directory: str, method: str) -> None:
  """Drops `directory`'s files from the page cache, so the next reads come from the disk.

  ``"fadvise"``: ``POSIX_FADV_DONTNEED`` on every file (drops clean pages only: call once the data is
  durable); ``"drop"``: ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches`` (root; whole machine);
  ``"none"``: nothing.
  """
  if method == "none":
    return
  if method == "drop":
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
      f.write("3\n")
    return
  for root, _, files in os.walk(directory):
    for name in files:
      try:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
      except FileNotFoundError:  # a generation deleted meanwhile
        continue
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


class RawDisk:
  """Sequential ``O_DIRECT`` bandwidth of the disk holding `directory` (what fio would report).

  Each of `threads` threads moves `block`-byte blocks (strided, so the file is covered in order) from
  its own page-aligned mmap buffer: `threads` requests in flight.
  """

  def __init__(self, directory: str, block: int, threads: int):
    self.path = os.path.join(directory, "raw_odirect.bin")
    self.block, self.threads = block, threads
    self._buffers = [mmap.mmap(-1, block) for _ in range(threads)]
    for buf in self._buffers:  # incompressible data, in case the device compresses
      buf.write(os.urandom(block))

  def measure(self, nbytes: int) -> dict[str, float]:
    """Writes (with ``fdatasync``) then reads a file of about `nbytes`; bytes per second each way."""
    n = max(1, -(-nbytes // self.block))
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:

      def run(io):
        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
          list(pool.map(io, range(self.threads)))

      def write(t):
        for i in range(t, n, self.threads):
          os.pwrite(fd, self._buffers[t], i * self.block)

      def read(t):
        for i in range(t, n, self.threads):
          os.preadv(fd, [self._buffers[t]], i * self.block)

      t0 = time.perf_counter()
      run(write)
      os.fdatasync(fd)
      t1 = time.perf_counter()
      run(read)
      t2 = time.perf_counter()
    finally:
      os.close(fd)
      os.unlink(self.path)
    total = n * self.block
    return {"bytes": total, "write_Bps": total / (t1 - t0), "read_Bps": total / (t2 - t1)}


def disk_free_bytes(directory: str) -> int:
  d = directory
  while not os.path.exists(d):
    d = os.path.dirname(d) or "."
  return shutil.disk_usage(d).free


def load() -> dict[str, object]:
  """Load averages and, where the kernel has it, I/O pressure (others' I/O slows ours)."""
  out: dict[str, object] = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
  try:
    with open("/proc/pressure/io") as f:
      out["io_pressure"] = f.readline().strip()
  except OSError:
    pass
  return out


# -- the tier step -------------------------------------------------------------------------------------


def make_tree(num_params: float, leaves: int, dtype) -> dict:
  """`leaves` equal (rows, 2048) leaves, about `num_params` in all (constant values: I/O is the point)."""
  import jax.numpy as jnp

  rows = max(int(num_params / leaves / _COLS), 1)
  return {f"layer_{i:02d}": jnp.full((rows, _COLS), 0.02 + 1e-4 * i, dtype) for i in range(leaves)}


def make_step(tx):
  import jax
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def tree_bytes(tree) -> int:
  import jax

  return sum(x.nbytes for x in jax.tree.leaves(tree))


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
  keep = ("buffer_bytes", "peak_buffer_bytes")
  return {k: (v if k in keep else v - before.get(k, 0)) for k, v in after.items()}


def run_size(state_gb: float, args) -> dict:
  """One state size, in this process: init, warm-up, then `args.reps` x (raw disk, evict, step)."""
  import jax
  import jax.numpy as jnp
  import optax

  import optax_offload as oo
  from optax_offload._src import nvme_tier

  jax.block_until_ready(jnp.zeros(8) + 1)  # start the runtime before the baseline
  rss_runtime = rss_bytes()
  params = make_tree(state_gb * GB / 8, args.leaves, jnp.float32)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  jax.block_until_ready((params, grads))
  n = sum(p.size for p in jax.tree.leaves(params))
  leaf_state = 8 * next(iter(params.values())).size
  state_bytes = 8 * n
  host_limit = args.host_leaves * leaf_state
  window = max(2 * state_bytes // args.groups, 1)
  directory = os.path.join(args.dir, f"state_{state_gb:g}gb")
  shutil.rmtree(directory, ignore_errors=True)
  os.makedirs(directory)
  need = 4 * state_bytes + state_bytes  # store: up to 4 generations; raw file: 1 more
  if disk_free_bytes(directory) < need:
    raise SystemExit(
      f"{directory}: needs {need / GB:.1f} GB free, has {disk_free_bytes(directory) / GB:.1f}."
    )
  raw = RawDisk(directory, args.block_mib << 20, args.threads)
  tx = oo.offload(
    optax.adamw(1e-3),
    host_limit=host_limit,
    nvme_dir=os.path.join(directory, "store"),
    window_bytes=window,
    nvme_options={
      "prefetch_depth": args.prefetch_depth,
      "write_depth": args.write_depth,
      "chunk_bytes": args.chunk_mib << 20,
    },
  )
  t0 = time.perf_counter()
  state = tx.init(params)
  oo.sync_nvme(state)
  init_s = time.perf_counter() - t0
  store = nvme_tier.lookup(state.nvme_store).store
  fp = oo.footprint(state)
  step = make_step(tx)
  t0 = time.perf_counter()
  params, state = step(params, state, grads)  # compile, warm up
  jax.block_until_ready((params, state))
  oo.sync_nvme(state)
  warmup_s = time.perf_counter() - t0
  rss_before_steps = rss_bytes()
  peak_before_steps = peak_rss_bytes()  # includes init and compilation

  reps = []
  peak_reset = reset_peak_rss()
  with RssSampler() as sampler:
    for _ in range(args.reps):
      disk = raw.measure(fp["nvme"])
      oo.sync_nvme(state)
      evict_cache(directory, args.cache)
      before = store.stats
      c0, f0 = cpu_seconds(), minor_faults()
      t0 = time.perf_counter()
      params, state = step(params, state, grads)
      jax.block_until_ready((params, state))
      t1 = time.perf_counter()
      oo.sync_nvme(state)
      t2 = time.perf_counter()
      cpu_s, faults = cpu_seconds() - c0, minor_faults() - f0
      stats = _delta(store.stats, before)
      bound = stats["bytes_read"] / disk["read_Bps"] + stats["bytes_written"] / disk["write_Bps"]
      nominal = fp["nvme"] / disk["read_Bps"] + fp["nvme"] / disk["write_Bps"]
      reps.append(
        {
          "raw_write_GBps": disk["write_Bps"] / GB,
          "raw_read_GBps": disk["read_Bps"] / GB,
          "step_s": t2 - t0,
          "step_return_s": t1 - t0,
          "cpu_s": cpu_s,
          "minor_fault_bytes": faults * resource.getpagesize(),
          "io_lower_bound_s": bound,
          "step_over_io_bound": (t2 - t0) / bound,
          "moved_over_raw": nominal / (t2 - t0),
          "stats": stats,
        }
      )
  peak = peak_rss_bytes() if peak_reset else sampler.peak

  warm = None
  # Back to back, no eviction: what the page cache gives when the state fits in RAM.
  if args.warm_steps:
    t0 = time.perf_counter()
    for _ in range(args.warm_steps):
      params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    oo.sync_nvme(state)
    warm = (time.perf_counter() - t0) / args.warm_steps

  # Diagnostic, after every timed step: how much of the RSS is live, and how much glibc keeps freed.
  rss_end = rss_bytes()
  rss_end_trimmed = _malloc_trim_rss()
  params_bytes, grads_bytes = tree_bytes(params), tree_bytes(grads)
  rss_bound = host_limit + params_bytes + grads_bytes + store.host_buffer_bound
  buffer_bound, stats_total = store.host_buffer_bound, store.stats
  oo.close_nvme(state)
  del state
  host_step_s = _host_tier_step_s(
    tx_args={"window_bytes": window}, params=params, grads=grads, reps=args.reps
  )
  med = lambda key: statistics.median(r[key] for r in reps)  # noqa: E731
  result = {
    "state_gb": state_gb,
    "params": n,
    "leaves": args.leaves,
    "groups": len(store.groups),
    "state_bytes": state_bytes,
    "footprint": fp,
    "host_limit": host_limit,
    "window_bytes": window,
    "init_s": init_s,
    "warmup_step_s": warmup_s,
    "reps": reps,
    "step_s": med("step_s"),
    "step_return_s": med("step_return_s"),
    "cpu_s": med("cpu_s"),
    "cpu_s_per_gb_moved": med("cpu_s") / (2 * fp["nvme"] / GB),
    "io_lower_bound_s": med("io_lower_bound_s"),
    "raw_write_GBps": med("raw_write_GBps"),
    "raw_read_GBps": med("raw_read_GBps"),
    "step_over_io_bound": med("step_over_io_bound"),
    "moved_over_raw": med("moved_over_raw"),
    "warm_cache_step_s": warm,
    "rss": {
      "runtime": rss_runtime,
      "before_steps": rss_before_steps,
      "peak_steps": peak,
      "peak_source": "VmHWM after clear_refs" if peak_reset else "VmRSS sampler",
      "peak_sampled": sampler.peak,
      "peak_init_and_warmup": peak_before_steps,
      "end": rss_end,
      "end_after_malloc_trim": rss_end_trimmed,
      "params": params_bytes,
      "grads": grads_bytes,
      "host_buffer_bound": buffer_bound,
      "bound": rss_bound,
      "bound_plus_runtime_and_window": rss_bound + rss_runtime + window,
    },
    "rss_over_bound": peak / rss_bound,
    "rss_over_bound_plus_runtime_and_window": peak / (rss_bound + rss_runtime + window),
    "store_stats_total": stats_total,
    "host_tier_step_s": host_step_s,
    "step_over_io_bound_plus_compute": med("step_s") / (med("io_lower_bound_s") + host_step_s),
  }
  shutil.rmtree(directory, ignore_errors=True)
  return result


def _host_tier_step_s(tx_args: dict, params, grads, reps: int) -> float:
  """Median step time of the same update with the whole state in host RAM (same groups): the
  compute the NVMe-tier step does besides its I/O. On a CPU-only machine both share its cores."""
  import jax
  import optax

  import optax_offload as oo

  tx = oo.offload(optax.adamw(1e-3), **tx_args)
  state = tx.init(params)
  step = make_step(tx)
  params, state = step(params, state, grads)  # compile, warm up
  jax.block_until_ready((params, state))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    params, state = step(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


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
  for i, rep in enumerate(r["reps"]):
    s = rep["stats"]
    print(
      f"  rep {i}: step {rep['step_s']:.2f} s (CPU {rep['cpu_s']:.2f} s, page faults "
      f"{rep['minor_fault_bytes'] / GB:.1f} GB), bound "
      f"{rep['io_lower_bound_s']:.2f} s, read "
      f"{s['bytes_read'] / GB:.2f} GB, written {s['bytes_written'] / GB:.2f} GB, fetches {s['fetches']} "
      f"(prefetch hits {s['prefetch_hits']}, buffer hits {s['buffer_hits']}, misses {s['misses']}, "
      f"waits {s['waits']})"
    )


def main(argv=None) -> dict:
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
  args = parser.parse_args(argv)

  if args._child is not None:
    result = run_size(args._child, args)
    with open(args._child_out, "w") as f:
      json.dump(result, f)
    return result

  argv = list(sys.argv[1:] if argv is None else argv)
  sizes = sorted({float(s) for s in args.sizes.split(",") if s.strip()} | {args.state_gb})
  start_load = load()
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
    "nvme_options": {
      "prefetch_depth": args.prefetch_depth,
      "write_depth": args.write_depth,
      "chunk_bytes": args.chunk_mib << 20,
    },
    "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    "load_start": start_load,
    "load_end": load(),
    "state_gb": args.state_gb,
    "step_over_io_bound": head["step_over_io_bound"],
    "moved_over_raw": head["moved_over_raw"],
    "rss_over_bound": head["rss_over_bound"],
    "targets": {
      "step_over_io_bound": "<= 1.15",
      "moved_over_raw": ">= 0.85",
      "rss_over_bound": "<= 1.10",
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
    f"(<= 1.10); load {start_load['loadavg']} -> {result['load_end']['loadavg']}"
  )
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  try:
    os.rmdir(args.dir)
  except OSError:
    pass
  return result


if __name__ == "__main__":
  main()
