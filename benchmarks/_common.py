"""Helpers the benchmarks share: trees and steps, timing, this process's memory, the disk, JSON output.

A benchmark run as a script (``python benchmarks/host_tier.py``) puts the repository root on
``sys.path`` first, as `gpu_memory` does, and imports this module as ``benchmarks._common``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import mmap
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

GB = 1e9
GIB = 1 << 30
COLS = 2048
"""Columns of every leaf `make_tree` builds, unless told otherwise."""


# -- trees and steps -----------------------------------------------------------------------------------


def make_tree(total: float, leaves: int, dtype=None, *, cols: int = COLS, random: bool = True):
  """`leaves` equal ``(rows, cols)`` leaves, about `total` parameters in all, named ``layer_00``, ...

  `random`: normal values * 0.02 (a fixed key); else each leaf a constant (``0.02 + 1e-4 * i``), for
  benchmarks where only the bytes matter.

  The leaves are committed to the first device, as a step's outputs are: with uncommitted params
  the first step after a warm-up compiles again (README), and a timed step would count a compile.
  """
  import jax
  import jax.numpy as jnp

  dtype = jnp.float32 if dtype is None else dtype
  rows = max(int(total / leaves / cols), 1)
  width = max(2, len(str(leaves - 1)))  # names sort in leaf order
  names = [f"layer_{i:0{width}d}" for i in range(leaves)]
  if not random:
    tree = {name: jnp.full((rows, cols), 0.02 + 1e-4 * i, dtype) for i, name in enumerate(names)}
  else:
    keys = jax.random.split(jax.random.key(0), leaves)
    tree = {name: jax.random.normal(k, (rows, cols), dtype) * 0.02 for name, k in zip(names, keys)}
  return jax.device_put(tree, jax.devices()[0])


def fixed_grads(params):
  """Gradients of 1e-3 everywhere, held fixed across steps (the update's arithmetic is the point)."""
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)


def num_params(tree) -> int:
  import jax

  return sum(x.size for x in jax.tree.leaves(tree))


def make_step(tx):
  """``step(params, state, grads) -> (params, state)``: `tx`'s update applied; jitted, donating."""
  import jax
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def tree_bytes(tree) -> int:
  import jax

  return sum(x.nbytes for x in jax.tree.leaves(tree))


def init_nvme(tx, params):
  """``tx.init(params)`` of an NVMe-tier `offload`, made durable: the state, its store, the seconds."""
  import optax_offload as oo
  from optax_offload._src import nvme_tier

  t0 = time.perf_counter()
  state = tx.init(params)
  oo.sync_nvme(state)
  init_s = time.perf_counter() - t0
  return state, nvme_tier.lookup(state.nvme_store).store, init_s


# -- timing --------------------------------------------------------------------------------------------


def timed_step(step, params, state, grads, sync: Callable[[Any], None] | None = None):
  """Runs one step; returns ``(params, state, record)``.

  The record: ``step_s`` (until the results are ready and, given `sync`, ``sync(state)`` returned),
  ``step_return_s`` (until the results are ready), ``cpu_s`` (this process, all threads) and
  ``minor_fault_bytes`` (pages first touched, times the page size).
  """
  import jax

  c0, f0 = cpu_seconds(), minor_faults()
  t0 = time.perf_counter()
  params, state = step(params, state, grads)
  jax.block_until_ready((params, state))
  t1 = time.perf_counter()
  if sync is not None:
    sync(state)
  t2 = time.perf_counter()
  record = {
    "step_s": t2 - t0,
    "step_return_s": t1 - t0,
    "cpu_s": cpu_seconds() - c0,
    "minor_fault_bytes": (minor_faults() - f0) * resource.getpagesize(),
  }
  return params, state, record


@dataclasses.dataclass
class Run:
  """One variant of `time_variants`: its step, latest params and state, and a record per step."""

  step: Callable
  params: Any
  state: Any
  records: list[dict] = dataclasses.field(default_factory=list)

  def median(self, key: str = "step_s") -> float:
    return statistics.median(r[key] for r in self.records)

  def total(self, key: str) -> float:
    return sum(r[key] for r in self.records)


def time_variants(txs: dict, params, grads, reps: int, *, copy: bool = True) -> dict[str, Run]:
  """Times a jitted, donating step of each transformation in `txs`, `reps` times each.

  Each variant starts from its own copy of `params` (or `params` itself when not `copy`: one
  variant only) and is compiled and warmed up by one step first. The timed steps are interleaved
  (a, b, a, b, ...), so drift hits every variant alike.
  """
  import jax
  import jax.numpy as jnp

  runs = {}
  for name, tx in txs.items():
    p = jax.tree.map(jnp.copy, params) if copy else params
    step = make_step(tx)
    p, s = step(p, tx.init(p), grads)  # compile and warm up
    jax.block_until_ready((p, s))
    runs[name] = Run(step, p, s)
  for _ in range(reps):
    for run in runs.values():
      run.params, run.state, record = timed_step(run.step, run.params, run.state, grads)
      run.records.append(record)
  return runs


# -- this process's memory and CPU ---------------------------------------------------------------------


def proc_status(field: str, path: str = "/proc/self/status") -> int:
  """A number of ``/proc/self/status`` or another file of that format (kiB for sizes)."""
  with open(path) as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  raise KeyError(field)


def rss_bytes() -> int:
  """Resident set size of this process now."""
  return proc_status("VmRSS") * 1024


def peak_rss_bytes() -> int:
  """Peak resident set size since the process started or since `reset_peak_rss`."""
  return proc_status("VmHWM") * 1024


def reset_peak_rss() -> bool:
  """Resets the kernel's peak-RSS counter (``VmHWM``) to the current RSS; False if not allowed."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def rss_after_malloc_trim() -> int | None:
  """RSS after glibc's ``malloc_trim(0)`` (freed memory handed back to the OS), or None without glibc."""
  try:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    return None
  return rss_bytes()


def cpu_seconds() -> float:
  """CPU time of this process, all threads (user + system)."""
  t = os.times()
  return t.user + t.system


def minor_faults() -> int:
  """Page faults served without I/O so far: mostly first touches of freshly allocated memory."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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


def load() -> dict[str, object]:
  """Load averages and, where the kernel has it, I/O pressure (others' I/O slows ours)."""
  out: dict[str, object] = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
  try:
    with open("/proc/pressure/io") as f:
      out["io_pressure"] = f.readline().strip()
  except OSError:
    pass
  return out


def malloc_env() -> dict[str, str]:
  """The ``MALLOC_*`` environment variables (glibc tunables that change RSS figures)."""
  return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


# -- the disk ------------------------------------------------------------------------------------------


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


def disk_free_bytes(directory: str) -> int:
  """Free bytes on the file system of `directory`, or of its nearest existing parent."""
  d = directory
  while not os.path.exists(d):
    d = os.path.dirname(d) or "."
  return shutil.disk_usage(d).free


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


# -- output --------------------------------------------------------------------------------------------


def write_json(result: dict, path: str) -> dict:
  """Writes `result` to `path` (its folder created), indented; returns `result`."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  return result
