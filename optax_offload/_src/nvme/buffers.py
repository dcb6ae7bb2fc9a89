"""Reusable, page-aligned host buffers for the store's group reads, lent out as leases.

Chunk files are read straight into these buffers with direct I/O (`chunk_io`), which needs
page-aligned memory: each buffer is an anonymous ``mmap``, with room past the array for the last
chunk's padding (`format.SlabLayout.buffer_nbytes`). Fresh pages cost a page fault each on first
touch (about 1 s per GB measured on a 2-core VM, as much as the read itself); reading into buffers
that earlier steps already touched avoids that. A buffer may be read into again only once nothing
uses the data of the previous read: not the prefetch pool, not the caller that fetched it, and not
JAX, which on CPU may keep a zero-copy reference to a callback's result.

How the pool knows: every read gets a *lease*, a 1-D array built with ``np.frombuffer`` over a
``memoryview`` of the buffer, and a `weakref.finalize` on it returns the buffer to the pool. Because the
lease's base is a memoryview (not an ndarray), numpy stops there when it collapses view bases: every
array derived from the lease (reshapes, dtype views, slices, JAX's zero-copy arrays, buffer exports)
refers to the lease, so the lease dies exactly when the last of them does. (A finalizer on a view would
not do: numpy points a view's slices at the owning array, past the view.) This replaces an earlier count
of references (``sys.getrefcount``) compared with a measured constant: the lease says the same without
depending on how an interpreter counts temporaries.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
import weakref

import numpy as np


def aligned_empty(nbytes: int) -> np.ndarray:
  """A page-aligned, writable 1-D uint8 array of `nbytes` (an anonymous mmap; zeros until written).

  Examples:
    >>> import mmap
    >>> aligned_empty(10_000).ctypes.data % mmap.PAGESIZE
    0
  """
  if nbytes <= 0:
    return np.empty(0, np.uint8)
  return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)


@dataclasses.dataclass(eq=False)
class _Slot:
  buffer: np.ndarray
  leased: bool = False


def _end_lease(slot: _Slot) -> None:
  # Runs in whichever thread drops the last reference, possibly inside `take` (a garbage collection):
  # a plain attribute store, no lock.
  slot.leased = False


class ReadBuffers:
  """At most `capacity` bytes of page-aligned buffers, lent out for group reads.

  Beyond the capacity, `take` returns fresh buffers that are not kept.

  Examples:
    >>> pool = ReadBuffers(capacity=3 * 4096)
    >>> a = pool.take(4096)
    >>> b = pool.take(4096)  # `a` is still used: another buffer
    >>> a.ctypes.data == b.ctypes.data
    False
    >>> address = a.ctypes.data
    >>> x = a[:400].view(np.float32)  # arrays derived from the lease hold it too
    >>> del a
    >>> pool.take(4096).ctypes.data == address
    False
    >>> del x  # the lease ends with the last array that uses it
    >>> pool.take(4096).ctypes.data == address
    True
  """

  def __init__(self, capacity: int):
    self._capacity = capacity
    self._slots: list[_Slot] = []
    self._lock = threading.Lock()

  def take(self, nbytes: int) -> np.ndarray:
    """A writable, page-aligned 1-D uint8 array of `nbytes`, in a buffer nothing else uses."""
    with self._lock:
      for slot in self._slots:
        if not slot.leased and slot.buffer.nbytes == nbytes:
          return self._lease(slot)
      kept = sum(slot.buffer.nbytes for slot in self._slots)
      i = 0
      while kept + nbytes > self._capacity and i < len(self._slots):
        if not self._slots[i].leased:  # free, but of another size: drop it
          kept -= self._slots.pop(i).buffer.nbytes
        else:
          i += 1
      if kept + nbytes > self._capacity or nbytes == 0:
        return aligned_empty(nbytes)
      slot = _Slot(aligned_empty(nbytes))
      self._slots.append(slot)
      return self._lease(slot)

  @staticmethod
  def _lease(slot: _Slot) -> np.ndarray:
    slot.leased = True
    lease = np.frombuffer(memoryview(slot.buffer), dtype=np.uint8)
    weakref.finalize(lease, _end_lease, slot)
    return lease

  def addresses(self) -> list[int]:
    """The data addresses of the kept buffers (for tests and diagnostics)."""
    with self._lock:
      return [slot.buffer.ctypes.data for slot in self._slots]

  def clear(self) -> None:
    """Forgets every buffer; leases still held stay valid (their arrays keep the memory)."""
    with self._lock:
      self._slots = []
