"""The store's queue and thread loops: write-behind, commits, and prefetch, under one condition variable.

`NvmeStore` checks its callers' arguments and hands the work to a `Pipeline`, which owns the threads.
The threads refer to the pipeline, never to the `NvmeStore`, so that a store nobody refers to any more
is garbage-collected, and its finalizer closes the pipeline (flushing queued work).

Operations are queued in call order: puts (`_Write`), commits (`_Commit`) and pins (`_Pin`). The writer
thread writes each group and passes commits and pins on, in order, to the committer thread, so that
fsyncing generation ``g`` overlaps with writing ``g + 1``. The prefetcher reads the groups of the
prefetch window (set by each `fetch`) into leased host buffers (`buffers.ReadBuffers`). The chunk
files of a group are read and written by `chunk_io.ChunkIO`'s threads, a few at a time.

Length: over the ~500 lines we aim for: three threads that share one condition variable and
one queue; their loops and the hand-offs between them read best side by side.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence

import numpy as np

from optax_offload._src.nvme import buffers as buffers_lib
from optax_offload._src.nvme import chunk_io
from optax_offload._src.nvme import files
from optax_offload._src.nvme import format as format_lib
from optax_offload._src.nvme import generations as generations_lib
from optax_offload._src.nvme import leaf_io
from optax_offload._src.nvme.errors import NvmeError
from optax_offload._src.nvme.errors import NvmeWriteError

logger = logging.getLogger(__name__)

Key = tuple[int, int]
"""(group, generation)."""

STAT_KEYS = (
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
  "read_ns",
  "write_ns",
  "commit_ns",
  "bytes_written_zero_copy",
  "leaves_reused",
  "disk_busy_ns",
)
"""``read_ns``, ``write_ns`` and ``commit_ns``: wall nanoseconds spent reading groups (fetches and
prefetches), writing groups and committing generations; bytes over them is the data path's speed.
``disk_busy_ns``: wall nanoseconds with at least one of them under way (they overlap): over a step,
how much of it the disk was working; bytes read and written over it, their rate together.
``bytes_written_zero_copy``: chunk bytes written straight from the put arrays (`chunk_io`).
``leaves_reused``: leaves written over the files of a dropped generation (`files.Spares`)."""


@dataclasses.dataclass
class _Write:
  group: int
  generation: int
  arrays: list[np.ndarray]

  @property
  def key(self) -> Key:
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


def manifest_json(
  gens: generations_lib.Generations, leaves: Sequence[Sequence[format_lib.StoredLeaf]]
) -> dict:
  """The manifest document that publishes `gens`' committed state."""
  c = gens.committed
  specs = [[leaf.spec for leaf in group] for group in leaves]
  manifest = format_lib.Manifest(
    c.committed, c.previous, c.on_disk, tuple(sorted(gens.pinned)), format_lib.groups_json(specs)
  )
  return format_lib.manifest_json(manifest, os.getpid(), time.time())


def readonly(array: np.ndarray) -> np.ndarray:
  view = array.view()
  view.flags.writeable = False
  return view


class Pipeline:
  """Queued puts, commits and pins, the write-behind buffers and the prefetch window, and 3 threads.

  Methods ending in ``_locked`` run under ``self.cond``. See `NvmeStore` for the protocol.
  """

  def __init__(
    self,
    directory: pathlib.Path,
    leaves: list[list[format_lib.StoredLeaf]],
    generations: generations_lib.Generations,
    prefetch_depth: int,
    write_depth: int,
    io_threads: int = 4,
    direct_io: bool = True,
  ):
    self.directory, self.leaves, self.gens = directory, leaves, generations
    self.group_bytes = [sum(leaf.spec.nbytes for leaf in group) for group in leaves]
    # What a group's read buffers take: each leaf's bytes plus room for its last chunk's padding.
    self.group_buffer_bytes = [sum(leaf.layout.buffer_nbytes for leaf in group) for group in leaves]
    self._prefetch_depth, self._write_depth = prefetch_depth, write_depth
    self._context = format_lib.ts_context()
    largest_file = max(leaf.layout.file_nbytes for group in leaves for leaf in group)
    self.io = chunk_io.ChunkIO(io_threads, direct_io, piece=largest_file)
    self.cond = threading.Condition()
    self._queue: collections.deque[_Write | _Commit | _Pin] = collections.deque()
    self._commits: collections.deque[_Commit | _Pin] = collections.deque()
    self._writing: _Write | None = None
    self._committing: _Commit | _Pin | None = None
    self._cleanup_needed = False
    self._cleaning = False
    self._pending_writes = 0
    self._wbuf: dict[Key, list[np.ndarray]] = {}  # write-behind: put, not yet written
    self._wbuf_count: collections.Counter[Key] = collections.Counter()
    self._written: set[Key] = set()  # written, generation not yet committed
    self._pool: dict[Key, list[np.ndarray]] = {}  # prefetched
    self._wanted: list[Key] = []  # the prefetch window
    self._prefetch_failed: set[Key] = set()
    self._reading: Key | None = None
    self._readers: collections.Counter[Key] = collections.Counter()
    self._on_disk, self._on_disk_since = 0, 0  # reads, writes and commits under way; since when
    self.error: BaseException | None = None
    self._error_reported = True
    self._stop = False
    self.closed = False
    self.stats = collections.Counter({k: 0 for k in STAT_KEYS})
    # Prefetched groups, plus the group the caller is consuming.
    self.read_buffers = buffers_lib.ReadBuffers((prefetch_depth + 1) * max(self.group_buffer_bytes))
    self._fsync_pool = files.WorkerPool()
    self.spares = files.Spares(directory)
    self._threads = [threading.Thread(target=self._writer_loop, name="nvme-writer", daemon=True)]
    self._threads.append(
      threading.Thread(target=self._committer_loop, name="nvme-committer", daemon=True)
    )
    if prefetch_depth > 0:
      self._threads.append(
        threading.Thread(target=self._prefetch_loop, name="nvme-prefetch", daemon=True)
      )
    for thread in self._threads:
      thread.start()

  # -- the caller's operations --------------------------------------------------------------------------

  def fetch(self, group: int, generation: int, then=None) -> list[np.ndarray]:
    key = (group, generation)
    waited = False
    with self.cond:
      self.check_usable_locked()
      self.stats["fetches"] += 1
      while True:
        if key in self._pool:
          arrays = self._pool.pop(key)
          self.stats["prefetch_hits"] += 1
        elif key in self._wbuf:
          arrays = self._wbuf[key]
          self.stats["buffer_hits"] += 1
        elif self._reading == key:
          waited = True
          self.cond.wait()
          continue
        elif self._readable_locked(key):
          arrays = None
          self.stats["misses"] += 1
          self._readers[key] += 1
        else:
          raise ValueError(
            f"NVMe store: group {group} of generation {generation} is neither committed on disk "
            f"(generations {list(self.gens.committed.on_disk)}) nor put."
          )
        break
      if waited and arrays is not None:
        self.stats["waits"] += 1
      if then is None:
        self._schedule_locked(key)
      else:
        self._want_locked(then)
      self._note_buffers_locked()
    if arrays is None:
      try:
        arrays = self.read_group(group, generation)
      finally:
        with self.cond:
          self._release_readers_locked([key])
    return [readonly(a) for a in arrays]

  def put(self, group: int, generation: int, held: list[np.ndarray]) -> None:
    key = (group, generation)
    with self.cond:
      self.check_usable_locked()
      self.gens.check_put(generation)
      while self._pending_writes >= self._write_depth and self.error is None and not self._stop:
        self.cond.wait()
      self.check_usable_locked()
      self._queue.append(_Write(group, generation, held))
      self.gens.note_put(generation)
      self._pending_writes += 1
      self._wbuf[key] = held
      self._wbuf_count[key] += 1
      self._written.discard(key)
      if key in self._pool:
        self._pool[key] = held
      self._note_buffers_locked()
      self.cond.notify_all()

  def commit(self, generation: int, parent: int | None) -> None:
    with self.cond:
      self.check_usable_locked()
      self.gens.check_commit(generation)
      missing = [
        g
        for g in range(len(self.leaves))
        if (g, generation) not in self._wbuf and (g, generation) not in self._written
      ]
      if missing:
        raise ValueError(f"commit: groups {missing} of generation {generation} were not put.")
      self.gens.queue_commit(generation)
      self._queue.append(_Commit(generation, parent))
      self.cond.notify_all()

  def sync(self) -> None:
    with self.cond:
      self.check_open_locked()
      while not self._idle_locked() and self.error is None:
        self.cond.wait()
      self._raise_error_locked()

  def pin(self, generation: int, pinned: bool) -> None:
    op = _Pin(generation, pinned)
    with self.cond:
      self.check_open_locked()
      if self.error is not None:
        # A failed write stopped the store: it commits and deletes nothing more, so a pin (a
        # checkpoint of the last good state, which reads may still copy) is only counted, not
        # written to a manifest the disk may refuse. What an unpin leaves goes at the reopening.
        if pinned:
          self.gens.pin(generation)
        else:
          self.gens.unpin(generation)
        return
      self._raise_error_locked()
      self._queue.append(op)
      self.cond.notify_all()
    op.done.wait()
    if op.error is not None:
      raise op.error

  def read_generation(self, generation: int | None) -> dict[str, np.ndarray]:
    with self.cond:
      self.check_open_locked()
      if self.error is not None:
        # A failed write stopped the store: its committed generations are intact, and reading
        # them (to save or inspect the state) is what a user does next.
        if generation is None:
          generation = self.gens.committed.committed
      elif generation is None:
        self._wait_for_commits_locked(self.gens.last_queued_commit)
        generation = self.gens.committed.committed
      else:
        self._wait_for_commits_locked(generation)
      if generation not in self.gens.committed.on_disk:
        raise ValueError(
          f"read_generation: generation {generation} of {self.directory} is not committed on disk "
          f"(committed generations on disk: {list(self.gens.committed.on_disk)})."
        )
      keys = [(g, generation) for g in range(len(self.leaves))]
      for key in keys:
        self._readers[key] += 1
    try:
      leaves = [leaf for group in self.leaves for leaf in group]
      arrays = self._read(generation, leaves, take=None)
    finally:
      with self.cond:
        self._release_readers_locked(keys)
    return {leaf.spec.name: array for leaf, array in zip(leaves, arrays, strict=True)}

  def close(self) -> None:
    """Waits for queued work, stops the threads. Idempotent.

    Raises:
      NvmeWriteError: a background error that no earlier call reported (after stopping).
    """
    with self.cond:
      if self.closed:
        return
      while not self._idle_locked() and self.error is None:
        self.cond.wait()
      self._stop = True
      self.closed = True
      self._pool.clear()
      self.read_buffers.clear()
      self._wanted = []
      self.cond.notify_all()
      error = None if self._error_reported else self.error
      self._error_reported = True
    current = threading.current_thread()
    for thread in self._threads:
      if thread is not current:  # a garbage collection in a store thread may run the finalizer
        thread.join()
    self._fsync_pool.shutdown()
    self.io.shutdown()
    self.spares.remove_all()
    if error is not None:
      raise error

  def runs_in_current_thread(self) -> bool:
    """Whether the calling thread is one of the pipeline's own."""
    current = threading.current_thread()
    return (
      current in self._threads or current in self._fsync_pool.threads or current in self.io.threads
    )

  # -- helpers that run under `self.cond` -----------------------------------------------------------------

  def check_open_locked(self) -> None:
    if self.closed:
      raise RuntimeError(f"NVMe store {self.directory} is closed.")

  def _raise_error_locked(self) -> None:
    if self.error is None:
      return
    if self._error_reported and isinstance(self.error, NvmeWriteError):  # (a later call)
      committed = self.gens.committed.committed
      kept = (
        f"its last committed generation ({committed}) is intact on disk, and readable until the "
        "store is closed (oo.to_inner of the state that names it, or oo.OffloadSave of it to "
        "checkpoint it)"
        if committed >= 0
        else "nothing was committed yet"
      )
      raise NvmeWriteError(
        f"{self.error} The store stopped at that error and refuses every write since: {kept}. Once "
        "the cause is fixed (e.g. space freed), close it and open it again: oo.close_nvme(state) "
        "and restore the state, or oo.close_nvme_stack(leaves) and oo.open_nvme_stack."
      ) from self.error
    self._error_reported = True
    raise self.error

  def check_usable_locked(self) -> None:
    self.check_open_locked()
    self._raise_error_locked()

  def _release_readers_locked(self, keys: Iterable[Key]) -> None:
    for key in keys:
      self._readers[key] -= 1
      if self._readers[key] <= 0:
        del self._readers[key]
    self.cond.notify_all()

  def _readable_locked(self, key: Key) -> bool:
    return key[1] in self.gens.committed.on_disk or key in self._written

  def _wait_for_commits_locked(self, generation: int) -> None:
    def queued() -> bool:
      ops = [*self._queue, *self._commits, self._committing]
      return any(isinstance(op, _Commit) and op.generation <= generation for op in ops)

    while queued() and self.error is None:
      self.cond.wait()
    self._raise_error_locked()

  def prefetch(self, keys: list[Key]) -> None:
    with self.cond:
      self.check_usable_locked()
      self._want_locked(keys)

  def _want_locked(self, keys) -> None:
    """Sets the prefetch window to the first `prefetch_depth` of `keys` (a caller's own order)."""
    self._set_window_locked([tuple(k) for k in keys][: self._prefetch_depth])

  def _schedule_locked(self, key: Key) -> None:
    """Sets the prefetch window to the `prefetch_depth` groups after `key` in cyclic order."""
    group, generation = key
    wanted = []
    for _ in range(self._prefetch_depth):
      group += 1
      if group == len(self.leaves):
        group, generation = 0, self.gens.next_generation(generation)
      wanted.append((group, generation))
    self._set_window_locked(wanted)

  def _set_window_locked(self, wanted: list[Key]) -> None:
    self._wanted = wanted
    self._pool = {k: v for k, v in self._pool.items() if k in wanted}
    self._prefetch_failed.clear()
    self.cond.notify_all()

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
      total += self.group_bytes[self._reading[0]]
    self.stats["buffer_bytes"] = total
    self.stats["peak_buffer_bytes"] = max(self.stats["peak_buffer_bytes"], total)

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
    if self.error is None:
      self.error = error
      self._error_reported = False
      logger.error("NVMe store %s: %s", self.directory, error)
    while self._queue or self._commits:
      op = (self._queue or self._commits).popleft()
      if isinstance(op, _Write):
        self._finish_write_locked(op, ok=False)
      elif isinstance(op, _Pin):
        op.error = self.error
        op.done.set()
    self._cleanup_needed = True
    self._note_buffers_locked()
    self.cond.notify_all()

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

  # -- disk -------------------------------------------------------------------------------------------

  def generation_path(self, generation: int) -> pathlib.Path:
    return self.directory / format_lib.generation_dirname(generation)

  def bytes_per_generation(self) -> int:
    return sum(self.group_bytes)

  def read_group(self, group: int, generation: int) -> list[np.ndarray]:
    """Reads one group into leased buffers (for `fetch` and the prefetcher)."""
    return self._read(generation, self.leaves[group], take=self.read_buffers.take)

  @contextlib.contextmanager
  def _disk_busy(self):
    """Counts the wall time while this or another read, write or commit is under way."""
    with self.cond:
      if not self._on_disk:
        self._on_disk_since = time.perf_counter_ns()
      self._on_disk += 1
    try:
      yield
    finally:
      with self.cond:
        self._on_disk -= 1
        if not self._on_disk:
          self.stats["disk_busy_ns"] += time.perf_counter_ns() - self._on_disk_since

  def stats_now_locked(self) -> dict[str, int]:
    """The stats, the disk's busy time counted up to now (an interval under way included)."""
    if self._on_disk:
      now = time.perf_counter_ns()
      self.stats["disk_busy_ns"] += now - self._on_disk_since
      self._on_disk_since = now
    return dict(self.stats)

  def _read(self, generation: int, leaves, take) -> list[np.ndarray]:
    start = time.perf_counter_ns()
    path = self.generation_path(generation)
    with self._disk_busy():
      arrays = leaf_io.read_leaves(self.io, self._context, path, leaves, take)
    with self.cond:
      self.stats["bytes_read"] += sum(a.nbytes for a in arrays)
      self.stats["read_ns"] += time.perf_counter_ns() - start
    return arrays

  def write_group(self, op: _Write) -> None:
    """Writes one queued group (the writer thread's work; tests replace it to slow the writer)."""
    zero_copy, reused = self.io.zero_copy_bytes, self.spares.reused
    with self._disk_busy():
      start = time.perf_counter_ns()
      leaf_io.write_leaves(
        self.io,
        self.generation_path(op.generation),
        self.leaves[op.group],
        op.arrays,
        self.bytes_per_generation(),
        reuse=self.spares.take,
      )
      took = time.perf_counter_ns() - start
    with self.cond:
      self.stats["bytes_written"] += sum(a.nbytes for a in op.arrays)
      self.stats["write_ns"] += took
      self.stats["bytes_written_zero_copy"] += self.io.zero_copy_bytes - zero_copy
      self.stats["leaves_reused"] += self.spares.reused - reused

  def write_manifest(self) -> None:
    """Atomically publishes the committed state (called with the state already updated in memory)."""
    with self.cond:
      doc = manifest_json(self.gens, self.leaves)
    files.write_json_atomic(self.directory / format_lib.MANIFEST, doc)

  def _commit(self, generation: int, parent: int | None) -> None:
    start = time.perf_counter()
    try:
      with self._disk_busy():
        files.fsync_tree(self.generation_path(generation), self._fsync_pool)
        files.fsync_path(self.directory, directory=True)
    except OSError as e:
      raise NvmeWriteError(
        f"NVMe store: making generation {generation} durable at {self.generation_path(generation)} "
        f"failed: {e}"
      ) from e
    synced = time.perf_counter()
    with self.cond:
      before = self.gens.committed
      drop = self.gens.commit(generation, parent)
    try:
      with self._disk_busy():
        self.write_manifest()
    except OSError as e:
      with self.cond:
        self.gens.undo_commit(before)
      raise NvmeWriteError(
        f"NVMe store: publishing generation {generation} in "
        f"{self.directory / format_lib.MANIFEST} failed: {e}"
      ) from e
    with self.cond:
      self._written = {k for k in self._written if k[1] != generation}
      self.stats["commits"] += 1
      self.stats["commit_ns"] += int((time.perf_counter() - start) * 1e9)
      self.cond.notify_all()
    self._delete_generations(drop)
    self._remove_abandoned(generation)
    logger.debug(
      "NVMe store %s: committed generation %d (fsync %.3fs, publish %.3fs), deleted %s.",
      self.directory,
      generation,
      synced - start,
      time.perf_counter() - synced,
      drop,
    )

  def _remove_abandoned(self, committed: int) -> None:
    """Deletes what a failed step left of generations older than `committed` that were never
    committed (puts of a step that raised before its commit): a newer generation is committed, so
    they never will be, and each failed step would otherwise keep a generation's space on disk
    until the store is opened again. Their directories are those of the groups written and not
    committed (`_written`); one with a write queued or under way stays until a later commit."""
    with self.cond:
      keep = set(self.gens.committed.on_disk) | set(self.gens.pinned)
      keep |= {op.generation for op in [*self._queue, self._writing] if isinstance(op, _Write)}
      abandoned = sorted({k[1] for k in self._written if k[1] < committed and k[1] not in keep})
      self._written = {k for k in self._written if k[1] > committed or k[1] in keep}
    for generation in abandoned:
      path = self.generation_path(generation)
      logger.info(
        "NVMe store %s: deleting %s, never committed (a failed step's).", self.directory, path.name
      )
      files.remove_tree(path)

  def _delete_generations(self, generations: Sequence[int]) -> None:
    with self.cond:
      while any(self._readers[k] for k in list(self._readers) if k[1] in generations):
        self.cond.wait()
    for generation in generations:
      self.spares.retire(self.generation_path(generation))

  def _run_pin(self, op: _Pin) -> None:
    with self.cond:
      drop = self.gens.unpin(op.generation) if not op.pinned else []
      if op.pinned:
        self.gens.pin(op.generation)
    self.write_manifest()
    self._delete_generations(drop)

  def _remove_failed_generations(self) -> None:
    """After a failure, frees the space of uncommitted generations (the committed ones stay)."""
    with self.cond:
      committed = set(self.gens.committed.on_disk)
      self._written.clear()
      while any(self._readers[k] for k in list(self._readers) if k[1] not in committed):
        self.cond.wait()
    try:
      files.remove_generations(
        self.directory,
        committed,
        "NVMe store %s: deleting uncommitted %s after the failure.",
        logging.INFO,
      )
    except OSError as e:
      logger.warning("NVMe store %s: cannot list the directory to clean up: %s", self.directory, e)

  # -- threads ----------------------------------------------------------------------------------------

  def _next_write_locked(self) -> _Write | None:
    """The next write the writer may start (passing commits and pins on); None: wait, or stop."""
    while self._queue:
      op = self._queue[0]
      if not isinstance(op, _Write):
        self._commits.append(self._queue.popleft())
        self.cond.notify_all()
        continue
      # Never rewrite files that a fetch is reading; and write generation g only once g - 2 is
      # committed, which bounds the generations on disk (see `NvmeStore`).
      if self._readers[op.key] > 0 or self._commit_pending_locked(op.generation - 1):
        return None
      self._writing = self._queue.popleft()
      return op
    return None

  def _writer_loop(self) -> None:
    while True:
      with self.cond:
        while (op := self._next_write_locked()) is None:
          if self._stop and not self._queue:
            return
          self.cond.wait()
      error = None
      try:
        self.write_group(op)
      except Exception as e:  # Kept and re-raised in the caller's thread.
        error = (
          e if isinstance(e, NvmeError) else NvmeWriteError(f"NVMe store {self.directory}: {e}")
        )
      with self.cond:
        self._writing = None
        self._finish_write_locked(op, ok=error is None)
        if error is not None:
          self._fail_locked(error)
        self._note_buffers_locked()
        self.cond.notify_all()

  def _next_commit_locked(self) -> tuple[bool, _Commit | _Pin | None]:
    """(stop, op): the committer's next work; op None with stop False: clean up after a failure."""
    while True:
      if self._cleanup_needed and self._writing is None:
        self._cleanup_needed, self._cleaning = False, True
        return False, None
      if self._commits:
        self._committing = self._commits.popleft()
        return False, self._committing
      if self._stop and not self._cleanup_needed:
        return True, None
      self.cond.wait()

  def _committer_loop(self) -> None:
    while True:
      with self.cond:
        stop, op = self._next_commit_locked()
      if stop:
        return
      if op is None:
        try:
          self._remove_failed_generations()
        finally:
          with self.cond:
            self._cleaning = False
            self.cond.notify_all()
        continue
      error = None
      try:
        if isinstance(op, _Commit):
          self._commit(op.generation, op.parent)
        else:
          self._run_pin(op)
      except Exception as e:  # Kept and re-raised in the caller's thread.
        error = e
      with self.cond:
        self._committing = None
        if isinstance(op, _Pin):
          op.error = error
          op.done.set()
        elif error is not None:
          if not isinstance(error, NvmeError):
            error = NvmeWriteError(
              f"NVMe store {self.directory}: commit of {op.generation} failed: {error}"
            )
          self._fail_locked(error)
        self.cond.notify_all()

  def _next_prefetch_locked(self) -> Key | None:
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
      with self.cond:
        target = None
        while not self._stop:
          target = self._next_prefetch_locked()
          if target is not None:
            break
          self.cond.wait()
        if self._stop:
          return
        self._reading = target
        self._readers[target] += 1
        self._note_buffers_locked()
      arrays = None
      try:
        arrays = self.read_group(*target)
      except Exception as e:  # A fetch of this group reads it again and raises.
        logger.debug("NVMe store %s: prefetch of %s failed: %s", self.directory, target, e)
      with self.cond:
        self._release_readers_locked([target])
        self._reading = None
        if arrays is None:
          self._prefetch_failed.add(target)
        elif target in self._wanted and target not in self._pool and target not in self._wbuf:
          self._pool[target] = arrays
          self.stats["prefetched"] += 1
        self._note_buffers_locked()
        self.cond.notify_all()
