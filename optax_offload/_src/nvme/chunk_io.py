"""The store's data path: chunk files read and written with direct I/O, checksummed on the way.

The files are the zarr3 chunks TensorStore reads (`format`); this module only moves their bytes,
the way DeepSpeed's DeepNVMe does: ``O_DIRECT`` requests from page-aligned buffers that are reused,
a few requests in flight on a few threads, no page cache. A chunk is written from a reused
staging buffer (`PIECE` bytes at a time: the copy aligns the data for ``O_DIRECT`` and zero-fills
the edge chunk's padding), and its XXH3 checksum is computed on that buffer while it is hot; a
chunk is read in place into the caller's aligned buffer and its checksum verified there.

Why not TensorStore itself (measured on this project's 2-core VM, 1 GB written then read, noisy):
with the ``crc32c`` codec 2.5-2.6 CPU-s per GB written and 2.8-3.0 per GB read; without it
0.7-0.8 and 0.7-1.7; with ``file_io_mode: direct`` as well 0.5 and 0.8 (TensorStore uses direct
I/O for reads only, and only when a read's block-rounded end lies inside the file; it writes
through the page cache, to a lock file that it then renames). This path, in a prototype: 0.35-0.45
per GB written (copy 0.18-0.25, checksum 0.08-0.10, the write itself 0.08-0.11) and 0.15-0.2 per GB
read, where O_DIRECT reads and writes of the same bytes, without checksums, took 0.1-0.15; in the
store (`benchmarks/nvme_tier.py`, 1 GB of state), the chunk threads took 0.34-0.44 CPU-s per GB
written and 0.14-0.22 per GB read.

Where the file system says (``statx``'s ``STATX_DIOALIGN``) that direct I/O takes memory as
aligned as the array being written, a whole chunk file is written straight from the array in one
request, with no staging copy: NVMe drives take 4-byte-aligned memory since Linux 6.0, so the
64-byte-aligned buffers JAX hands over qualify there; this VM's virtio disk wants 512, so they are
staged here (the NVMe tier's page-aligned put copies qualify on any disk).

Chunk files are opened without ``O_TRUNC`` and written over, so that a file of a dropped
generation (`files.Spares`) keeps its blocks; a file with another hard link (a checkpoint's) is
replaced instead, and a longer one is cut to size.

Direct I/O falls back to the page cache, once per store and with a warning, where the file system
refuses it (``EINVAL``); `ChunkIO` can also be made without it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from optax_offload._src.nvme import buffers
from optax_offload._src.nvme import files
from optax_offload._src.nvme.format import ALIGN
from optax_offload._src.nvme.format import CHECKSUM
from optax_offload._src.nvme.format import round_up

logger = logging.getLogger(__name__)

PIECE = 4 << 20
"""Bytes per write request, and the size of each thread's staging buffer. A 16 MiB chunk is then
4 requests, each copied and checksummed while the previous one is on its way (4 threads x 1 MiB
and 4 x 4 MiB pieces measured alike, 0.36-0.46 CPU-s per GB; smaller pieces mean more calls)."""


def request_bytes(largest_file: int) -> int:
  """Bytes of one write request, and of each I/O thread's staging buffer, for chunk files of at
  most `largest_file` bytes: that rounded up to whole blocks, at most `PIECE`."""
  return round_up(max(1, min(largest_file, PIECE)))


_O_DIRECT = getattr(os, "O_DIRECT", 0)
_STATX_DIOALIGN = 0x2000  # linux/stat.h
_AT_EMPTY_PATH = 0x1000


def _libc_statx():
  try:
    function = ctypes.CDLL(None, use_errno=True).statx
  except (OSError, AttributeError):  # not Linux, or a libc without statx
    return None
  function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
  return function


_STATX = _libc_statx()


def dio_memory_alignment(fd: int) -> int:
  """The memory alignment direct I/O on the open file `fd` needs; 0 when the system does not say.

  Examples:
    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...   alignment = dio_memory_alignment(f.fileno())
    >>> alignment == 0 or 4096 % alignment == 0
    True
  """
  if _STATX is None:
    return 0
  buffer = ctypes.create_string_buffer(256)  # struct statx
  if _STATX(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buffer) != 0:
    return 0
  mask = int.from_bytes(buffer.raw[0:4], "little")
  if not mask & _STATX_DIOALIGN:
    return 0
  return int.from_bytes(buffer.raw[152:156], "little")  # stx_dio_mem_align


class ChunkError(Exception):
  """Reading or writing one chunk file failed; `tag` is the job's, `path` the file's."""

  def __init__(self, job: ReadJob | WriteJob, reason: str):
    super().__init__(f"{job.path}: {reason}")
    self.tag, self.path, self.reason = job.tag, job.path, reason


@dataclasses.dataclass(eq=False)
class WriteJob:
  """One chunk file to write: its path, the array bytes it holds, its size on disk.

  The file gets `source` followed by zeros up to `file_nbytes` (zarr's padding of edge chunks);
  `checksum` is set to the XXH3 of the whole file once it is written.
  """

  path: str
  source: np.ndarray  # 1-D uint8, contiguous
  file_nbytes: int
  tag: Any = None
  checksum: str | None = None


@dataclasses.dataclass(eq=False)
class ReadJob:
  """One chunk file to read and verify.

  In place (`buffer` given): the whole file is read into `buffer`, a page-aligned slice of at least
  ``round_up(file_nbytes)`` bytes. Apart (`buffer` None): it is read into a buffer of its own and
  its first ``target.nbytes`` bytes are copied to `target`.
  """

  path: str
  file_nbytes: int
  checksum: str
  buffer: np.ndarray | None = None
  target: np.ndarray | None = None
  tag: Any = None


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
  view = memoryview(data)
  while view.nbytes:
    n = os.pwrite(fd, view, offset)
    if n <= 0:
      raise OSError(errno.EIO, "write returned 0")
    view, offset = view[n:], offset + n


def _pread_all(fd: int, buffer: np.ndarray, size: int, request: int) -> int:
  """Reads the file's first `size` bytes into `buffer` with requests of up to `request` bytes."""
  view, got = memoryview(buffer), 0
  while got < size:
    n = os.preadv(fd, [view[got:request]], got)
    if n <= 0:
      return got
    got += n
  return got


def read_file(job: ReadJob, direct: bool) -> np.ndarray:
  """Reads and verifies one chunk file (see `ReadJob`); returns the buffer holding the file.

  Raises:
    ChunkError: the file is missing, of another size, unreadable, or fails its checksum.
    OSError: ``EINVAL`` from direct I/O (the caller retries without it).
  """
  flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
  try:
    fd = os.open(job.path, flags)
  except FileNotFoundError:
    raise ChunkError(job, "the chunk file is missing") from None
  except OSError as e:
    if direct and e.errno == errno.EINVAL:
      raise
    raise ChunkError(job, f"cannot be opened: {e}") from e
  try:
    size = os.fstat(fd).st_size
    if size != job.file_nbytes:
      raise ChunkError(job, f"the chunk file has {size} bytes, not {job.file_nbytes} (truncated?)")
    buffer = job.buffer if job.buffer is not None else buffers.aligned_empty(round_up(size))
    got = _pread_all(fd, buffer, size, round_up(size) if direct else size)
  except OSError as e:
    if direct and e.errno == errno.EINVAL:
      raise
    raise ChunkError(job, f"cannot be read: {e}") from e
  finally:
    os.close(fd)
  if got != size:
    raise ChunkError(job, f"the chunk file ended after {got} of {size} bytes")
  digest = xxhash.xxh3_64_hexdigest(buffer[:size])
  if digest != job.checksum:
    raise ChunkError(
      job, f"checksum mismatch: {CHECKSUM} of the file is {digest}, {job.checksum} was stored"
    )
  if job.target is not None:
    job.target[...] = buffer[: job.target.nbytes]
  return buffer


class ChunkIO:
  """Reads and writes a store's chunk files on a few threads each, with direct I/O where possible.

  Args:
    threads: threads for reads, and as many for writes: requests in flight each way.
    direct: use ``O_DIRECT`` (falls back to the page cache if the file system refuses it).
    piece: bytes per write request and per staging buffer (at most `PIECE`; a store with small
      chunk files needs no more than the largest).

  Examples:
    >>> import tempfile, os
    >>> io = ChunkIO(threads=2)
    >>> path = os.path.join(tempfile.mkdtemp(), "c")
    >>> (w,) = [WriteJob(path, np.arange(10, dtype=np.uint8), file_nbytes=16)]
    >>> io.write([w])
    >>> r = ReadJob(path, 16, w.checksum, target=np.empty(10, np.uint8))
    >>> io.read([r])
    >>> r.target.tolist(), os.path.getsize(path)
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 16)
    >>> io.shutdown()
  """

  def __init__(self, threads: int = 4, direct: bool = True, piece: int = PIECE):
    self.direct = bool(direct and _O_DIRECT)
    self._threads = threads
    self._piece = request_bytes(piece)
    self._read_pool = files.WorkerPool(threads, name="nvme-read")
    self._write_pool = files.WorkerPool(threads, name="nvme-write")
    self._staging: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
    self._staged = False
    self._mem_align: int | None = None  # learnt at the first direct write
    self._lock = threading.Lock()
    self.zero_copy_bytes = 0
    """Bytes written straight from the arrays, without a staging copy."""

  @property
  def threads(self) -> list:
    """The threads started so far."""
    return self._read_pool.threads + self._write_pool.threads

  @property
  def staging_bytes(self) -> int:
    """Bytes of the staging buffers of writes (allocated at the first write)."""
    return self._threads * self._piece

  def write(self, jobs: Sequence[WriteJob]) -> None:
    """Writes every job's file (concurrently) and sets its checksum.

    Raises:
      ChunkError: a file could not be written (the first failure).
    """
    if not self._staged:
      for _ in range(self._threads):
        self._staging.put(buffers.aligned_empty(self._piece))
      self._staged = True
    self._write_pool.map(self._write_one, jobs)

  def read(self, jobs: Sequence[ReadJob]) -> None:
    """Reads and verifies every job's file (concurrently).

    Raises:
      ChunkError: a file is missing, truncated, unreadable or corrupt (the first failure).
    """
    self._read_pool.map(self._read_one, jobs)

  def shutdown(self) -> None:
    """Stops the threads. Idempotent."""
    self._read_pool.shutdown()
    self._write_pool.shutdown()

  def _without_direct(self, path: str, error: OSError) -> None:
    if self.direct:
      self.direct = False
      logger.warning(
        "NVMe store: direct I/O refused for %s (%s); reading and writing through the page cache.",
        path,
        error,
      )

  def _read_one(self, job: ReadJob) -> None:
    direct = self.direct
    try:
      read_file(job, direct)
    except OSError as e:  # EINVAL from O_DIRECT: this file system or device does not take it
      self._without_direct(job.path, e)
      read_file(job, False)

  def _write_one(self, job: WriteJob) -> None:
    staging = self._staging.get()
    try:
      direct = self.direct
      try:
        self._write_file(job, staging, direct)
      except OSError as e:
        if not (direct and e.errno == errno.EINVAL):
          raise ChunkError(job, f"cannot be written: {e}") from e
        self._without_direct(job.path, e)
        try:
          self._write_file(job, staging, False)
        except OSError as e2:
          raise ChunkError(job, f"cannot be written: {e2}") from e2
    finally:
      self._staging.put(staging)

  def _write_file(self, job: WriteJob, staging: np.ndarray, direct: bool) -> None:
    # No O_TRUNC: a file of a spare generation (`files.Spares`) is written over in place, keeping its
    # blocks; one that a checkpoint hard-linked is replaced instead, since its data must not change.
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    fd = os.open(job.path, flags, 0o644)
    try:
      stat = os.fstat(fd)
      if stat.st_nlink > 1:
        os.close(fd)
        fd = -1
        os.unlink(job.path)
        fd = os.open(job.path, flags | os.O_EXCL, 0o644)
        stat = os.fstat(fd)
      if direct and self._mem_align is None:
        self._mem_align = dio_memory_alignment(fd)
      size, source = job.file_nbytes, job.source
      valid = source.nbytes
      if direct and valid >= size and size % ALIGN == 0 and self._aligned(source):
        # The whole file straight from the array, in one request: no staging copy, so nothing
        # gains from going piece by piece (XXH3 runs at the same speed from memory or cache).
        job.checksum = xxhash.xxh3_64_hexdigest(source[:size])
        _pwrite_all(fd, source[:size], 0)
        if stat.st_size > size:
          os.ftruncate(fd, size)
        with self._lock:
          self.zero_copy_bytes += size
        return
      digest = xxhash.xxh3_64()
      for position in range(0, size, self._piece):
        n = min(self._piece, size - position)
        m = min(max(valid - position, 0), n)
        piece = source[position : position + n]
        if direct and m == n and n % ALIGN == 0 and self._aligned(piece):
          digest.update(piece)
          _pwrite_all(fd, piece, position)
          with self._lock:
            self.zero_copy_bytes += n
          continue
        staging[:m] = piece[:m]
        # Direct I/O writes whole blocks: the tail past the file's end is cut off below.
        end = round_up(n) if direct else n
        staging[m:end] = 0
        digest.update(staging[:n])
        _pwrite_all(fd, staging[:end], position)
      if (direct and size % ALIGN) or stat.st_size > size:
        os.ftruncate(fd, size)
      if not direct:
        files.start_writeback(fd)
      job.checksum = digest.hexdigest()
    finally:
      if fd >= 0:
        os.close(fd)

  def _aligned(self, piece: np.ndarray) -> bool:
    """Whether direct I/O takes `piece`'s memory as it is (so it needs no staging copy)."""
    return bool(self._mem_align) and piece.ctypes.data % self._mem_align == 0
