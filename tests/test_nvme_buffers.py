"""Leased read buffers of the NVMe store (`optax_offload/_src/nvme/buffers.py`)."""

import gc
import mmap

import jax
import ml_dtypes
import numpy as np

from optax_offload._src.nvme.buffers import ReadBuffers


def _address(x) -> int:
  return x.__array_interface__["data"][0]


def _typed(lease: np.ndarray, shape, dtype) -> np.ndarray:
  """What the store returns: a typed view of the first bytes of a lease."""
  n = int(np.prod(shape)) * np.dtype(dtype).itemsize
  return lease[:n].view(dtype).reshape(shape)


def test_a_buffer_is_lent_again_only_once_every_derived_array_is_gone():
  pool = ReadBuffers(capacity=1 << 20)
  a = _typed(pool.take(4096), (64, 4), np.float32)
  address = _address(a)
  view = a.view()
  view.flags.writeable = False
  # numpy points a slice of `view` at the owning array, past `view`: the lease still sees it.
  derived = [a[3:5], view[1:2], a.view(np.uint32), memoryview(a.reshape(-1)), view]
  del a, view
  while derived:
    assert _address(pool.take(4096)) != address
    derived.pop()
  gc.collect()
  assert _address(pool.take(4096)) == address


def test_buffers_are_page_aligned_for_direct_io():
  pool = ReadBuffers(capacity=1 << 20)
  held = [pool.take(n) for n in (4096, 12288, 100)]
  assert all(_address(x) % mmap.PAGESIZE == 0 for x in held)
  assert [x.nbytes for x in held] == [4096, 12288, 100]
  fresh = ReadBuffers(capacity=0).take(8192)  # past the capacity: fresh, aligned too
  assert _address(fresh) % mmap.PAGESIZE == 0


def test_a_zero_copy_jax_array_holds_its_lease():
  pool = ReadBuffers(capacity=1 << 20)
  a = _typed(pool.take(4096), (1024,), np.float32)
  a[:] = 1
  address = _address(a)
  held = jax.device_put(a)  # may alias the numpy buffer on CPU
  del a
  b = _typed(pool.take(4096), (1024,), np.float32)
  b[:] = 2
  assert float(held[0]) == 1.0
  del held, b
  gc.collect()
  assert _address(pool.take(4096)) == address


def test_capacity_bounds_the_kept_buffers():
  pool = ReadBuffers(capacity=3 * 4096)
  first = pool.take(2 * 4096)  # kept
  fresh = pool.take(2 * 4096)  # would pass the capacity: not kept
  assert len(pool.addresses()) == 1 and _address(fresh) not in pool.addresses()
  del first
  other = _typed(
    pool.take(3 * 4096), (6144,), ml_dtypes.bfloat16
  )  # the free buffer of another size makes room
  assert pool.addresses() == [_address(other)] and other.dtype == ml_dtypes.bfloat16
  empty = _typed(pool.take(0), (0, 3), np.float32)
  assert empty.shape == (0, 3)
