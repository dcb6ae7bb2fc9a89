"""The NVMe tier: a generational, crash-safe array store on local disk.

Optimizer-state leaves that do not fit in host RAM live here, as one TensorStore ``zarr3`` array per leaf
over the ``file`` kvstore. The optimizer visits its groups of leaves in a fixed cyclic order every step: it
fetches group ``k`` of generation ``g``, updates it, and puts the result as group ``k`` of generation
``g + 1``; once every group is put, it commits ``g + 1``. The store overlaps that protocol with disk I/O: a
prefetch thread reads the next groups into a bounded pool of host buffers and a writer thread writes the new
groups behind the caller's back (write-behind), paying for durability once per generation.

On-disk layout (``directory`` is absolute)::

  directory/LOCK                    exclusive flock of the owning process; holds its pid
  directory/MANIFEST.json           the last committed generation, the kept ones, pins and leaf specs
  directory/gen_00000042/<leaf>/    one zarr3 array per leaf: raw ``bytes`` codec + ``crc32c`` checksum

Crash safety: a generation's files are written into a fresh ``gen_*`` directory (never over an older
generation), fsynced, and only then published by atomically replacing ``MANIFEST.json``. A crash at any
moment therefore leaves the last committed generation intact; a generation that is not in the manifest is
ignored and deleted the next time the store is opened.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

logger = logging.getLogger(__name__)

_MANIFEST = "MANIFEST.json"
_LOCK = "LOCK"
_GEN_RE = re.compile(r"^gen_(\d+)$")
_FORMAT = "optax_offload.nvme"
_FORMAT_VERSION = 1
_FSYNC_THREADS = 16

# No TensorStore cache (the store keeps its own bounded buffers), many concurrent file operations, and no
# fsync per write: durability is paid once per generation, in `_commit`.
_TS_CONTEXT = {
  "cache_pool": {"total_bytes_limit": 0},
  "file_io_concurrency": {"limit": 32},
  "file_io_sync": False,
}

# numpy dtype names that TensorStore's zarr3 driver stores natively (checked against tensorstore 0.1.86).
# Any other fixed-size dtype is stored as an unsigned integer of the same width and viewed back on read.
_ZARR3_NATIVE = frozenset(
  {
    "bool",
    "int2",
    "int4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
    "float4_e2m1fn",
    "float8_e3m4",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
  }
)
_UINT_OF_SIZE = {
  1: np.dtype(np.uint8),
  2: np.dtype(np.uint16),
  4: np.dtype(np.uint32),
  8: np.dtype(np.uint64),
}


_STAT_KEYS = (
  "fetches",
  "prefetch_hits",
  "buffer_hits",
  "misses",
  "waits",
  "prefetched",
  "commits",
  "bytes_written",
  "bytes_read",
  "buffer_bytes",
  "peak_buffer_bytes",
)


# The stores not closed yet, for the exit hook below (weak: an open store is kept alive by its own
# threads, and a closed one leaves the set).
_OPEN_STORES: weakref.WeakSet[NvmeStore] = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
  """At interpreter exit, flushes and closes every open store, so that queued puts and commits land.

  Without this the store's daemon threads die with the interpreter and the updates whose commits were
  still queued are lost (the store reopens at an older generation). atexit handlers run before daemon
  threads are stopped, so `close` can still wait for them. A failure is logged, not raised: the last
  committed generation stays intact whatever happens here.
  """
  for store in list(_OPEN_STORES):
    try:
      store.close()
    except Exception as e:  # Nobody is left to handle it.
      logger.error("NVMe store %s: flushing at exit failed: %s", store.directory, e)


class NvmeError(RuntimeError):
  """An error of the NVMe store (I/O, corruption, or a failed background write)."""


class NvmeCorruptionError(NvmeError):
  """Stored data failed verification: checksum mismatch, truncated, missing or mismatched file."""


class NvmeWriteError(NvmeError):
  """A background write or commit failed; the last committed generation is intact."""


class StaleGenerationError(ValueError):
  """A new generation was asked for from a stale one (neither the newest nor its parent)."""


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Name, shape and dtype of one stored leaf.

  Attributes:
    name: unique name of the leaf, e.g. ``"g003_l017"``; characters other than letters, digits, ``_``,
      ``.`` and ``-`` are replaced by ``_`` in the file name.
    shape: shape of the array.
    dtype: numpy dtype, including ``ml_dtypes`` ones such as ``bfloat16``.
  """

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  @property
  def nbytes(self) -> int:
    """Bytes of the array in memory."""
    return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class NvmeOptions:
  """Options of the NVMe store that `offload` opens (its ``nvme_options``).

  Host RAM held by the store: at most ``(prefetch_depth + write_depth + 1)`` x the largest group's
  NVMe bytes (`NvmeStore.host_buffer_bound`).

  Attributes:
    prefetch_depth: how many groups are read ahead of the update (0 disables prefetching).
    write_depth: how many groups may wait to be written behind the update (at least 1).
    chunk_bytes: target bytes per chunk file, split along the leading axis.

  Examples:
    >>> NvmeOptions(prefetch_depth=2)
    NvmeOptions(prefetch_depth=2, write_depth=1, chunk_bytes=16777216)
    >>> NvmeOptions.of({"write_depth": 2}).write_depth
    2
  """

  prefetch_depth: int = 1
  write_depth: int = 1
  chunk_bytes: int = 16 << 20

  def __post_init__(self):
    minimum = {"prefetch_depth": 0, "write_depth": 1, "chunk_bytes": 1}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"NvmeOptions.{field.name} must be an int, got {value!r}.")
      if value < minimum[field.name]:
        raise ValueError(f"NvmeOptions.{field.name} must be >= {minimum[field.name]}, got {value}.")
      object.__setattr__(self, field.name, int(value))

  @classmethod
  def of(cls, options: NvmeOptions | Mapping[str, Any] | None) -> NvmeOptions:
    """`options` as `NvmeOptions`: None gives the defaults; a dict (the older form) is converted.

    Raises:
      TypeError: a dict with keys that are not options (the message names the valid ones), or
        another type.
    """
    if options is None:
      return cls()
    if isinstance(options, cls):
      return options
    if isinstance(options, Mapping):
      valid = [field.name for field in dataclasses.fields(cls)]
      unknown = sorted(str(k) for k in options if k not in valid)
      if unknown:
        raise TypeError(
          f"nvme_options: unknown options {unknown}; the valid ones are {valid} "
          "(pass oo.NvmeOptions(...))."
        )
      return cls(**options)
    raise TypeError(
      f"nvme_options must be oo.NvmeOptions(...) (or a dict of its fields), got "
      f"{type(options).__name__}."
    )


def _storage_dtype(dtype: np.dtype) -> tuple[str, np.dtype]:
  """Returns the zarr3 ``data_type`` and the numpy dtype the bytes are written as."""
  if dtype.name in _ZARR3_NATIVE and dtype.isnative:
    return dtype.name, dtype
  if dtype.itemsize in _UINT_OF_SIZE and not dtype.fields and not dtype.subdtype:
    storage = _UINT_OF_SIZE[dtype.itemsize]
    return storage.name, storage
  raise ValueError(f"dtype {dtype} cannot be stored in the NVMe tier.")


def _chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
  """Chunks of at most about `chunk_bytes`, split along the leading axes (whole array if it is small).

  The split axis is cut into equal parts: zarr pads edge chunks to the full chunk shape on disk, so equal
  parts waste less than one row per chunk instead of up to a whole chunk.
  """
  shape = tuple(shape)
  for axis in range(len(shape)):
    inner = math.prod(shape[axis + 1 :]) * itemsize
    if inner <= chunk_bytes:
      length = max(shape[axis], 1)
      parts = -(-length // max(1, chunk_bytes // max(inner, 1)))
      rows = -(-length // parts)
      return (1,) * axis + (rows,) + tuple(max(d, 1) for d in shape[axis + 1 :])
  return tuple(max(d, 1) for d in shape)


def _zarr3_spec(
  path: str, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int]
) -> dict[str, Any]:
  """TensorStore spec that creates one leaf's zarr3 array at `path`."""
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path.rstrip("/") + "/"},
    "metadata": {
      "shape": list(shape),
      "data_type": dtype,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
      "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    },
    # Every chunk is written, even all-zero ones, so that a missing chunk file is an error on read.
    "store_data_equal_to_fill_value": True,
    "create": True,
    "delete_existing": True,
  }


def _zarr3_read_spec(path: str) -> dict[str, Any]:
  """TensorStore spec that opens one leaf's zarr3 array for a verified read."""
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path.rstrip("/") + "/"},
    "open": True,
    "fill_missing_data_reads": False,
  }


def _leaf_dirname(name: str) -> str:
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
  if not safe or safe.startswith("."):
    safe = "_" + safe
  return safe


def _fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
  fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _libc_sync_file_range():
  try:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.sync_file_range
  except (OSError, AttributeError):  # not Linux
    return None
  function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
  return function


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h


def _start_writeback(root: pathlib.Path) -> None:
  """Starts writing the dirty pages of every file under `root` to disk, without waiting for it.

  Files written through the page cache otherwise sit there until the commit's fsync, which leaves the disk
  idle while the step computes and then makes the commit wait for all of it (measured: a 1 GB-state step
  took 6.1 s without this, 4.9 s with it). Durability still comes from the commit's fsync.
  """
  if _SYNC_FILE_RANGE is None:
    return
  for dirpath, _, filenames in os.walk(root):
    for name in filenames:
      try:
        fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
      except OSError:
        continue
      try:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
      finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
  """Makes every file, then every directory, under `root` durable.

  fsyncs run on a few threads: one at a time leaves the disk's queue nearly empty (measured ~1.7x slower
  for 17 small files and for 32 files of 1 MiB on this machine's disk).
  """
  files, dirs = [], []
  for dirpath, _, filenames in os.walk(root, onerror=_raise):
    files.extend(os.path.join(dirpath, f) for f in filenames)
    dirs.append(dirpath)
  _on_threads(_fsync_path, files)
  _on_threads(functools.partial(_fsync_path, directory=True), dirs)


def _on_threads(function: Callable[[Any], None], items: Sequence[Any]) -> None:
  """Calls `function` on every item from up to `_FSYNC_THREADS` threads; re-raises the first error.

  Plain threads, not a `concurrent.futures` pool: those refuse work once the interpreter starts
  shutting down, and the exit hook (`_close_open_stores`) still commits through here.
  """
  todo, errors, lock = list(items), [], threading.Lock()

  def work() -> None:
    while True:
      with lock:
        if not todo or errors:
          return
        item = todo.pop()
      try:
        function(item)
      except BaseException as e:
        with lock:
          errors.append(e)

  threads = [
    threading.Thread(target=work, name="nvme-fsync", daemon=True)
    for _ in range(min(_FSYNC_THREADS, len(todo)) - 1)
  ]
  for thread in threads:
    thread.start()
  work()
  for thread in threads:
    thread.join()
  if errors:
    raise errors[0]


def _raise(error: OSError) -> None:
  raise error


def _rmtree(path: pathlib.Path) -> None:
  if path.is_symlink() or path.is_file():
    path.unlink(missing_ok=True)
  else:
    shutil.rmtree(path, ignore_errors=True)
  if path.exists():
    logger.warning("NVMe store: could not delete %s; it is deleted at the next open.", path)


def _item_refcount(items: list, i: int) -> int:
  return sys.getrefcount(items[i])


# What `_item_refcount` reports for a list item nothing else refers to (2 on CPython 3.11: the list's
# reference and the call's argument), measured rather than assumed, as interpreters differ in the
# temporary references they take.
_UNREFERENCED = _item_refcount([np.empty(0)], 0)


class _ReadBuffers:
  """Reusable host buffers for group reads, so a step's reads do not touch fresh memory.

  Fresh pages cost a page fault each on first touch (about 1 s per GB measured on a 2-core VM, as much as
  the read itself); reading into buffers that earlier steps already touched avoids that. A buffer is
  handed out again only once nothing else refers to it (its reference count: `fetch` hands out read-only
  views, which refer to it, and JAX drops them once it has copied the callback's result). At most
  `capacity` bytes of buffers are kept; beyond that, reads get fresh arrays that are not kept.
  """

  def __init__(self, capacity: int):
    self._capacity = capacity
    self._buffers: list[np.ndarray] = []
    self._lock = threading.Lock()

  def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    with self._lock:
      buffers = self._buffers
      for i in range(len(buffers)):
        free = _item_refcount(buffers, i) == _UNREFERENCED  # else a view or a caller still uses it
        if free and buffers[i].shape == shape and buffers[i].dtype == dtype:
          return buffers[i]
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      kept = sum(b.nbytes for b in buffers)
      i = 0
      while kept + nbytes > self._capacity and i < len(buffers):
        if _item_refcount(buffers, i) == _UNREFERENCED:  # free, but of another shape: drop it
          kept -= buffers.pop(i).nbytes
        else:
          i += 1
      array = np.empty(shape, dtype)
      if kept + nbytes <= self._capacity:
        buffers.append(array)
      return array

  def clear(self) -> None:
    with self._lock:
      self._buffers = []


def _readonly(array: np.ndarray) -> np.ndarray:
  view = array.view()
  view.flags.writeable = False
  return view


def _wait_all(
  futures: Iterable[tuple[Any, ts.Future]],
) -> tuple[list[Any], tuple[Any, Exception] | None]:
  """Waits for every future; returns the results and the first failure as ``(tag, exception)``."""
  results, failure = [], None
  for tag, future in futures:
    try:
      results.append(future.result())
    except Exception as e:  # TensorStore raises ValueError for every I/O status.
      results.append(None)
      if failure is None:
        failure = (tag, e)
  return results, failure


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A leaf spec plus where and how it is stored."""

  spec: LeafSpec
  dirname: str
  zarr_dtype: str
  storage_dtype: np.dtype
  chunk_shape: tuple[int, ...]


@dataclasses.dataclass
class _Write:
  group: int
  generation: int
  arrays: list[np.ndarray]

  @property
  def key(self) -> tuple[int, int]:
    return (self.group, self.generation)


@dataclasses.dataclass
class _Commit:
  generation: int
  parent: int | None = None


@dataclasses.dataclass
class _Pin:
  generation: int
  pinned: bool
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None


def _describe_spec_diff(
  old: list[list[dict[str, Any]]], new: list[list[dict[str, Any]]]
) -> list[str]:
  diffs = []
  if len(old) != len(new):
    diffs.append(f"{len(old)} groups stored, {len(new)} given")
  for g, (old_group, new_group) in enumerate(zip(old, new, strict=False)):
    if len(old_group) != len(new_group):
      diffs.append(f"group {g}: {len(old_group)} leaves stored, {len(new_group)} given")
    for i, (a, b) in enumerate(zip(old_group, new_group, strict=False)):
      for field in ("name", "shape", "dtype"):
        if a.get(field) != b[field]:
          diffs.append(f"group {g} leaf {i}: {field} {a.get(field)!r} stored, {b[field]!r} given")
  return diffs


def stored_groups(directory: str | os.PathLike) -> list[list[LeafSpec]]:
  """The leaf specs recorded in a store's manifest, to reopen it without knowing them.

  Raises:
    FileNotFoundError: the directory holds no committed store.
  """
  path = pathlib.Path(os.path.abspath(os.fspath(directory))) / _MANIFEST
  if not path.exists():
    raise FileNotFoundError(f"{path.parent} holds no committed NVMe store (no {_MANIFEST}).")
  manifest = json.loads(path.read_text())
  return [
    [LeafSpec(s["name"], tuple(s["shape"]), np.dtype(s["dtype"])) for s in group]
    for group in manifest["groups"]
  ]


class NvmeStore:
  """A generational, crash-safe store of groups of arrays on local disk (TensorStore zarr3).

  Generation ``g + 1`` never overwrites generation ``g``: each generation is a fresh directory, made durable
  with one fsync pass and published by atomically replacing ``MANIFEST.json``. After committing ``g`` the
  store keeps ``g``, its parent (the generation it was computed from; by default the previously committed
  one) and pinned ones, and deletes the rest. Each
  chunk carries a crc32c checksum; corrupt, truncated or missing files raise `NvmeCorruptionError`.

  The caller follows a cyclic protocol: `fetch` group ``k`` of generation ``g``, `put` its new value as
  group ``k`` of ``g + 1``, for every group in order, then `commit` ``g + 1``. `fetch` then prefetches the
  next ``prefetch_depth`` groups in that order (wrapping to group 0 of ``g + 1``, which is served from the
  write-behind buffers or read once its write is complete, never half-written); `put` returns at once unless
  ``write_depth`` writes are pending. Errors of background writes are kept and re-raised, with the leaf
  and the path, by the next `fetch`, `put`, `commit` or `sync`; the store then refuses further work, and
  reopening it finds the last committed generation.

  Host RAM: the store holds at most `host_buffer_bound` =
  ``(prefetch_depth + write_depth + 1) * max group bytes`` of array buffers: ``write_depth`` groups waiting
  to be written, ``prefetch_depth`` prefetched groups, and one more: the buffers of the group the caller
  is consuming, which the store reads the next groups into once the caller has let go of them (or a
  prefetch read whose group was dropped from the window while it was in flight). `fetch` returns read-only
  views of those buffers; a buffer is reused only once no view of it is left, so a caller that keeps them
  keeps valid data (and the store reads into fresh buffers meanwhile). Arrays returned by
  `read_generation` belong to the caller.

  Disk: the last two committed generations, pinned ones, and at most two more in flight (generation
  ``g + 1`` is written while ``g`` is fsynced; writing ``g + 2`` waits for ``g``'s commit): plan for
  ``4 * bytes_on_disk()`` plus pins; ``3 *`` suffices when commits keep up with writes.

  Threads: a writer, a committer (fsync, manifest, deletion; it runs a short-lived pool of fsync threads)
  and, if ``prefetch_depth > 0``, a prefetcher; all daemons, waiting on one condition variable.

  One process per directory: the store holds an exclusive ``flock`` on ``directory/LOCK`` until `close`.
  Call `close` (or use the store as a context manager). A store still open at interpreter exit is closed
  then, so queued puts and commits land; a process that is killed loses them, and the store reopens at
  the last committed generation.

  Examples:
    >>> import tempfile
    >>> import numpy as np
    >>> groups = [[LeafSpec("mu", (4,), np.float32)], [LeafSpec("nu", (2, 2), np.float32)]]
    >>> with NvmeStore(tempfile.mkdtemp(), groups) as store:
    ...   store.write_initial(0, {"mu": np.zeros(4, np.float32), "nu": np.ones((2, 2), np.float32)})
    ...   for group in range(2):
    ...     (x,) = store.fetch(group, 0)
    ...     store.put(group, 1, [x + 1])
    ...   store.commit(1)
    ...   store.sync()
    ...   print(store.committed_generation, store.read_generation()["nu"].tolist())
    1 [[2.0, 2.0], [2.0, 2.0]]
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    groups: Sequence[Sequence[LeafSpec]],
    *,
    prefetch_depth: int = 1,
    write_depth: int = 1,
    chunk_bytes: int = 16 << 20,
    create: bool = True,
  ):
    """Opens (or creates) the store in `directory` and takes its lock.

    Args:
      directory: directory of the store; made absolute.
      groups: the leaves, in groups; the order of groups is the cyclic order of `fetch` and `put`.
      prefetch_depth: how many groups ahead `fetch` prefetches (0 disables prefetching).
      write_depth: how many `put` writes may be pending before `put` blocks (at least 1).
      chunk_bytes: target bytes per chunk file, split along the leading axis.
      create: make `directory` if it does not exist.

    Raises:
      FileNotFoundError: `directory` does not exist and ``create=False``.
      NotADirectoryError: `directory` (or a parent) is a regular file.
      PermissionError: `directory` cannot be created or written.
      RuntimeError: another store (in this or another process) holds the directory.
      ValueError: invalid arguments, or the committed generation holds different leaves.
      NvmeCorruptionError: the manifest cannot be read.
    """
    if prefetch_depth < 0:
      raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}.")
    if write_depth < 1:
      raise ValueError(f"write_depth must be >= 1, got {write_depth}.")
    if chunk_bytes < 1:
      raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}.")
    self._groups = [list(group) for group in groups]
    if not self._groups or any(not group for group in self._groups):
      raise ValueError("groups must be a non-empty sequence of non-empty sequences of LeafSpec.")
    self._leaves = self._make_leaves(self._groups, chunk_bytes)
    self._group_bytes = [sum(spec.nbytes for spec in group) for group in self._groups]
    self._prefetch_depth = prefetch_depth
    self._write_depth = write_depth
    self._chunk_bytes = chunk_bytes
    self._dir = pathlib.Path(os.path.abspath(os.path.expanduser(os.fspath(directory))))

    self._cond = threading.Condition()
    # Writes, commits and pins in call order; the writer thread writes and passes the others, in order, to
    # `_commits`, so that fsyncing generation g overlaps with writing g + 1.
    self._queue: collections.deque[_Write | _Commit | _Pin] = collections.deque()
    self._commits: collections.deque[_Commit | _Pin] = collections.deque()
    self._writing: _Write | None = None
    self._committing: _Commit | _Pin | None = None
    self._cleanup_needed = False
    self._cleaning = False
    self._pending_writes = 0
    self._last_queued_commit = -1
    self._wbuf: dict[tuple[int, int], list[np.ndarray]] = {}
    self._wbuf_count: collections.Counter[tuple[int, int]] = collections.Counter()
    self._written: set[tuple[int, int]] = set()
    self._pool: dict[tuple[int, int], list[np.ndarray]] = {}
    self._wanted: list[tuple[int, int]] = []
    self._prefetch_failed: set[tuple[int, int]] = set()
    self._reading: tuple[int, int] | None = None
    self._readers: collections.Counter[tuple[int, int]] = collections.Counter()
    self._error: BaseException | None = None
    self._error_reported = True
    self._stop = False
    self._closed = False
    self._stats = collections.Counter({k: 0 for k in _STAT_KEYS})
    # Prefetched groups, plus the group the caller is consuming.
    self._read_buffers = _ReadBuffers((prefetch_depth + 1) * max(self._group_bytes))
    self._committed = -1
    self._previous = -1
    self._newest = -1  # the newest generation number used (committed, put or handed out)
    self._children: dict[int, int] = {}  # parent -> the generation last made from it
    # Lineage: the newest generation (handed out by `new_generation`, else the committed one) and
    # the generation it was made from; a new generation may only be made from one of the two.
    self._head: int | None = None
    self._head_parent: int | None = None
    self._on_disk: list[int] = []
    self._pinned: set[int] = set()
    self._stale_pins = False

    self._prepare_directory(create)
    self._lock_fd = self._acquire_lock()
    try:
      self._load_manifest()
      if self._stale_pins:
        self._write_manifest()
      self._remove_unpublished()
      self._ctx = ts.Context(_TS_CONTEXT)
    except BaseException:
      self._release_lock()
      raise
    self._last_queued_commit = self._committed
    self._newest = max([self._committed, *self._on_disk])
    if self._committed >= 0:
      self._head = self._committed
      self._head_parent = self._previous if self._previous >= 0 else None
    self._writer = threading.Thread(target=self._writer_loop, name="nvme-writer", daemon=True)
    self._writer.start()
    self._committer = threading.Thread(
      target=self._committer_loop, name="nvme-committer", daemon=True
    )
    self._committer.start()
    self._prefetcher = None
    if prefetch_depth > 0:
      self._prefetcher = threading.Thread(
        target=self._prefetch_loop, name="nvme-prefetch", daemon=True
      )
      self._prefetcher.start()
    _OPEN_STORES.add(self)
    logger.info(
      "NVMe store %s opened: %d leaves in %d groups, %d bytes per generation, committed generation %d.",
      self._dir,
      sum(len(g) for g in self._groups),
      len(self._groups),
      self.bytes_on_disk(),
      self._committed,
    )

  # ---------------------------------------------------------------------------------------------------
  # Opening.

  @staticmethod
  def _make_leaves(groups: list[list[LeafSpec]], chunk_bytes: int) -> list[list[_Leaf]]:
    names, dirnames, leaves = set(), {}, []
    for group in groups:
      out = []
      for spec in group:
        if not isinstance(spec, LeafSpec):
          raise ValueError(f"groups must hold LeafSpec, got {spec!r}.")
        if spec.name in names:
          raise ValueError(f"duplicate leaf name {spec.name!r}.")
        names.add(spec.name)
        dirname = _leaf_dirname(spec.name)
        if dirname in dirnames:
          raise ValueError(
            f"leaf names {dirnames[dirname]!r} and {spec.name!r} map to the same file name {dirname!r}."
          )
        dirnames[dirname] = spec.name
        zarr_dtype, storage = _storage_dtype(spec.dtype)
        chunks = _chunk_shape(spec.shape, storage.itemsize, chunk_bytes)
        out.append(_Leaf(spec, dirname, zarr_dtype, storage, chunks))
      leaves.append(out)
    return leaves

  def _prepare_directory(self, create: bool) -> None:
    d = self._dir
    if d.exists() and not d.is_dir():
      raise NotADirectoryError(
        f"NVMe store path {d} exists but is not a directory; pass a directory."
      )
    if not d.exists():
      if not create:
        raise FileNotFoundError(
          f"NVMe store directory {d} does not exist (create=False); pass create=True or point nvme_dir "
          "at an existing store."
        )
      try:
        d.mkdir(parents=True, exist_ok=True)
      except NotADirectoryError as e:
        raise NotADirectoryError(
          f"cannot create NVMe store directory {d}: a parent is not a directory ({e}); choose another "
          "nvme_dir."
        ) from e
      except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
          raise PermissionError(
            e.errno,
            f"cannot create NVMe store directory {d}: {e.strerror}. Choose a writable nvme_dir on a "
            "local disk, or fix its permissions.",
          ) from e
        raise

  def _acquire_lock(self) -> int:
    path = self._dir / _LOCK
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
      if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise PermissionError(
          e.errno,
          f"NVMe store directory {self._dir} is not writable ({e.strerror}). Choose a writable nvme_dir "
          "on a local disk, or fix its permissions.",
        ) from e
      raise
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      who = "this process" if holder == str(os.getpid()) else "process"
      raise RuntimeError(
        f"NVMe store directory {self._dir} is locked by another NvmeStore ({who} pid {holder}). Close "
        "the optimizer state that holds it with oo.close_nvme(state) (or let that process exit), or "
        "use another nvme_dir."
      ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

  def _release_lock(self) -> None:
    if self._lock_fd is not None:
      try:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
      finally:
        os.close(self._lock_fd)
        self._lock_fd = None

  def _groups_json(self) -> list[list[dict[str, Any]]]:
    return [
      [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in group]
      for group in self._groups
    ]

  def _load_manifest(self) -> None:
    path = self._dir / _MANIFEST
    if not path.exists():
      return
    try:
      manifest = json.loads(path.read_text())
      if manifest.get("format") != _FORMAT:
        raise ValueError(f"format {manifest.get('format')!r} is not {_FORMAT!r}")
      committed = int(manifest["committed_generation"])
      previous = int(manifest.get("previous_generation", -1))
      on_disk = sorted(int(g) for g in manifest["generations"])
      pinned = {int(g) for g in manifest.get("pinned", [])}
      stored_groups = manifest["groups"]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise NvmeCorruptionError(
        f"NVMe store manifest {path} cannot be read ({e}); restore it from a checkpoint or delete "
        f"{self._dir} to start over."
      ) from e
    diffs = _describe_spec_diff(stored_groups, self._groups_json())
    if diffs:
      shown = "; ".join(diffs[:10]) + (f"; ... ({len(diffs) - 10} more)" if len(diffs) > 10 else "")
      raise ValueError(
        f"NVMe store {self._dir} holds committed generation {committed} for different leaves: {shown}. "
        "Use another nvme_dir, or delete that directory to start over."
      )
    # Pins belong to the process that made them (a checkpoint save in progress); a new process drops
    # them, and the generations only they kept are deleted with the unpublished ones.
    if pinned:
      logger.warning(
        "NVMe store %s: dropping pins %s left by an earlier process.", self._dir, sorted(pinned)
      )
      on_disk = [g for g in on_disk if g in (committed, previous)]
    self._committed, self._previous, self._on_disk, self._pinned = (
      committed,
      previous,
      on_disk,
      set(),
    )
    self._stale_pins = bool(pinned)
    missing = [g for g in on_disk if not self.generation_path(g).is_dir()]
    if missing:
      logger.warning(
        "NVMe store %s: generations %s are in the manifest but not on disk.", self._dir, missing
      )

  def _remove_unpublished(self) -> None:
    """Deletes generations that were never committed (a crash or failure mid-write) or left over."""
    (self._dir / (_MANIFEST + ".tmp")).unlink(missing_ok=True)
    keep = set(self._on_disk)
    for entry in sorted(os.listdir(self._dir)):
      match = _GEN_RE.match(entry)
      if match and int(match.group(1)) not in keep:
        logger.warning("NVMe store %s: deleting uncommitted or stale %s.", self._dir, entry)
        _rmtree(self._dir / entry)

  # ---------------------------------------------------------------------------------------------------
  # Public surface.

  @property
  def directory(self) -> pathlib.Path:
    """The absolute directory of the store."""
    return self._dir

  @property
  def groups(self) -> list[list[LeafSpec]]:
    """The leaf specs, in groups."""
    return [list(group) for group in self._groups]

  @property
  def committed_generation(self) -> int:
    """The last committed (durable, published) generation; -1 if none."""
    with self._cond:
      return self._committed

  @property
  def host_buffer_bound(self) -> int:
    """Most bytes of array buffers the store holds: ``(prefetch_depth + write_depth + 1) * max group``."""
    return (self._prefetch_depth + self._write_depth + 1) * max(self._group_bytes)

  @property
  def stats(self) -> dict[str, int]:
    """Counters: fetches, prefetch_hits, buffer_hits, misses, waits, bytes_written, bytes_read, ...

    ``prefetch_hits`` are fetches served by the prefetch pool, ``buffer_hits`` by the write-behind buffers,
    ``misses`` read from disk by `fetch` itself; ``waits`` of the hits waited for an in-flight prefetch.
    ``buffer_bytes`` and ``peak_buffer_bytes`` are the host bytes held now and at most so far.
    """
    with self._cond:
      return dict(self._stats)

  def generation_path(self, generation: int) -> pathlib.Path:
    """The directory holding `generation`'s files (e.g. to hard-link them into a checkpoint)."""
    return self._dir / f"gen_{int(generation):08d}"

  def bytes_on_disk(self) -> int:
    """Logical bytes of one generation (the sum of the leaves' ``nbytes``)."""
    return sum(self._group_bytes)

  @property
  def generations_on_disk(self) -> list[int]:
    """Committed generations kept on disk (the last, the previous and pinned ones)."""
    with self._cond:
      return list(self._on_disk)

  def new_generation(self, parent: int | None = None) -> int:
    """A generation number newer than any used so far, for the next `put`s and `commit`.

    The store keeps the lineage of what it hands out: the newest generation (the last one this
    method returned; after opening, the committed one) and the generation it was made from. A new
    generation may only be made from one of these two. Any older generation is *stale*: the store
    may already have deleted it, and committing a generation made from it would in turn delete the
    newest one. Making one from the newest's parent (as `optax.MultiSteps` does at every mini-step)
    makes the newest stale instead.

    Args:
      parent: the generation the new one is computed from. Fetching the last group of `parent` then
        prefetches group 0 of the new generation, and committing the new one with ``parent=`` keeps
        `parent` on disk (e.g. for `optax.MultiSteps`, which computes every mini-step from one state).
        None starts a new lineage (a generation written from scratch).

    Raises:
      StaleGenerationError: `parent` is neither the newest generation nor that one's parent; nothing
        changes in the store.
    """
    with self._cond:
      self._check_usable_locked()
      if parent is not None:
        parent = int(parent)
        if self._head is None or parent not in (self._head, self._head_parent):
          newest = "none" if self._head is None else self._head
          made_from = "" if self._head_parent is None else f", made from {self._head_parent}"
          raise StaleGenerationError(
            f"NVMe store {self._dir}: generation {parent} is stale: the newest generation is "
            f"{newest}{made_from}, and a new generation can only be made from those."
          )
      self._newest += 1
      if parent is not None:
        self._children = {parent: self._newest}
      self._head, self._head_parent = self._newest, parent
      return self._newest

  def write_initial(self, generation: int, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes every leaf of `generation` and commits it; returns once it is durable.

    Args:
      generation: the generation to write; newer than any committed one.
      arrays: one array per leaf name.

    Raises:
      ValueError: leaves are missing, unknown, or of the wrong shape or dtype.
      NvmeWriteError: writing failed (the previously committed generation is intact).
    """
    names = {spec.name for group in self._groups for spec in group}
    missing = sorted(names - set(arrays))
    unknown = sorted(set(arrays) - names)
    if missing or unknown:
      raise ValueError(f"write_initial: missing leaves {missing}, unknown leaves {unknown}.")
    for group_index, group in enumerate(self._groups):
      self.put(group_index, generation, [arrays[spec.name] for spec in group])
    self.commit(generation)
    self.sync()

  def fetch(self, group: int, generation: int) -> list[np.ndarray]:
    """Returns the group's arrays at `generation`, in `LeafSpec` order, and prefetches the next groups.

    The arrays come from the prefetch pool or the write-behind buffers when present, else from disk (with
    checksums verified). They are read-only views; copy before mutating them in place.

    Args:
      group: index of the group.
      generation: a committed generation on disk, or one whose group was `put` (written or pending).

    Returns:
      The group's arrays.

    Raises:
      ValueError: that group of that generation is neither on disk nor put.
      NvmeCorruptionError: the data on disk failed verification.
      NvmeWriteError: an earlier background write failed.
    """
    self._check_group(group)
    key = (group, int(generation))
    waited = False
    with self._cond:
      self._check_usable_locked()
      self._stats["fetches"] += 1
      while True:
        if key in self._pool:
          arrays = self._pool.pop(key)
          self._stats["prefetch_hits"] += 1
        elif key in self._wbuf:
          arrays = self._wbuf[key]
          self._stats["buffer_hits"] += 1
        elif self._reading == key:
          waited = True
          self._cond.wait()
          continue
        elif self._readable_locked(key):
          arrays = None
          self._stats["misses"] += 1
          self._readers[key] += 1
        else:
          raise ValueError(
            f"NVMe store: group {group} of generation {generation} is neither committed on disk "
            f"(generations {self._on_disk}) nor put."
          )
        break
      if waited and arrays is not None:
        self._stats["waits"] += 1
      self._schedule_locked(key)
      self._note_buffers_locked()
    if arrays is None:
      try:
        arrays = self._read_group(group, key[1])
      finally:
        with self._cond:
          self._release_readers_locked([key])
    return [_readonly(a) for a in arrays]

  def put(self, group: int, generation: int, arrays: Sequence[np.ndarray]) -> None:
    """Hands over the group's new arrays for `generation`; they are written in the background.

    Returns at once unless ``write_depth`` writes are already pending, then blocks until one is done. The
    store keeps references to the arrays: do not mutate them afterwards. A `jax.Array` is accepted as is
    (``np.asarray`` of a CPU array is a read-only view that keeps its buffer alive).

    Args:
      group: index of the group.
      generation: newer than the committed generation and than any generation passed to `commit`.
      arrays: the group's arrays, in `LeafSpec` order, with the specs' shapes and dtypes.

    Raises:
      ValueError: bad group, generation, shapes or dtypes.
      NvmeWriteError: an earlier background write failed.
    """
    self._check_group(group)
    generation = int(generation)
    arrays = list(arrays)
    specs = self._groups[group]
    if len(arrays) != len(specs):
      raise ValueError(f"put: group {group} has {len(specs)} leaves, got {len(arrays)} arrays.")
    held = []
    for spec, array in zip(specs, arrays, strict=True):
      array = np.asarray(array)
      if array.shape != spec.shape or array.dtype != spec.dtype:
        raise ValueError(
          f"put: leaf {spec.name!r} expects {spec.dtype}{list(spec.shape)}, got "
          f"{array.dtype}{list(array.shape)}."
        )
      held.append(_readonly(array))
    key = (group, generation)
    with self._cond:
      self._check_usable_locked()
      if generation <= self._last_queued_commit:
        raise ValueError(
          f"put: generation {generation} is not newer than committed generation {self._last_queued_commit}; "
          "committed generations are immutable."
        )
      while self._pending_writes >= self._write_depth and self._error is None and not self._stop:
        self._cond.wait()
      self._check_usable_locked()
      self._queue.append(_Write(group, generation, held))
      self._newest = max(self._newest, generation)
      self._pending_writes += 1
      self._wbuf[key] = held
      self._wbuf_count[key] += 1
      self._written.discard(key)
      if key in self._pool:
        self._pool[key] = held
      self._note_buffers_locked()
      self._cond.notify_all()

  def commit(self, generation: int, parent: int | None = None) -> None:
    """Queues the commit of `generation` behind the puts; returns at once.

    Once every group of `generation` is written, the store makes its files durable, atomically publishes
    it in ``MANIFEST.json``, and deletes every other generation except `parent` and pinned ones. Errors
    surface on the next call (or `sync`).

    Args:
      generation: a generation whose every group was `put`.
      parent: the committed generation `generation` was computed from, kept on disk so that it can be
        fetched again; defaults to the previously committed generation.

    Raises:
      ValueError: a group of `generation` was not put, or `generation` is not newer than the last commit.
      NvmeWriteError: an earlier background write failed.
    """
    generation = int(generation)
    with self._cond:
      self._check_usable_locked()
      if generation <= self._last_queued_commit:
        raise ValueError(
          f"commit: generation {generation} is not newer than generation {self._last_queued_commit}."
        )
      missing = [
        g
        for g in range(len(self._groups))
        if (g, generation) not in self._wbuf and (g, generation) not in self._written
      ]
      if missing:
        raise ValueError(f"commit: groups {missing} of generation {generation} were not put.")
      self._last_queued_commit = generation
      self._queue.append(_Commit(generation, None if parent is None else int(parent)))
      self._cond.notify_all()

  def sync(self) -> None:
    """Blocks until every queued put and commit is durable; re-raises any background error."""
    with self._cond:
      self._check_open_locked()
      while not self._idle_locked() and self._error is None:
        self._cond.wait()
      self._raise_error_locked()

  def pin(self, generation: int) -> None:
    """Keeps a committed generation on disk until `unpin` (e.g. while a checkpoint copies it).

    Ordered after queued commits, so ``commit(g); pin(g)`` works. Blocks until the manifest records it.

    Raises:
      ValueError: `generation` is not a committed generation on disk.
    """
    self._pin(generation, True)

  def unpin(self, generation: int) -> None:
    """Undoes `pin`; the generation is deleted unless it is the last or previous committed one."""
    self._pin(generation, False)

  def read_generation(self, generation: int | None = None) -> dict[str, np.ndarray]:
    """Reads and verifies every leaf of a committed generation (waits for its queued commit).

    Args:
      generation: the generation; defaults to the last committed one.

    Returns:
      A dict from leaf name to array.

    Raises:
      ValueError: the generation is not committed on disk.
      NvmeCorruptionError: the data on disk failed verification.
    """
    with self._cond:
      self._check_open_locked()
      if generation is None:
        self._wait_for_commits_locked(self._last_queued_commit)
        generation = self._committed
      else:
        generation = int(generation)
        self._wait_for_commits_locked(generation)
      if generation not in self._on_disk:
        raise ValueError(
          f"read_generation: generation {generation} of {self._dir} is not committed on disk "
          f"(committed generations on disk: {self._on_disk})."
        )
      keys = [(g, generation) for g in range(len(self._groups))]
      for key in keys:
        self._readers[key] += 1
    try:
      leaves = [leaf for group in self._leaves for leaf in group]
      arrays = self._read_leaves(generation, leaves)
    finally:
      with self._cond:
        self._release_readers_locked(keys)
    return {leaf.spec.name: array for leaf, array in zip(leaves, arrays, strict=True)}

  def close(self) -> None:
    """Waits for queued work, stops the threads and releases the lock. Idempotent.

    Raises:
      NvmeWriteError: a background error that no earlier call reported (after cleaning up).
    """
    with self._cond:
      if self._closed:
        return
      while not self._idle_locked() and self._error is None:
        self._cond.wait()
      self._stop = True
      self._closed = True
      self._pool.clear()
      self._read_buffers.clear()
      self._wanted = []
      self._cond.notify_all()
      error = None if self._error_reported else self._error
      self._error_reported = True
    self._writer.join()
    self._committer.join()
    if self._prefetcher is not None:
      self._prefetcher.join()
    self._release_lock()
    _OPEN_STORES.discard(self)
    logger.info("NVMe store %s closed at committed generation %d.", self._dir, self._committed)
    if error is not None:
      raise error

  def __enter__(self) -> NvmeStore:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    try:
      self.close()
    except NvmeError as e:
      logger.error(
        "NVMe store %s: error while closing after %s: %s", self._dir, exc_type.__name__, e
      )

  def __repr__(self) -> str:
    return f"NvmeStore({str(self._dir)!r}, groups={len(self._groups)}, committed_generation={self._committed})"

  # ---------------------------------------------------------------------------------------------------
  # Helpers that run under `self._cond`.

  def _check_group(self, group: int) -> None:
    if not 0 <= group < len(self._groups):
      raise ValueError(f"group {group} out of range [0, {len(self._groups)}).")

  def _check_open_locked(self) -> None:
    if self._closed:
      raise RuntimeError(f"NVMe store {self._dir} is closed.")

  def _raise_error_locked(self) -> None:
    if self._error is not None:
      self._error_reported = True
      raise self._error

  def _check_usable_locked(self) -> None:
    self._check_open_locked()
    self._raise_error_locked()

  def _release_readers_locked(self, keys: Iterable[tuple[int, int]]) -> None:
    for key in keys:
      self._readers[key] -= 1
      if self._readers[key] <= 0:
        del self._readers[key]
    self._cond.notify_all()

  def _readable_locked(self, key: tuple[int, int]) -> bool:
    return key[1] in self._on_disk or key in self._written

  def _wait_for_commits_locked(self, generation: int) -> None:
    def queued() -> bool:
      ops = [*self._queue, *self._commits, self._committing]
      return any(isinstance(op, _Commit) and op.generation <= generation for op in ops)

    while queued() and self._error is None:
      self._cond.wait()
    self._raise_error_locked()

  def _schedule_locked(self, key: tuple[int, int]) -> None:
    """Sets the prefetch window to the `prefetch_depth` groups after `key` in cyclic order."""
    group, generation = key
    wanted = []
    for _ in range(self._prefetch_depth):
      group += 1
      if group == len(self._groups):
        group, generation = 0, self._children.get(generation, generation + 1)
      wanted.append((group, generation))
    self._wanted = wanted
    self._pool = {k: v for k, v in self._pool.items() if k in wanted}
    self._prefetch_failed.clear()
    self._cond.notify_all()

  def _note_buffers_locked(self) -> None:
    seen, total = set(), 0
    held = [op.arrays for op in [*self._queue, self._writing] if isinstance(op, _Write)]
    held += list(self._pool.values())
    for arrays in held:
      for array in arrays:
        if id(array) not in seen:
          seen.add(id(array))
          total += array.nbytes
    if self._reading is not None:
      total += self._group_bytes[self._reading[0]]
    self._stats["buffer_bytes"] = total
    self._stats["peak_buffer_bytes"] = max(self._stats["peak_buffer_bytes"], total)

  def _commit_pending_locked(self, before: int) -> bool:
    """Whether the commit of a generation older than `before` is queued or running."""
    ops = [*self._commits, self._committing]
    return any(isinstance(op, _Commit) and op.generation < before for op in ops)

  def _idle_locked(self) -> bool:
    return not (
      self._queue
      or self._commits
      or self._writing
      or self._committing
      or self._cleanup_needed
      or self._cleaning
    )

  def _fail_locked(self, error: BaseException) -> None:
    """Keeps `error` for the caller, drops queued work and has the committer clean up."""
    if self._error is None:
      self._error = error
      self._error_reported = False
      logger.error("NVMe store %s: %s", self._dir, error)
    while self._queue or self._commits:
      op = (self._queue or self._commits).popleft()
      if isinstance(op, _Write):
        self._finish_write_locked(op, ok=False)
      elif isinstance(op, _Pin):
        op.error = self._error
        op.done.set()
    self._cleanup_needed = True
    self._note_buffers_locked()
    self._cond.notify_all()

  def _finish_write_locked(self, op: _Write, ok: bool) -> None:
    self._pending_writes -= 1
    self._wbuf_count[op.key] -= 1
    if self._wbuf_count[op.key] <= 0:
      del self._wbuf_count[op.key]
      arrays = self._wbuf.pop(op.key, None)
      if ok:
        self._written.add(op.key)
        if arrays is not None and op.key in self._wanted and op.key not in self._pool:
          self._pool[op.key] = arrays

  # ---------------------------------------------------------------------------------------------------
  # Disk I/O.

  def _read_group(self, group: int, generation: int) -> list[np.ndarray]:
    return self._read_leaves(generation, self._leaves[group], self._read_buffers)

  def _read_leaves(
    self, generation: int, leaves: Sequence[_Leaf], buffers: _ReadBuffers | None = None
  ) -> list[np.ndarray]:
    """Reads and verifies `leaves` of `generation`; into reusable `buffers` if given, else fresh arrays."""
    gen_dir = self.generation_path(generation)
    paths = [gen_dir / leaf.dirname for leaf in leaves]
    opens = [
      ((leaf, path), ts.open(_zarr3_read_spec(str(path)), context=self._ctx))
      for leaf, path in zip(leaves, paths, strict=True)
    ]
    stores, failure = _wait_all(opens)
    if failure is None:
      for (leaf, path), store in zip([tag for tag, _ in opens], stores, strict=True):
        shape, dtype = tuple(store.domain.shape), store.dtype.numpy_dtype
        if shape != leaf.spec.shape or dtype != leaf.storage_dtype:
          failure = (
            (leaf, path),
            ValueError(
              f"stored as {dtype}{list(shape)}, expected {leaf.storage_dtype}{list(leaf.spec.shape)}"
            ),
          )
          break
    if failure is None:
      # Lists, not generators: every read is issued before `_wait_all` waits for the first.
      if buffers is None:
        arrays, failure = _wait_all(
          [(tag, store.read()) for (tag, _), store in zip(opens, stores, strict=True)]
        )
      else:
        arrays = [buffers.take(leaf.spec.shape, leaf.storage_dtype) for leaf in leaves]
        _, failure = _wait_all(
          [
            (tag, ts.array(array, copy=False, write=True).write(store))
            for (tag, _), store, array in zip(opens, stores, arrays, strict=True)
          ]
        )
    if failure is not None:
      (leaf, path), e = failure
      message = f"NVMe store: leaf {leaf.spec.name!r} of generation {generation} at {path} failed verification: {e}"
      raise NvmeCorruptionError(message) from e
    out = []
    for leaf, array in zip(leaves, arrays, strict=True):
      out.append(array.view(leaf.spec.dtype) if leaf.storage_dtype != leaf.spec.dtype else array)
    with self._cond:
      self._stats["bytes_read"] += sum(a.nbytes for a in out)
    return out

  def _write_group(self, op: _Write) -> None:
    gen_dir = self.generation_path(op.generation)
    opens = []
    for leaf, array in zip(self._leaves[op.group], op.arrays, strict=True):
      path = gen_dir / leaf.dirname
      spec = _zarr3_spec(str(path), leaf.spec.shape, leaf.zarr_dtype, leaf.chunk_shape)
      opens.append(((leaf, path, array), ts.open(spec, context=self._ctx)))
    stores, failure = _wait_all(opens)
    if failure is None:
      writes = []
      for ((leaf, path, array), _), store in zip(opens, stores, strict=True):
        if leaf.storage_dtype != leaf.spec.dtype:
          array = np.ascontiguousarray(array).view(leaf.storage_dtype)
        # `put` holds read-only arrays that nobody mutates: TensorStore may encode from them directly
        # instead of first copying them into its own buffers (measured: ~0.3 s less CPU per GB written).
        writes.append(
          ((leaf, path, array), store.write(array, can_reference_source_data_indefinitely=True))
        )
      _, failure = _wait_all(writes)
    if failure is not None:
      (leaf, path, _), e = failure
      hint = ""
      if "space" in str(e).lower() or "ENOSPC" in str(e):
        hint = (
          f" The disk looks full: the store needs room for 3 to 4 generations of {self.bytes_on_disk()} "
          "bytes (two committed ones and those being written), plus pinned ones."
        )
      raise NvmeWriteError(
        f"NVMe store: writing leaf {leaf.spec.name!r} of generation {op.generation} to {path} failed: "
        f"{e}.{hint}"
      ) from e
    for leaf in self._leaves[op.group]:
      _start_writeback(gen_dir / leaf.dirname)
    with self._cond:
      self._stats["bytes_written"] += sum(a.nbytes for a in op.arrays)

  def _write_manifest(self) -> None:
    """Atomically publishes the committed state (called with the state already updated in memory)."""
    with self._cond:
      doc = {
        "format": _FORMAT,
        "version": _FORMAT_VERSION,
        "committed_generation": self._committed,
        "previous_generation": self._previous,
        "generations": list(self._on_disk),
        "pinned": sorted(self._pinned),
        "groups": self._groups_json(),
        "writer_pid": os.getpid(),
        "written_at": time.time(),
      }
    path, tmp = self._dir / _MANIFEST, self._dir / (_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
      json.dump(doc, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(self._dir, directory=True)

  def _commit(self, generation: int, parent: int | None) -> None:
    start = time.perf_counter()
    try:
      _fsync_tree(self.generation_path(generation))
      _fsync_path(self._dir, directory=True)
    except OSError as e:
      raise NvmeWriteError(
        f"NVMe store: making generation {generation} durable at {self.generation_path(generation)} "
        f"failed: {e}"
      ) from e
    synced = time.perf_counter()
    with self._cond:
      old = (self._committed, self._previous, self._on_disk)
      previous = self._committed if parent is None else parent
      if previous not in self._on_disk:
        previous = -1
      keep = {generation, previous} | (self._pinned & set(self._on_disk))
      keep.discard(-1)
      drop = [g for g in self._on_disk if g not in keep]
      self._committed, self._previous, self._on_disk = generation, previous, sorted(keep)
    try:
      self._write_manifest()
    except OSError as e:
      with self._cond:
        self._committed, self._previous, self._on_disk = old
      raise NvmeWriteError(
        f"NVMe store: publishing generation {generation} in {self._dir / _MANIFEST} failed: {e}"
      ) from e
    with self._cond:
      self._written = {k for k in self._written if k[1] != generation}
      self._stats["commits"] += 1
      self._cond.notify_all()
    self._delete_generations(drop)
    logger.debug(
      "NVMe store %s: committed generation %d (fsync %.3fs, publish %.3fs), deleted %s.",
      self._dir,
      generation,
      synced - start,
      time.perf_counter() - synced,
      drop,
    )

  def _delete_generations(self, generations: Sequence[int]) -> None:
    with self._cond:
      while any(self._readers[k] for k in list(self._readers) if k[1] in generations):
        self._cond.wait()
    for generation in generations:
      _rmtree(self.generation_path(generation))

  def _run_pin(self, op: _Pin) -> None:
    with self._cond:
      if op.generation not in self._on_disk:
        raise ValueError(
          f"generation {op.generation} is not a committed generation on disk ({self._on_disk})."
        )
      if op.pinned:
        self._pinned.add(op.generation)
        drop = []
      else:
        self._pinned.discard(op.generation)
        drop = [] if op.generation in (self._committed, self._previous) else [op.generation]
        self._on_disk = [g for g in self._on_disk if g not in drop]
    self._write_manifest()
    self._delete_generations(drop)

  def _pin(self, generation: int, pinned: bool) -> None:
    op = _Pin(int(generation), pinned)
    with self._cond:
      self._check_usable_locked()
      self._queue.append(op)
      self._cond.notify_all()
    op.done.wait()
    if op.error is not None:
      raise op.error

  def _remove_failed_generations(self) -> None:
    """After a failure, frees the space of uncommitted generations (the committed ones stay)."""
    with self._cond:
      committed = set(self._on_disk)
      self._written.clear()
      while any(self._readers[k] for k in list(self._readers) if k[1] not in committed):
        self._cond.wait()
    try:
      entries = sorted(os.listdir(self._dir))
    except OSError as e:
      logger.warning("NVMe store %s: cannot list the directory to clean up: %s", self._dir, e)
      return
    for entry in entries:
      match = _GEN_RE.match(entry)
      if match and int(match.group(1)) not in committed:
        logger.info("NVMe store %s: deleting uncommitted %s after the failure.", self._dir, entry)
        _rmtree(self._dir / entry)

  # ---------------------------------------------------------------------------------------------------
  # Threads.

  def _writer_loop(self) -> None:
    while True:
      with self._cond:
        while True:
          if not self._queue:
            if self._stop:
              return
            self._cond.wait()
            continue
          op = self._queue[0]
          if not isinstance(op, _Write):
            self._commits.append(self._queue.popleft())
            self._cond.notify_all()
            continue
          # Never rewrite files that a fetch is reading; and write generation g only once g - 2 is
          # committed, which bounds the generations on disk (see the class docstring).
          if self._readers[op.key] > 0 or self._commit_pending_locked(op.generation - 1):
            self._cond.wait()
            continue
          self._writing = self._queue.popleft()
          break
      error = None
      try:
        self._write_group(op)
      except Exception as e:  # Kept and re-raised in the caller's thread.
        error = e if isinstance(e, NvmeError) else NvmeWriteError(f"NVMe store {self._dir}: {e}")
      with self._cond:
        self._writing = None
        self._finish_write_locked(op, ok=error is None)
        if error is not None:
          self._fail_locked(error)
        self._note_buffers_locked()
        self._cond.notify_all()

  def _committer_loop(self) -> None:
    while True:
      with self._cond:
        while True:
          if self._cleanup_needed and self._writing is None:
            self._cleanup_needed, self._cleaning, op = False, True, None
            break
          if self._commits:
            op = self._committing = self._commits.popleft()
            break
          if self._stop and not self._cleanup_needed:
            return
          self._cond.wait()
      if op is None:
        try:
          self._remove_failed_generations()
        finally:
          with self._cond:
            self._cleaning = False
            self._cond.notify_all()
        continue
      error = None
      try:
        if isinstance(op, _Commit):
          self._commit(op.generation, op.parent)
        else:
          self._run_pin(op)
      except Exception as e:  # Kept and re-raised in the caller's thread.
        error = e
      with self._cond:
        self._committing = None
        if isinstance(op, _Pin):
          op.error = error
          op.done.set()
        elif error is not None:
          if not isinstance(error, NvmeError):
            error = NvmeWriteError(
              f"NVMe store {self._dir}: commit of {op.generation} failed: {error}"
            )
          self._fail_locked(error)
        self._cond.notify_all()

  def _next_prefetch_locked(self) -> tuple[int, int] | None:
    for key in self._wanted:
      if key in self._pool or key in self._prefetch_failed:
        continue
      if key in self._wbuf:
        self._pool[key] = self._wbuf[key]
        continue
      if self._readable_locked(key):
        return key
    return None

  def _prefetch_loop(self) -> None:
    while True:
      with self._cond:
        target = None
        while not self._stop:
          target = self._next_prefetch_locked()
          if target is not None:
            break
          self._cond.wait()
        if self._stop:
          return
        self._reading = target
        self._readers[target] += 1
        self._note_buffers_locked()
      arrays = None
      try:
        arrays = self._read_group(*target)
      except Exception as e:  # A fetch of this group reads it again and raises.
        logger.debug("NVMe store %s: prefetch of %s failed: %s", self._dir, target, e)
      with self._cond:
        self._release_readers_locked([target])
        self._reading = None
        if arrays is None:
          self._prefetch_failed.add(target)
        elif target in self._wanted and target not in self._pool and target not in self._wbuf:
          self._pool[target] = arrays
          self._stats["prefetched"] += 1
        self._note_buffers_locked()
        self._cond.notify_all()
