"""The store's generation bookkeeping (`optax_offload/_src/nvme/generations.py`), without threads or disk."""

import pytest

from optax_offload._src.nvme.errors import StaleGenerationError
from optax_offload._src.nvme.generations import Committed
from optax_offload._src.nvme.generations import Generations


def _committed_chain(n: int) -> Generations:
  """A store that committed generations 0..n-1, each made from the one before."""
  gens = Generations()
  parent = None
  for _ in range(n):
    g = gens.new_generation(parent)
    gens.queue_commit(g)
    gens.commit(g)
    parent = g
  return gens


def test_a_new_store_has_nothing_committed():
  gens = Generations()
  assert gens.committed == Committed(-1, -1, ())
  assert gens.head is None and gens.last_queued_commit == -1
  with pytest.raises(StaleGenerationError, match="newest generation is none"):
    gens.new_generation(parent=0)
  assert gens.new_generation() == 0


def test_commits_keep_the_committed_and_its_parent():
  gens = _committed_chain(2)
  assert gens.committed == Committed(1, 0, (0, 1))
  g = gens.new_generation(parent=1)
  gens.queue_commit(g)
  assert gens.commit(g) == [0]
  assert gens.committed == Committed(2, 1, (1, 2))


def test_a_commit_keeps_an_explicit_parent():
  # MultiSteps: every mini-step is made from the state of the last real step.
  gens = _committed_chain(2)
  a = gens.new_generation(parent=1)
  gens.queue_commit(a)
  gens.commit(a, parent=1)
  b = gens.new_generation(parent=1)  # from the newest's parent: `a` becomes stale
  gens.queue_commit(b)
  assert gens.commit(b, parent=1) == [a]
  assert gens.committed == Committed(b, 1, (1, b))
  with pytest.raises(StaleGenerationError, match=rf"generation {a} is stale.* is {b}, made from 1"):
    gens.new_generation(parent=a)
  assert gens.new_generation(parent=b) == b + 1  # the refusal changed nothing


def test_a_parent_that_is_not_on_disk_is_not_kept():
  gens = _committed_chain(3)
  g = gens.new_generation(parent=2)
  gens.queue_commit(g)
  gens.commit(g, parent=0)  # 0 was deleted already
  assert gens.committed == Committed(g, -1, (g,))


def test_committed_generations_are_immutable():
  gens = _committed_chain(3)
  with pytest.raises(ValueError, match="immutable"):
    gens.check_put(2)
  with pytest.raises(ValueError, match="not newer than generation 2"):
    gens.queue_commit(2)
  gens.check_put(3)
  gens.note_put(7)
  assert gens.new_generation() == 8  # numbered after every generation put


def _commit_on(gens: Generations, n: int) -> None:
  """Commits `n` more generations, each made from the one before."""
  for _ in range(n):
    g = gens.new_generation(parent=gens.head)
    gens.queue_commit(g)
    gens.commit(g)


def test_pins_keep_a_generation_until_unpinned():
  gens = _committed_chain(2)
  gens.pin(1)
  _commit_on(gens, 2)
  assert gens.committed.on_disk == (1, 2, 3)
  assert gens.unpin(1) == [1]
  assert gens.committed.on_disk == (2, 3)
  with pytest.raises(ValueError, match="not a committed generation on disk"):
    gens.pin(1)
  gens.pin(3)
  assert gens.unpin(3) == []  # the committed one stays


def test_a_generation_pinned_twice_stays_until_unpinned_twice():
  """Two checkpoints saving one generation at once: the first to finish does not release it."""
  gens = _committed_chain(2)
  gens.pin(1)
  gens.pin(1)
  _commit_on(gens, 2)
  assert gens.committed.on_disk == (1, 2, 3)
  assert gens.unpin(1) == []
  assert gens.committed.on_disk == (1, 2, 3)
  g = gens.new_generation(parent=gens.head)
  gens.queue_commit(g)
  assert gens.commit(g) == [2]  # still pinned once
  assert gens.unpin(1) == [1]
  assert gens.committed.on_disk == (3, 4)


def test_an_abandoned_generation_leaves_the_one_before_newest():
  gens = _committed_chain(2)
  g = gens.new_generation()  # a restore's new lineage, which fails
  gens.abandon(g)
  assert (gens.head, gens.head_parent) == (1, 0)
  assert gens.new_generation(parent=1) == g + 1  # its number is not reused
  queued = gens.new_generation()
  gens.queue_commit(queued)
  gens.abandon(queued)  # queued for commit: kept
  assert gens.head == queued


def test_pins_of_an_earlier_process_are_dropped():
  gens = Generations(Committed(4, 3, (1, 3, 4)), pinned=(1,))
  assert gens.dropped_pins == (1,)
  assert gens.committed == Committed(4, 3, (3, 4))
  assert (gens.head, gens.head_parent, gens.newest) == (4, 3, 4)


def test_undo_commit_restores_the_committed_state():
  gens = _committed_chain(2)
  before = gens.committed
  g = gens.new_generation(parent=1)
  gens.queue_commit(g)
  gens.commit(g)
  gens.undo_commit(before)
  assert gens.committed == before


def test_the_cyclic_order_follows_the_lineage():
  gens = _committed_chain(1)
  assert gens.next_generation(0) == 1
  child = gens.new_generation(parent=0)
  gens.new_generation()  # a new lineage leaves the parent's child as it was
  assert gens.next_generation(0) == child
