"""Reusable host buffers for the store's group reads, lent out as leases.

Fresh pages cost a page fault each on first touch (about 1 s per GB measured on a 2-core VM, as much as
the read itself); reading into buffers that earlier steps already touched avoids that. A buffer may be
read into again only once nothing uses the data of the previous read: not the prefetch pool, not the
caller that fetched it, and not JAX, which on CPU may keep a zero-copy reference to a callback's result.

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
import math
import threading
import weakref

import numpy as np


@dataclasses.dataclass(eq=False)
class _Slot:
  buffer: np.ndarray
  leased: bool = False


def _end_lease(slot: _Slot) -> None:
  # Runs in whichever thread drops the last reference, possibly inside `take` (a garbage collection):
  # a plain attribute store, no lock.
  slot.leased = False


class ReadBuffers:
  """At most `capacity` bytes of buffers, lent out for group reads.

  Beyond the capacity, `take` returns fresh arrays that are not kept.

  Examples:
    >>> pool = ReadBuffers(capacity=4 * 1024)
    >>> a = pool.take((256,), np.float32)
    >>> b = pool.take((256,), np.float32)  # `a` is still used: another buffer
    >>> a.ctypes.data == b.ctypes.data
    False
    >>> address = a.ctypes.data
    >>> del a  # the lease ends with the last array that uses it
    >>> pool.take((256,), np.float32).ctypes.data == address
    True
  """

  def __init__(self, capacity: int):
    self._capacity = capacity
    self._slots: list[_Slot] = []
    self._lock = threading.Lock()

  def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A writable array of `shape` and `dtype`, in a buffer nothing else uses."""
    dtype = np.dtype(dtype)
    with self._lock:
      for slot in self._slots:
        if not slot.leased and slot.buffer.shape == shape and slot.buffer.dtype == dtype:
          return self._lease(slot)
      nbytes = math.prod(shape) * dtype.itemsize
      kept = sum(slot.buffer.nbytes for slot in self._slots)
      i = 0
      while kept + nbytes > self._capacity and i < len(self._slots):
        if not self._slots[i].leased:  # free, but of another shape: drop it
          kept -= self._slots.pop(i).buffer.nbytes
        else:
          i += 1
      if kept + nbytes > self._capacity:
        return np.empty(shape, dtype)
      slot = _Slot(np.empty(shape, dtype))
      self._slots.append(slot)
      return self._lease(slot)

  @staticmethod
  def _lease(slot: _Slot) -> np.ndarray:
    slot.leased = True
    flat = slot.buffer.reshape(-1).view(np.uint8)
    lease = np.frombuffer(memoryview(flat), dtype=slot.buffer.dtype)
    weakref.finalize(lease, _end_lease, slot)
    return lease.reshape(slot.buffer.shape)

  def addresses(self) -> list[int]:
    """The data addresses of the kept buffers (for tests and diagnostics)."""
    with self._lock:
      return [slot.buffer.ctypes.data for slot in self._slots]

  def clear(self) -> None:
    """Forgets every buffer; leases still held stay valid (their arrays keep the memory)."""
    with self._lock:
      self._slots = []
