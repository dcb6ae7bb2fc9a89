"""`NvmeStore`: a generational, crash-safe array store on local disk (TensorStore zarr3).

The public face of the store: it opens the directory (lock, manifest, leftovers), checks its callers'
arguments, and hands the work to its `pipeline.Pipeline` (the queue and the threads). A finalizer closes
the pipeline when the store is garbage-collected or the interpreter exits, so queued writes and commits
are flushed even when nobody calls `NvmeStore.close`.
"""

from __future__ import annotations

import atexit
import logging
import os
import pathlib
import threading
import time
import weakref
from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np

from optax_offload._src.nvme import files
from optax_offload._src.nvme import format as format_lib
from optax_offload._src.nvme import generations as generations_lib
from optax_offload._src.nvme import pipeline as pipeline_lib
from optax_offload._src.nvme.errors import NvmeError
from optax_offload._src.nvme.errors import StaleGenerationError
from optax_offload._src.nvme.format import LeafSpec
from optax_offload._src.nvme.options import NvmeOptions

logger = logging.getLogger(__name__)

_OPEN: weakref.WeakSet[NvmeStore] = weakref.WeakSet()
"""Stores not yet closed, for the exit hook (weak: it does not keep a store alive)."""


def _finalize(pipeline: pipeline_lib.Pipeline, lock: files.DirectoryLock) -> None:
  """Closes a store nobody closed: at garbage collection or interpreter exit. Flushes queued work."""
  if pipeline.runs_in_current_thread():
    # A garbage collection in one of the store's own threads: closing here would wait for itself.
    threading.Thread(target=_finalize, args=(pipeline, lock), name="nvme-close").start()
    return
  if pipeline.closed:
    lock.release()
    return
  logger.info("NVMe store %s: closing at exit or garbage collection.", pipeline.directory)
  try:
    pipeline.close()
  except NvmeError as e:
    logger.error("NVMe store %s: error while closing: %s", pipeline.directory, e)
  finally:
    lock.release()


@atexit.register
def _close_open_stores() -> None:
  """Closes the stores still open when the interpreter exits, flushing their queued work.

  Registered when this module is imported, after JAX (which the package imports first), so that it
  runs before JAX's own exit hooks tear the runtime down: queued puts may hold views of JAX arrays.
  (`weakref.finalize` runs its finalizers at exit too, but from a hook registered whenever the
  process first made one, which may be before JAX's.)
  """
  for store in sorted(_OPEN, key=lambda s: s._opened, reverse=True):
    store._finalizer()


class NvmeStore:
  """A generational, crash-safe store of groups of arrays on local disk (TensorStore zarr3).

  Generation ``g + 1`` never overwrites generation ``g``: each generation is a fresh directory, made durable
  with one fsync pass and published by atomically replacing ``MANIFEST.json``. After committing ``g`` the
  store keeps ``g``, its parent (the generation it was computed from; by default the previously committed
  one) and pinned ones, and deletes the rest. Each leaf is a zarr3 array that TensorStore reads; the
  store reads and writes its chunk files itself, with direct I/O (`chunk_io`), and keeps an XXH3
  checksum of each in the array's ``zarr.json``; corrupt, truncated or missing files raise
  `NvmeCorruptionError`.

  The caller follows a cyclic protocol: `fetch` group ``k`` of generation ``g``, `put` its new value as
  group ``k`` of ``g + 1``, for every group in order, then `commit` ``g + 1``. `fetch` then prefetches the
  next ``prefetch_depth`` groups in that order (wrapping to group 0 of ``g + 1``, which is served from the
  write-behind buffers or read once its write is complete, never half-written); `put` returns at once unless
  ``write_depth`` writes are pending. Errors of background writes are kept and re-raised, with the leaf
  and the path, by the next `fetch`, `put`, `commit` or `sync`; the store then refuses further work, and
  reopening it finds the last committed generation.

  Host RAM: the store holds at most `host_buffer_bound` =
  ``(prefetch_depth + write_depth + 1) * max group bytes`` of array buffers (plus the padding of
  read buffers and the write staging): ``write_depth`` groups waiting
  to be written, ``prefetch_depth`` prefetched groups, and one more: the buffers of the group the caller
  is consuming, which the store reads the next groups into once the caller has let go of them (or a
  prefetch read whose group was dropped from the window while it was in flight). `fetch` returns read-only
  views of those buffers; a buffer is reused only once no array derived from them is left (see
  `buffers`), so a caller that keeps them keeps valid data (and the store reads into fresh buffers
  meanwhile). Arrays returned by `read_generation` belong to the caller.

  Disk: the last two committed generations, pinned ones, and at most two more in flight (generation
  ``g + 1`` is written while ``g`` is fsynced; writing ``g + 2`` waits for ``g``'s commit): plan for
  ``4 * bytes_on_disk()`` plus pins; ``3 *`` suffices when commits keep up with writes. A dropped
  generation is kept, within those four, as a spare whose files the next generation overwrites in
  place (no block freed and allocated again each step; see `files.Spares`).

  Threads: a writer, a committer (fsync, manifest, deletion; with a few fsync threads) and, if
  ``prefetch_depth > 0``, a prefetcher; all daemons, waiting on one condition variable; and
  ``io_threads`` each for chunk reads and chunk writes.

  Lifetime: the store holds an exclusive ``flock`` on ``directory/LOCK`` (one process per directory)
  until `close` (or the end of a ``with`` block). A store that is not closed is closed when it is
  garbage-collected or the interpreter exits: queued puts and commits are written and committed first.
  A process that is killed loses its queued work, and the store reopens at the last committed generation.

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
    io_threads: int = 4,
    direct_io: bool = True,
    create: bool = True,
  ):
    """Opens (or creates) the store in `directory` and takes its lock.

    Args:
      directory: directory of the store; made absolute.
      groups: the leaves, in groups; the order of groups is the cyclic order of `fetch` and `put`.
      prefetch_depth: how many groups ahead `fetch` prefetches (0 disables prefetching).
      write_depth: how many `put` writes may be pending before `put` blocks (at least 1).
      chunk_bytes: target bytes per chunk file, split along the leading axis.
      io_threads: chunk files read, and as many written, at once.
      direct_io: read and write chunk files with ``O_DIRECT`` (see `NvmeOptions`).
      create: make `directory` if it does not exist.

    Raises:
      FileNotFoundError: `directory` does not exist and ``create=False``.
      NotADirectoryError: `directory` (or a parent) is a regular file.
      PermissionError: `directory` cannot be created or written.
      RuntimeError: another store (in this or another process) holds the directory.
      ValueError: invalid arguments, or the committed generation holds different leaves.
      NvmeCorruptionError: the manifest cannot be read.
    """
    options = NvmeOptions(prefetch_depth, write_depth, chunk_bytes, io_threads, direct_io)
    self._groups = [list(group) for group in groups]
    if not self._groups or any(not group for group in self._groups):
      raise ValueError("groups must be a non-empty sequence of non-empty sequences of LeafSpec.")
    leaves = format_lib.stored_leaves(self._groups, options.chunk_bytes)
    self._options = options
    self._dir = pathlib.Path(os.path.abspath(os.path.expanduser(os.fspath(directory))))
    files.prepare_directory(self._dir, create)
    lock = files.DirectoryLock(self._dir)
    try:
      generations = self._open_generations()
      if generations.dropped_pins:
        files.write_json_atomic(
          self._dir / format_lib.MANIFEST, pipeline_lib.manifest_json(generations, leaves)
        )
      self._remove_unpublished(generations)
    except BaseException:
      lock.release()
      raise
    self._pipeline = pipeline_lib.Pipeline(
      self._dir,
      leaves,
      generations,
      options.prefetch_depth,
      options.write_depth,
      options.io_threads,
      options.direct_io,
    )
    self._lock = lock
    self._finalizer = weakref.finalize(self, _finalize, self._pipeline, lock)
    self._finalizer.atexit = False  # `_close_open_stores` runs it at exit
    self._opened = time.monotonic()
    _OPEN.add(self)
    logger.info(
      "NVMe store %s opened: %d leaves in %d groups, %d bytes per generation, committed generation %d.",
      self._dir,
      sum(len(g) for g in self._groups),
      len(self._groups),
      self.bytes_on_disk(),
      generations.committed.committed,
    )

  def _open_generations(self) -> generations_lib.Generations:
    """The generations the manifest records (none for a new store), checked against the leaf specs."""
    manifest = format_lib.read_manifest(self._dir)
    if manifest is None:
      return generations_lib.Generations()
    diffs = format_lib.describe_spec_diff(manifest.groups, format_lib.groups_json(self._groups))
    if diffs:
      shown = "; ".join(diffs[:10]) + (f"; ... ({len(diffs) - 10} more)" if len(diffs) > 10 else "")
      raise ValueError(
        f"NVMe store {self._dir} holds committed generation {manifest.committed} for different "
        f"leaves: {shown}. Use another nvme_dir, or delete that directory to start over."
      )
    committed = generations_lib.Committed(
      manifest.committed, manifest.previous, manifest.generations
    )
    generations = generations_lib.Generations(committed, pinned=manifest.pinned)
    # Pins belong to the process that made them (a checkpoint save in progress); a new process drops
    # them, and the generations only they kept are deleted with the unpublished ones.
    if generations.dropped_pins:
      logger.warning(
        "NVMe store %s: dropping pins %s left by an earlier process.",
        self._dir,
        list(generations.dropped_pins),
      )
    on_disk = generations.committed.on_disk
    missing = [g for g in on_disk if not self.generation_path(g).is_dir()]
    if missing:
      logger.warning(
        "NVMe store %s: generations %s are in the manifest but not on disk.", self._dir, missing
      )
    return generations

  def _remove_unpublished(self, generations: generations_lib.Generations) -> None:
    """Deletes generations that were never committed (a crash or failure mid-write) or left over."""
    (self._dir / (format_lib.MANIFEST + ".tmp")).unlink(missing_ok=True)
    files.Spares(self._dir).remove_all()
    keep = set(generations.committed.on_disk)
    files.remove_generations(self._dir, keep, "NVMe store %s: deleting uncommitted or stale %s.")

  # -- what the store holds ---------------------------------------------------------------------------

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
    with self._pipeline.cond:
      return self._pipeline.gens.committed.committed

  @property
  def generations_on_disk(self) -> list[int]:
    """Committed generations kept on disk (the last, the previous and pinned ones)."""
    with self._pipeline.cond:
      return list(self._pipeline.gens.committed.on_disk)

  @property
  def host_buffer_bound(self) -> int:
    """Most bytes of buffers the store holds: ``(prefetch_depth + write_depth + 1) * max group``.

    Exactly: ``prefetch_depth + 1`` groups' read buffers (with their padding), ``write_depth``
    groups waiting to be written, and the staging buffers of chunk writes.
    """
    o, p = self._options, self._pipeline
    return (
      (o.prefetch_depth + 1) * max(p.group_buffer_bytes)
      + o.write_depth * max(p.group_bytes)
      + p.io.staging_bytes
    )

  @property
  def stats(self) -> dict[str, int]:
    """Counters: fetches, prefetch_hits, buffer_hits, misses, waits, bytes_written, bytes_read, ...

    ``prefetch_hits`` are fetches served by the prefetch pool, ``buffer_hits`` by the write-behind buffers,
    ``misses`` read from disk by `fetch` itself; ``waits`` of the hits waited for an in-flight prefetch.
    ``buffer_bytes`` and ``peak_buffer_bytes`` are the host bytes held now and at most so far.
    """
    with self._pipeline.cond:
      return self._pipeline.stats_now_locked()

  def generation_path(self, generation: int) -> pathlib.Path:
    """The directory holding `generation`'s files (e.g. to hard-link them into a checkpoint)."""
    return self._dir / format_lib.generation_dirname(generation)

  def leaf_path(self, generation: int, name: str) -> pathlib.Path:
    """The zarr3 directory of leaf `name` in `generation` (valid while the generation is on disk)."""
    return self.generation_path(generation) / format_lib.leaf_dirname(name)

  def bytes_on_disk(self) -> int:
    """Logical bytes of one generation (the sum of the leaves' ``nbytes``)."""
    return self._pipeline.bytes_per_generation()

  # -- the protocol -----------------------------------------------------------------------------------

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
    with self._pipeline.cond:
      self._pipeline.check_usable_locked()
      try:
        return self._pipeline.gens.new_generation(parent)
      except StaleGenerationError as e:
        raise StaleGenerationError(f"NVMe store {self._dir}: {e}") from None

  def abandon_generation(self, generation: int) -> None:
    """Gives up `generation`, the last one `new_generation` made, before committing it (a restore
    that failed): the generation made before it is the newest again, and the groups of
    `generation` already put are deleted at the next commit."""
    with self._pipeline.cond:
      self._pipeline.gens.abandon(int(generation))

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

  def fetch(
    self, group: int, generation: int, then: Sequence[tuple[int, int]] | None = None
  ) -> list[np.ndarray]:
    """Returns the group's arrays at `generation`, in `LeafSpec` order, and prefetches the next groups.

    The arrays come from the prefetch pool or the write-behind buffers when present, else from disk (with
    checksums verified). They are read-only views; copy before mutating them in place.

    Args:
      group: index of the group.
      generation: a committed generation on disk, or one whose group was `put` (written or pending).
      then: None (prefetch the next groups in cyclic order), or the (group, generation) pairs to
        prefetch next, in order (the first ``prefetch_depth``): for a caller that needs the groups
        in another order (`value_and_update` reads a layer stack's groups last layer first).

    Returns:
      The group's arrays.

    Raises:
      ValueError: that group of that generation is neither on disk nor put.
      NvmeCorruptionError: the data on disk failed verification.
      NvmeWriteError: an earlier background write failed.
    """
    self._check_group(group)
    return self._pipeline.fetch(group, int(generation), then)

  def prefetch(self, keys: Sequence[tuple[int, int]]) -> None:
    """Reads the (group, generation) pairs `keys` ahead, in order (the first ``prefetch_depth``).

    The window holds until the next `fetch` sets it again (see its ``then``); e.g. before the first
    `fetch` of an update whose first group is not the cyclic next one.
    """
    for group, _ in keys:
      self._check_group(group)
    self._pipeline.prefetch([(int(g), int(n)) for g, n in keys])

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
      held.append(pipeline_lib.readonly(array))
    self._pipeline.put(group, int(generation), held)

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
    self._pipeline.commit(int(generation), None if parent is None else int(parent))

  def sync(self) -> None:
    """Blocks until every queued put and commit is durable; re-raises any background error."""
    self._pipeline.sync()

  def pin(self, generation: int) -> None:
    """Keeps a committed generation on disk until `unpin` (e.g. while a checkpoint copies it).

    Ordered after queued commits, so ``commit(g); pin(g)`` works. Blocks until the manifest records it.

    Raises:
      ValueError: `generation` is not a committed generation on disk.
    """
    self._pipeline.pin(int(generation), True)

  def unpin(self, generation: int) -> None:
    """Undoes `pin`; the generation is deleted unless it is the last or previous committed one."""
    self._pipeline.pin(int(generation), False)

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
    return self._pipeline.read_generation(None if generation is None else int(generation))

  # -- lifetime ---------------------------------------------------------------------------------------

  def close(self) -> None:
    """Waits for queued work, stops the threads and releases the lock. Idempotent.

    Raises:
      NvmeWriteError: a background error that no earlier call reported (after cleaning up).
    """
    if self._finalizer.detach() is None:  # closed already (or by the finalizer)
      return
    _OPEN.discard(self)
    try:
      self._pipeline.close()
    finally:
      self._lock.release()
      logger.info(
        "NVMe store %s closed at committed generation %d.", self._dir, self.committed_generation
      )

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
    return (
      f"NvmeStore({str(self._dir)!r}, groups={len(self._groups)}, "
      f"committed_generation={self.committed_generation})"
    )

  def _check_group(self, group: int) -> None:
    if not 0 <= group < len(self._groups):
      raise ValueError(f"group {group} out of range [0, {len(self._groups)}).")
