"""This machine's bandwidths and free disk space: the only code of the estimate that touches hardware.

`Bandwidths` holds bytes per second of the links a step uses, with defaults for a typical PCIe 4.0
machine; `measure_bandwidths` times this machine's link and disk; `free_disk` reads a file
system's free space, `file_system_id` which processes share it. `estimate` is pure arithmetic on
what these return.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import socket
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from optax_offload._src.units import format_bytes
from optax_offload._src.units import parse_bytes

DEFAULT_LINK_BANDWIDTH = 25e9
"""Host<->device bytes per second, one direction at a time: about PCIe 4.0 x16 (32 GB/s raw)."""

DEFAULT_NVME_READ_BANDWIDTH = 3e9
"""NVMe sequential read, bytes per second: a PCIe 3.0 x4 / entry PCIe 4.0 drive."""

DEFAULT_NVME_WRITE_BANDWIDTH = 2e9
"""NVMe sequential write with an fsync per step, bytes per second."""

DEFAULT_HOST_MEMORY_BANDWIDTH = 40e9
"""Host memory bytes per second that a CPU optimizer update streams (``update_on="host"``)."""


@dataclasses.dataclass(frozen=True)
class Bandwidths:
  """Bytes per second of the links a step uses.

  Attributes:
    link: host<->device, one direction at a time (``--measure`` times a copy each way).
    nvme_read: NVMe sequential read.
    nvme_write: NVMe sequential write, made durable (fsync) once per step.
    host_memory: host memory streamed by a CPU-side update (``update_on="host"``).
    measured: the fields that were measured (the others are defaults or given).
    note: where the measured numbers come from.
  """

  link: float = DEFAULT_LINK_BANDWIDTH
  nvme_read: float = DEFAULT_NVME_READ_BANDWIDTH
  nvme_write: float = DEFAULT_NVME_WRITE_BANDWIDTH
  host_memory: float = DEFAULT_HOST_MEMORY_BANDWIDTH
  measured: tuple[str, ...] = ()
  note: str = ""

  def __post_init__(self):
    for f in ("link", "nvme_read", "nvme_write", "host_memory"):
      v = getattr(self, f)
      if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
        raise ValueError(
          f"Bandwidths.{f} must be a positive number of bytes per second, got {v!r}."
        )


def measure_bandwidths(
  nvme_dir: str | os.PathLike | None = None,
  *,
  nbytes: int | str = "256MiB",
  repeats: int = 3,
  base: Bandwidths | None = None,
) -> Bandwidths:
  """Times this machine's host<->device link and, given a directory, its disk.

  Link: `jax.device_put` of an ``nbytes`` array from device memory to ``pinned_host`` and back, on
  the first device, best of `repeats`. On the CPU backend this is a memory copy, not a PCIe link.
  Disk: writes an ``nbytes`` temporary file in `nvme_dir` and fsyncs it, drops it from the page
  cache (``posix_fadvise``), reads it back, and deletes it. A file system that keeps the data in
  memory (tmpfs) reports memory speed.

  Args:
    nvme_dir: the NVMe tier's directory (created if missing), or None to measure the link only.
    nbytes: bytes per transfer and size of the temporary file.
    repeats: link transfers timed; the fastest counts.
    base: bandwidths for what is not measured; default `Bandwidths()`.

  Returns:
    `Bandwidths` with the measured fields replaced.

  Examples:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as nvme_dir:
    ...   bw = measure_bandwidths(nvme_dir, nbytes="4MiB", repeats=1)
    >>> bw.measured
    ('link', 'nvme_read', 'nvme_write')
  """
  n = parse_bytes(nbytes, "nbytes")
  if not n:
    raise ValueError("nbytes must be > 0.")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")
  base = base or Bandwidths()
  values: dict[str, float] = {}
  link, note = _measure_link(n, repeats)
  if link is not None:
    values["link"] = link
  notes = [note]
  if nvme_dir is not None:
    missing = []  # (the folders made to measure in, deepest first: removed after)
    folder = os.path.abspath(nvme_dir)
    while not os.path.exists(folder):
      missing.append(folder)
      folder = os.path.dirname(folder)
    os.makedirs(nvme_dir, exist_ok=True)
    try:
      read, write = _measure_disk(os.fspath(nvme_dir), n)
    finally:
      for folder in missing:
        try:
          os.rmdir(folder)
        except OSError:  # (something else was put there meanwhile)
          break
    values.update(nvme_read=read, nvme_write=write)
    notes.append(f"disk: {format_bytes(n)} file in {os.path.abspath(nvme_dir)}")
  else:
    notes.append("disk not measured: no NVMe directory")
  return dataclasses.replace(
    base,
    **values,
    measured=tuple(k for k in ("link", "nvme_read", "nvme_write") if k in values),
    note="; ".join(notes),
  )


def _measure_link(nbytes: int, repeats: int) -> tuple[float | None, str]:
  """(bytes per second or None, a note): the best of `repeats` round trips to ``pinned_host``."""
  device = jax.local_devices()[0]
  if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
    return None, f"link not measured: {device.platform} has no pinned_host memory"
  x = jax.device_put(jnp.ones(max(nbytes // 4, 1), jnp.float32), device)
  on_device = x.sharding
  on_host = on_device.with_memory_kind("pinned_host")
  jax.device_put(jax.device_put(x, on_host), on_device).block_until_ready()  # warm up
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    h = jax.device_put(x, on_host).block_until_ready()
    jax.device_put(h, on_device).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * x.nbytes / best, f"link: {format_bytes(x.nbytes)} each way on {device.platform}"


def _measure_disk(directory: str, nbytes: int) -> tuple[float, float]:
  """(read, write) bytes per second of a file of `nbytes` in `directory`, written and fsynced."""
  chunk = min(nbytes, 16 << 20)
  block = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
  fd, path = tempfile.mkstemp(prefix=".optax_offload_measure_", dir=directory)
  try:
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
      left -= os.write(fd, block[: min(left, chunk)])
    os.fsync(fd)
    write_s = time.perf_counter() - t0
    if hasattr(os, "posix_fadvise"):
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.lseek(fd, 0, os.SEEK_SET)
    buf = bytearray(chunk)
    t0 = time.perf_counter()
    while os.readv(fd, [buf]) > 0:
      pass
    read_s = time.perf_counter() - t0
  finally:
    os.close(fd)
    os.unlink(path)
  return nbytes / max(read_s, 1e-9), nbytes / max(write_s, 1e-9)


def free_disk(path: str | os.PathLike) -> int:
  """Free bytes on the file system of `path`, or of its nearest existing parent.

  Examples:
    >>> free_disk("/no/such/directory/yet") > 0  # the root's file system
    True
  """
  return shutil.disk_usage(nearest_existing(path)).free


def file_system_id(path: str | os.PathLike) -> str:
  """Names the file system of `path` (or of its nearest existing parent) on this machine: the same
  string in the processes of one machine whose directories are on one mounted file system. The
  kernel's boot id tells machines apart (containers share their host's), the device number file
  systems. Space shared under other names is not found: btrfs subvolumes, containers' separate
  overlay roots on one disk, a network file system mounted by several machines.

  Examples:
    >>> file_system_id("/no/such/directory") == file_system_id("/")
    True
  """
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      machine = f.read().strip()
  except OSError:  # not Linux: the host's name
    machine = socket.gethostname()
  return f"{machine}:{os.stat(nearest_existing(path)).st_dev}"


def nearest_existing(path: str | os.PathLike) -> str:
  """`path` (made absolute) if it exists, else its nearest existing parent."""
  p = os.path.abspath(os.fspath(path))
  while not os.path.exists(p):
    parent = os.path.dirname(p)
    if parent == p:
      break
    p = parent
  return p
