"""The NVMe tier of `offload`: which state parts live in the store, and the jit callbacks that move them.

One `NvmeTier` per parameter tree of an `offload` transformation. It owns an `NvmeStore` in
``nvme_dir/process_{i}`` and is found again from a state through the id the state carries
(``OffloadState.nvme_store``), so that `footprint`, `to_inner` and checkpoints can reach the data.
In a jitted update, each group with NVMe leaves costs two `io_callback`s: one fetch (served from the
store's prefetch pool) and one put (written behind); two more per update allocate and commit the
generation.
"""

from __future__ import annotations

import itertools
import logging
import os
import pathlib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from optax_offload._src import nvme
from optax_offload._src import plan as plan_lib

logger = logging.getLogger(__name__)

# Open tiers by id. A tier stays here (and its store open) until `close`, even when the `offload`
# transformation that made it is gone: the states that name it stay usable.
_REGISTRY: dict[int, NvmeTier] = {}
_IDS = itertools.count(1)


def lookup(store_id: Any) -> NvmeTier:
  """The live `NvmeTier` a state names by its ``nvme_store`` id."""
  key = int(np.asarray(store_id))
  tier = _REGISTRY.get(key)
  if tier is None:
    raise RuntimeError(
      f"The NVMe store {key} named by this state is closed or belongs to another process. Create the "
      "state with tx.init(params) of the offload transformation that owns the nvme_dir (restore "
      "checkpoints into such a state)."
    )
  return tier


def process_directory(nvme_dir: str | os.PathLike) -> str:
  """This process's store directory under `nvme_dir` (one per process, as Orbax does)."""
  return os.path.join(os.path.abspath(os.fspath(nvme_dir)), f"process_{jax.process_index()}")


def placeholder(x: Any) -> jax.Array:
  """What the state holds in place of an NVMe array: an empty array of its dtype."""
  return jnp.zeros((0,), x.dtype)


class NvmeTier:
  """The NVMe-tier state arrays of one parameter tree, and their store.

  Args:
    directory: the store's directory (this process's).
    groups: the plan's groups of leaf indices.
    array_tiers: per leaf, the tier of each array of its state part (in `jax.tree.leaves` order).
    parts: abstract state parts per leaf (`jax.ShapeDtypeStruct` trees).
    **store_kwargs: passed to `NvmeStore` (prefetch_depth, write_depth, chunk_bytes).
  """

  layout: Any = None  # the `StateLayout` of the parameter tree, set by `offload`
  closed: bool = False

  def __init__(
    self,
    directory: str,
    groups: Sequence[Sequence[int]],
    array_tiers: Sequence[Sequence[plan_lib.Tier]],
    parts: Sequence[Any],
    **store_kwargs,
  ):
    nvme_arrays = {
      i: [j for j, t in enumerate(kinds) if t is plan_lib.Tier.NVME]
      for i, kinds in enumerate(array_tiers)
    }
    self._specs: dict[tuple[int, int], nvme.LeafSpec] = {}
    for i, js in nvme_arrays.items():
      arrays = jax.tree.leaves(parts[i])
      for j in js:
        x = arrays[j]
        self._specs[(i, j)] = nvme.LeafSpec(
          f"leaf{i:05d}_part{j}", tuple(x.shape), np.dtype(x.dtype)
        )
    # Store groups: the plan's groups restricted to NVMe arrays, in update order.
    self.groups: dict[int, int] = {}
    self._members: list[list[tuple[int, int]]] = []
    for k, group in enumerate(groups):
      members = [(i, j) for i in group for j in nvme_arrays[i]]
      if members:
        self.groups[k] = len(self._members)
        self._members.append(members)
    self.store = nvme.NvmeStore(
      directory,
      [[self._specs[key] for key in members] for members in self._members],
      **store_kwargs,
    )
    self.id = next(_IDS)
    _REGISTRY[self.id] = self

  # -- host side --------------------------------------------------------------------------------------

  def bytes(self) -> int:
    return self.store.bytes_on_disk()

  @property
  def specs(self) -> dict[tuple[int, int], nvme.LeafSpec]:
    """The `LeafSpec` of each NVMe array, keyed by (leaf index, index of the array in its part)."""
    return dict(self._specs)

  def array_path(self, key: tuple[int, int], generation: int) -> pathlib.Path:
    """The directory of one NVMe array's zarr3 files in a committed generation (e.g. to link them)."""
    return self.store.generation_path(generation) / nvme._leaf_dirname(self._specs[key].name)

  def write_group(self, plan_group: int, generation: int, parts: Mapping[int, Any]) -> None:
    """Queues one plan group's NVMe arrays of a generation (write-behind); `parts` by leaf index."""
    sg = self.groups[plan_group]
    self.store.put(sg, generation, [np.asarray(a) for a in _select(parts, self._members[sg])])

  def commit(self, generation: int) -> None:
    self.store.commit(generation)
    self.store.sync()

  def read(self, generation: int) -> dict[tuple[int, int], np.ndarray]:
    """Every NVMe array of a committed generation (blocking, checksums verified)."""
    arrays = self.store.read_generation(int(generation))
    return {key: arrays[spec.name] for key, spec in self._specs.items()}

  def materialize(self, inner_state: Any, generation: Any, memory_kind: str = "pinned_host") -> Any:
    """The inner state with its NVMe placeholders replaced by the data of `generation`."""
    shared, per_leaf = self.layout.split(inner_state)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=memory_kind)
    arrays = {
      k: jax.device_put(v, sharding) for k, v in self.read(int(np.asarray(generation))).items()
    }
    return self.layout.merge(shared, [_insert(i, part, arrays) for i, part in enumerate(per_leaf)])

  def close(self) -> None:
    self.closed = True
    self.store.close()
    _REGISTRY.pop(self.id, None)

  # -- traced side (inside jit) -----------------------------------------------------------------------
  # The callbacks of one update thread a token, ``[parent, child]``: the generation the state names and
  # the one this update writes, so that they run in program order through data dependencies. (Ordered
  # io_callbacks would do the same, but JAX 0.10 fails to lower them in a jit whose outputs carry memory
  # kinds.) The child is a fresh generation number, not ``parent + 1``: an update may start again from the
  # same state (`optax.MultiSteps` computes every mini-step from the state of the last real step).

  def begin_traced(self, generation: jax.Array) -> jax.Array:
    """One callback allocating the generation this update writes; returns the token."""

    def _begin(parent):
      return np.asarray([parent, self.store.new_generation(parent=int(parent))], np.int32)

    return io_callback(_begin, jax.ShapeDtypeStruct((2,), jnp.int32), generation)

  def fetch(
    self, plan_group: int, token: jax.Array
  ) -> tuple[dict[tuple[int, int], Any], jax.Array]:
    """One callback returning the group's NVMe arrays of the parent generation, and the token."""
    sg = self.groups[plan_group]
    members = self._members[sg]
    shapes = [jax.ShapeDtypeStruct(self._specs[k].shape, self._specs[k].dtype) for k in members]

    def _fetch(token):
      arrays = [np.ascontiguousarray(a) for a in self.store.fetch(sg, int(token[0]))]
      return [np.asarray(token, np.int32), *arrays]

    token, *flat = io_callback(_fetch, [jax.ShapeDtypeStruct((2,), jnp.int32), *shapes], token)
    return dict(zip(members, flat)), token

  def put(self, plan_group: int, token: jax.Array, parts: Mapping[int, Any]) -> jax.Array:
    """One callback handing the group's new arrays (of the child generation) to the writer thread."""
    sg = self.groups[plan_group]

    def _put(token, *arrays):
      self.store.put(sg, int(token[1]), list(arrays))
      return np.asarray(token, np.int32)

    flat = _select(parts, self._members[sg])
    return io_callback(_put, jax.ShapeDtypeStruct((2,), jnp.int32), token, *flat)

  def commit_traced(self, token: jax.Array) -> jax.Array:
    """One callback queueing the commit of the child generation; returns its number."""

    def _commit(token):
      self.store.commit(int(token[1]), parent=int(token[0]))
      return np.asarray(token[1], np.int32)

    return io_callback(_commit, jax.ShapeDtypeStruct((), jnp.int32), token)


def _select(parts: Mapping[int, Any], keys: Sequence[tuple[int, int]]) -> list[Any]:
  flat = {i: jax.tree.leaves(parts[i]) for i in {i for i, _ in keys}}
  return [flat[i][j] for i, j in keys]


def _insert(i: int, part: Any, arrays: Mapping[tuple[int, int], Any]) -> Any:
  leaves, treedef = jax.tree.flatten(part)
  return treedef.unflatten([arrays.get((i, j), x) for j, x in enumerate(leaves)])
