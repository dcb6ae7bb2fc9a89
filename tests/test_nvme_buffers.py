"""Leased read buffers of the NVMe store (`optax_offload/_src/nvme/buffers.py`)."""

import gc

import jax
import ml_dtypes
import numpy as np

from optax_offload._src.nvme.buffers import ReadBuffers


def _address(x) -> int:
  return x.__array_interface__["data"][0]


def test_a_buffer_is_lent_again_only_once_every_derived_array_is_gone():
  pool = ReadBuffers(capacity=1 << 20)
  a = pool.take((64, 4), np.dtype(np.float32))
  address = _address(a)
  view = a.view()
  view.flags.writeable = False
  # numpy points a slice of `view` at the owning array, past `view`: the lease still sees it.
  derived = [a[3:5], view[1:2], a.view(np.uint32), memoryview(a.reshape(-1)), view]
  del a, view
  while derived:
    assert _address(pool.take((64, 4), np.dtype(np.float32))) != address
    derived.pop()
  gc.collect()
  assert _address(pool.take((64, 4), np.dtype(np.float32))) == address


def test_a_zero_copy_jax_array_holds_its_lease():
  pool = ReadBuffers(capacity=1 << 20)
  a = pool.take((1024,), np.dtype(np.float32))
  a[:] = 1
  address = _address(a)
  held = jax.device_put(a)  # may alias the numpy buffer on CPU
  del a
  b = pool.take((1024,), np.dtype(np.float32))
  b[:] = 2
  assert float(held[0]) == 1.0
  del held, b
  gc.collect()
  assert _address(pool.take((1024,), np.dtype(np.float32))) == address


def test_capacity_bounds_the_kept_buffers():
  pool = ReadBuffers(capacity=3000)
  first = pool.take((500,), np.dtype(np.float32))  # 2000 bytes: kept
  fresh = pool.take((500,), np.dtype(np.float32))  # would pass the capacity: not kept
  assert len(pool.addresses()) == 1 and _address(fresh) not in pool.addresses()
  del first
  other = pool.take((1000,), ml_dtypes.bfloat16)  # the free buffer of another shape makes room
  assert pool.addresses() == [_address(other)] and other.dtype == ml_dtypes.bfloat16
  empty = pool.take((0, 3), np.dtype(np.float32))
  assert empty.shape == (0, 3)
