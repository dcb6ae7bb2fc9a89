"""Bookkeeping of the store's generations: lineage, commits, pins, and what to keep on disk.

A pure object, with no threads, locks or disk: the store holds one, changes it under its lock, and
writes what it says into the manifest. Its rules:

* Lineage: the *newest* generation (the last one `new_generation` handed out; after opening, the
  committed one) and the generation it was made from. A new generation may only be made from one of
  these two; any older one is *stale* (the store may have deleted it, and committing a generation made
  from it would in turn delete the newest).
* Commits: committing ``g`` keeps ``g``, its parent (by default the previously committed generation)
  and pinned generations on disk, and drops the rest. Committed generations are immutable: puts and
  commits must be newer than the last queued commit.
* Pins belong to the process that made them: a store opened by another process drops them.
"""

from __future__ import annotations

import collections
import dataclasses

from optax_offload._src.nvme.errors import StaleGenerationError


@dataclasses.dataclass(frozen=True)
class Committed:
  """What is durable and published: the committed generation, its parent, and what is on disk."""

  committed: int = -1
  previous: int = -1
  on_disk: tuple[int, ...] = ()


class Generations:
  """The generations of one store.

  Args:
    committed: what the manifest records (nothing for a new store).
    pinned: pins recorded in the manifest (by an earlier process): dropped, with the generations
      only they kept (see `dropped_pins`).

  Examples:
    >>> gens = Generations()
    >>> first = gens.new_generation()  # a new lineage (what init and restore do)
    >>> gens.queue_commit(first)
    >>> gens.commit(first)  # nothing to delete yet
    []
    >>> second = gens.new_generation(parent=first)
    >>> gens.queue_commit(second)
    >>> gens.commit(second), gens.committed.on_disk  # the first stays: it is the parent
    ([], (0, 1))
    >>> third = gens.new_generation(parent=second)
    >>> gens.queue_commit(third)
    >>> gens.commit(third), gens.committed.on_disk
    ([0], (1, 2))
  """

  def __init__(self, committed: Committed = Committed(), pinned: tuple[int, ...] = ()):
    self.dropped_pins = tuple(sorted(pinned))
    on_disk = committed.on_disk
    if pinned:
      on_disk = tuple(g for g in on_disk if g in (committed.committed, committed.previous))
    self.committed = dataclasses.replace(committed, on_disk=tuple(sorted(on_disk)))
    # Pins by generation, counted: two checkpoints may save one generation at once, and the first
    # to finish must not release it under the other.
    self.pinned: collections.Counter[int] = collections.Counter()
    self.last_queued_commit = self.committed.committed
    self.newest = max([self.committed.committed, *self.committed.on_disk])
    self._children: dict[int, int] = {}  # parent -> the generation last made from it
    self._before: tuple | None = None  # (new lineage, head, head_parent, children) before it
    self.head: int | None = None
    self.head_parent: int | None = None
    if self.committed.committed >= 0:
      self.head = self.committed.committed
      self.head_parent = self.committed.previous if self.committed.previous >= 0 else None

  # -- lineage ----------------------------------------------------------------------------------------

  def new_generation(self, parent: int | None = None) -> int:
    """A generation number newer than any used so far, made from `parent` (None: a new lineage).

    Raises:
      StaleGenerationError: `parent` is neither the newest generation nor that one's parent;
        nothing changes.
    """
    if parent is not None:
      parent = int(parent)
      if self.head is None or parent not in (self.head, self.head_parent):
        newest = "none" if self.head is None else self.head
        made_from = "" if self.head_parent is None else f", made from {self.head_parent}"
        those = "it" if self.head_parent is None else "those"
        raise StaleGenerationError(
          f"generation {parent} is stale: the newest generation is {newest}{made_from}, and a new "
          f"generation can only be made from {those}."
        )
    # What `abandon` restores; only a new lineage (a restore) is ever given up.
    self._before = (
      (self.newest + 1, self.head, self.head_parent, self._children) if parent is None else None
    )
    self.newest += 1
    if parent is not None:
      self._children = {parent: self.newest}
    self.head, self.head_parent = self.newest, parent
    return self.newest

  def abandon(self, generation: int) -> None:
    """Undoes the last `new_generation`, of `generation`, which will never be committed (a
    restore that failed half-way): the newest generation is again the one before, so the states
    that name it stay updatable. Its number is not handed out again. Nothing happens when another
    generation was made since, or its commit was queued."""
    before = self._before
    if (
      before is not None
      and before[0] == generation == self.head
      and generation > self.last_queued_commit
    ):
      _, self.head, self.head_parent, self._children = before
      self._before = None

  def next_generation(self, generation: int) -> int:
    """The generation whose group 0 follows the last group of `generation` in the cyclic order."""
    return self._children.get(generation, generation + 1)

  # -- puts and commits -------------------------------------------------------------------------------

  def check_put(self, generation: int) -> None:
    """Raises ValueError unless `generation` may still be written (newer than the last commit)."""
    if generation <= self.last_queued_commit:
      raise ValueError(
        f"put: generation {generation} is not newer than committed generation "
        f"{self.last_queued_commit}; committed generations are immutable."
      )

  def note_put(self, generation: int) -> None:
    """Records that `generation` is being written: new generations are numbered after it."""
    self.newest = max(self.newest, generation)

  def check_commit(self, generation: int) -> None:
    """Raises ValueError unless `generation` is newer than the last queued commit."""
    if generation <= self.last_queued_commit:
      raise ValueError(
        f"commit: generation {generation} is not newer than generation {self.last_queued_commit}."
      )

  def queue_commit(self, generation: int) -> None:
    """Records a commit of `generation` as queued (`check_commit` first)."""
    self.check_commit(generation)
    self.last_queued_commit = generation

  def commit(self, generation: int, parent: int | None = None) -> list[int]:
    """Makes `generation` the committed one; returns the generations to delete from disk.

    Args:
      generation: the generation, durable on disk.
      parent: the generation it was computed from, kept on disk; defaults to the previously
        committed one. Ignored when it is not on disk.
    """
    old = self.committed
    previous = old.committed if parent is None else parent
    if previous not in old.on_disk:
      previous = -1
    keep = {generation, previous} | (set(self.pinned) & set(old.on_disk))
    keep.discard(-1)
    self.committed = Committed(generation, previous, tuple(sorted(keep)))
    return [g for g in old.on_disk if g not in keep]

  def undo_commit(self, before: Committed) -> None:
    """Restores the committed state `before` a `commit` whose publication failed."""
    self.committed = before

  # -- pins -------------------------------------------------------------------------------------------

  def pin(self, generation: int) -> None:
    """Keeps a committed generation on disk until `unpin`; ValueError if it is not on disk.

    Pins are counted: a generation pinned twice stays until unpinned twice."""
    self._check_on_disk(generation)
    self.pinned[generation] += 1

  def unpin(self, generation: int) -> list[int]:
    """Undoes one `pin`; returns the generations to delete (it, once no pin is left, unless it
    is the committed or the previous one)."""
    self._check_on_disk(generation)
    if self.pinned[generation] > 1:
      self.pinned[generation] -= 1
      return []
    self.pinned.pop(generation, None)
    c = self.committed
    if generation in (c.committed, c.previous):
      return []
    self.committed = dataclasses.replace(c, on_disk=tuple(g for g in c.on_disk if g != generation))
    return [generation]

  def _check_on_disk(self, generation: int) -> None:
    if generation not in self.committed.on_disk:
      raise ValueError(
        f"generation {generation} is not a committed generation on disk "
        f"({list(self.committed.on_disk)})."
      )
