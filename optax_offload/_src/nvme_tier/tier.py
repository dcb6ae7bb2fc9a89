"""`NvmeTier`: the NVMe-tier arrays of one parameter tree, their store, and the eager interface.

One tier per parameter tree of an `offload` transformation with state on NVMe. It owns an
`NvmeStore` in ``nvme_dir/process_{i}`` and says, for every NVMe array, where its shards (and row
slices) live (`shards`). This module is the eager side, called outside `jax.jit`: offload's init
writes the first generation, checkpoints pin, link and restore generations, inspection reads
(`materialize`) and counts them. The traced side, the update's callbacks, is `callbacks`; a tier
is found again from a state through `registry`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import mmap
import os
import pathlib
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from optax_offload._src import layout as layout_lib
from optax_offload._src import nvme
from optax_offload._src import plan as plan_lib
from optax_offload._src.nvme_tier import registry
from optax_offload._src.nvme_tier import rendezvous as rendezvous_lib
from optax_offload._src.nvme_tier import shards as shards_lib
from optax_offload._src.nvme_tier.shards import Key
from optax_offload._src.nvme_tier.shards import Region

logger = logging.getLogger(__name__)


def process_directory(nvme_dir: str | os.PathLike) -> str:
  """This process's store directory under `nvme_dir` (one per process, as Orbax does)."""
  return os.path.join(os.path.abspath(os.fspath(nvme_dir)), f"process_{jax.process_index()}")


def placeholder(x: Any) -> jax.Array:
  """What the state holds in place of an NVMe array: an empty array of its dtype."""
  return jnp.zeros((0,), x.dtype)


@dataclasses.dataclass(frozen=True)
class _Slot:
  key: Key


DONATED = (
  " A jitted step that donates its params or state has lost them to this error (JAX consumes "
  "donated buffers even when the run fails): take them from a checkpoint."
)
"""Said by every error of an update refused while its program runs (a closed store, a stale
state): by then the step's donated arguments are gone."""


class NvmeTier:
  """The NVMe-tier state arrays of one parameter tree, and their store.

  Lifetime: a tier registers itself (`registry`) under its `id` when it opens its store, and stays
  registered (its store open, its directory locked) until `close` (`oo.close_nvme`).

  The eager interface the rest of the package uses: offload's init (`sharding`, `write_group`,
  `commit`), checkpoints (`keys`, `shape_dtype`, `replace_arrays`, `array_paths`, `sync`,
  `pin`/`unpin`, `has_generation`, `stored_parts`, `write_generation`), inspection (`bytes`,
  `materialize`, `close`). The update's callbacks (`callbacks.TracedTier`) use `arrays`, `members`,
  `names`, `groups`, `mesh`, `rendezvous` and `check_updatable`.

  Args:
    directory: the store's directory (this process's).
    layout: the `StateLayout` of the parameter tree (where the per-leaf parts sit in a state).
    units: the plan's groups (`plan.Plan.units`): tuples of `plan.Piece`s, whole leaves or row
      slices. The NVMe arrays of a sliced leaf are stored slice by slice, each slice in the store
      group of the plan group that holds it.
    array_tiers: per leaf, the tier of each array of its state part (in `jax.tree.leaves` order).
    parts: abstract state parts per leaf (`jax.ShapeDtypeStruct` trees).
    param_shapes: per leaf, the param's shape.
    shardings: per leaf, the param's sharding (None: the first local device).
    options: the store's `NvmeOptions` (None: the defaults).

  Raises:
    NotImplementedError: params whose state goes to NVMe are on different meshes.
    ValueError: a sliced leaf has an NVMe array that does not follow its rows, or whose leading
      axis is sharded.
  """

  closed: bool = False

  def __init__(
    self,
    directory: str,
    layout: layout_lib.StateLayout,
    units: Sequence[Sequence[plan_lib.Piece]],
    array_tiers: Sequence[Sequence[plan_lib.Tier]],
    parts: Sequence[Any],
    param_shapes: Sequence[tuple[int, ...]],
    shardings: Sequence[Any],
    options: nvme.NvmeOptions | None = None,
  ):
    self.layout = layout
    units = [tuple(unit) for unit in units]
    self.arrays, self.mesh = shards_lib.stored_arrays(
      units, array_tiers, parts, param_shapes, shardings
    )
    self.part_defs = [jax.tree.structure(part) for part in parts]  # of each leaf's state part
    self._local_devices = [
      d for d in self.mesh.devices.flat if d.process_index == jax.process_index()
    ]
    # The store's groups: `groups` maps a plan group to its store group, `members` lists each
    # store group's (NVMe array, rows) and `names` its store leaves.
    self.groups, self.members = shards_lib.store_groups(units, self.arrays)
    specs = shards_lib.leaf_specs(self.members, self.arrays)
    self.names = [[spec.name for spec in group] for group in specs]
    options = nvme.NvmeOptions.of(options)
    self.store = nvme.NvmeStore(directory, specs, **dataclasses.asdict(options))
    # Page-aligned buffers for the arrays a put callback hands to the store on a CPU
    # (`host_copies`): one slot holds one device's shards of any store group; a put holds one
    # while it waits and `write_depth` more are queued or being written.
    self._copy_slot = (
      max(
        sum(
          nvme.round_up(int(np.prod(a.shard_shape(rows))) * a.dtype.itemsize, mmap.PAGESIZE)
          for key, rows in group
          for a in [self.arrays[key]]
        )
        for group in self.members
      )
      if self.members
      else 0
    )
    self._copies = nvme.ReadBuffers(
      (options.write_depth + 1) * len(self._local_devices) * self._copy_slot
    )
    self.rendezvous = rendezvous_lib.Rendezvous(self.store, len(self._local_devices))
    # Generations this tier makes are newer than any on disk when it opened the store; a state
    # naming an older one was made by another store (closed, or in another process).
    self._first_generation = (
      max([self.store.committed_generation, *self.store.generations_on_disk]) + 1
    )
    if self.store.committed_generation >= 0:
      logger.warning(
        "offload: %s holds an optimizer state already (committed generation %d, of an earlier "
        "run or a closed state): the new state starts there and that one is deleted as the new "
        "one's steps commit. The NVMe directory is no checkpoint: to continue that run, restore "
        "an Orbax checkpoint of it (oo.OffloadRestore into this state).",
        self.store.directory,
        self.store.committed_generation,
      )
    # Counters of `value_and_update`'s layer callbacks on this tier (`layers.TracedLayers`).
    self.layer_stats: collections.Counter[str] = collections.Counter()
    self.id = registry.register(self)

  @property
  def host_buffer_bound(self) -> int:
    """Most bytes of host buffers this process's tier holds: the store's `host_buffer_bound` plus
    the put copy each local device fills while the store still holds ``write_depth`` others
    (`host_copies`, on a CPU backend: the pool's one slot per device beyond the store's count;
    elsewhere JAX's ``io_callback`` makes a copy of about that size itself)."""
    return self.store.host_buffer_bound + len(self._local_devices) * self._copy_slot

  def host_copies(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Copies of one device's `arrays` (a store group's shards, put), each page-aligned in one
    buffer of the tier's pool: the store writes them with direct I/O without a staging copy, and
    the buffer is reused once the store lets go of the arrays (`nvme.ReadBuffers`)."""
    sizes = [nvme.round_up(a.nbytes, mmap.PAGESIZE) for a in arrays]
    lease = self._copies.take(max(self._copy_slot, sum(sizes)))
    out, offset = [], 0
    for a, size in zip(arrays, sizes):
      copy = lease[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
      np.copyto(copy, a)
      copy.flags.writeable = False
      out.append(copy)
      offset += size
    return out

  def bytes(self) -> int:
    """Bytes of one generation in this process's store (its shards)."""
    return self.store.bytes_on_disk()

  def keys(self) -> list[tuple[int, int]]:
    """The NVMe arrays, as (leaf index, index of the array in the leaf's state part)."""
    return sorted(self.arrays)

  def shape_dtype(self, key: tuple[int, int]) -> tuple[tuple[int, ...], np.dtype]:
    """The global shape and dtype of an NVMe array."""
    a = self.arrays[key]
    return a.shape, a.dtype

  def sharding(self, key: tuple[int, int], memory_kind: str | None = None) -> NamedSharding:
    """The sharding of an NVMe array (its param's mesh)."""
    return NamedSharding(self.mesh, self.arrays[key].spec, memory_kind=memory_kind)

  def stored_parts(self, key: Key, generation: int) -> list[tuple[Region, pathlib.Path]]:
    """Where this process stores an NVMe array in a committed generation.

    Returns (region, zarr3 directory) of each shard, or of each row slice of each shard for a leaf
    updated in slices. The files are immutable, and stay on disk while the generation is the
    committed one, its parent, or pinned (`pin`).
    """
    a = self.arrays[key]
    return [
      (a.region(s, rows), self.store.leaf_path(generation, a.name(s, rows)))
      for s, rows in a.stored()
    ]

  def store_leaves(self, store_group: int) -> list[tuple[Key, Region]]:
    """The leaves of a store group, in store order: (NVMe array key, the region it holds)."""
    return [
      (key, self.arrays[key].region(s, rows))
      for key, rows in self.members[store_group]
      for s in self.arrays[key].local
    ]

  def replace_arrays(self, inner: Any, fn: Callable[[Key, Any], Any]) -> Any:
    """`inner` (a state's inner state) with each NVMe array's placeholder `x` replaced by
    ``fn(key, x)``; the params' containers may differ from those `init` saw (Flax NNX)."""
    layout = self.layout.matching(inner)
    shared, per_leaf = layout.split(inner)

    def replace(i, part):
      arrays, treedef = jax.tree.flatten(part)
      return treedef.unflatten(
        [fn((i, j), x) if (i, j) in self.arrays else x for j, x in enumerate(arrays)]
      )

    return layout.merge(shared, [replace(i, part) for i, part in enumerate(per_leaf)])

  def array_paths(self) -> dict[Key, Any]:
    """Where each NVMe array sits in the inner state: its key path (`jax.tree_util` keys).

    For states whose structure `replace_arrays` cannot split (``nnx.state`` of an optimizer holds
    the inner state as nested mappings of Variables): find the arrays by path instead.
    """
    per_leaf = [
      part_def.unflatten([_Slot((i, j)) for j in range(part_def.num_leaves)])
      for i, part_def in enumerate(self.part_defs)
    ]
    # Shared leaves do not matter here; `merge` needs one entry per slot of the inner state.
    slots = self.layout.merge([None] * self.layout._treedef.num_leaves, per_leaf)
    flat, _ = jax.tree_util.tree_flatten_with_path(slots, is_leaf=lambda x: isinstance(x, _Slot))
    return {x.key: path for path, x in flat if isinstance(x, _Slot)}

  @property
  def directory(self) -> pathlib.Path:
    """This process's store directory."""
    return self.store.directory

  def sync(self) -> None:
    """Blocks until every queued write and commit is durable; re-raises background errors."""
    self.store.sync()

  def has_generation(self, generation: int) -> bool:
    """Whether `generation` is committed and still on disk, once queued commits are durable.

    A store that a failed write stopped commits nothing more: its generations on disk are read
    (e.g. saved) as they are, the error said by its next write or `sync`.
    """
    try:
      self.store.sync()
    except nvme.NvmeError:  # only the error that stopped the store
      pass
    return int(generation) in self.store.generations_on_disk

  def pin(self, generation: int) -> None:
    """Keeps a committed generation on disk until `unpin` (while a checkpoint links its files).

    Raises:
      ValueError: `generation` is no longer on disk (the store keeps the last two).
    """
    self.store.pin(generation)

  def unpin(self, generation: int) -> None:
    """Undoes `pin`."""
    self.store.unpin(generation)

  def write_generation(
    self, fill: Callable[[list[tuple[Key, Region]]], Sequence[np.ndarray]]
  ) -> int:
    """Writes a new generation of this process's NVMe arrays and commits it (e.g. a restore).

    The generation is written one store group at a time, so it never sits whole in memory.

    Args:
      fill: called once per store group, in order, with the (NVMe array key, region) of each of
        its stored parts (`store_leaves`); returns their data, in that order.

    Returns:
      The generation, committed and durable.

    When `fill` or a write raises, the generation is given up: the states that name the
    generation before it stay updatable.
    """
    self.store.sync()
    generation = self.store.new_generation()
    try:
      for group in range(len(self.members)):
        self.store.put(group, generation, fill(self.store_leaves(group)))
      self.store.commit(generation)
      self.store.sync()
    except BaseException:
      self.store.abandon_generation(generation)
      raise
    return generation

  def write_group(self, plan_group: int, generation: int, parts: Mapping[int, Any]) -> None:
    """Queues one plan group's NVMe arrays of a generation (write-behind); `parts` by leaf index.

    The arrays are global `jax.Array`s (this process's shards are read) or numpy arrays: for a
    row slice of a leaf, the slice's rows (or the whole leaf's array, whose rows are taken), else
    the whole array.
    """
    sg = self.groups[plan_group]
    arrays = []
    for (key, rows), x in zip(
      self.members[sg], shards_lib.select(parts, [k for k, _ in self.members[sg]])
    ):
      a = self.arrays[key]
      # The rows to take from `x`'s leading axis: none to take when `x` holds just the slice.
      take = rows if rows is not None and np.shape(x)[0] == a.shape[0] else None
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        by_shard = {a.number[sh.device.id]: sh.data for sh in x.addressable_shards}
        for s in a.local:
          shard = np.asarray(by_shard[s])
          arrays.append(shard if take is None else shard[take[0] : take[1]])
      else:
        x = np.asarray(x)
        for s in a.local:
          box = a.region(s, rows)
          if rows is not None and take is None:
            box = ((0, rows[1] - rows[0]), *box[1:])
          arrays.append(x[tuple(slice(*r) for r in box)])
    self.store.put(sg, generation, arrays)

  def commit(self, generation: int) -> None:
    self.store.commit(generation)
    self.store.sync()

  def materialize(self, inner_state: Any, generation: Any, memory_kind: str = "pinned_host") -> Any:
    """The inner state with its NVMe placeholders replaced by the data of `generation`.

    The arrays are global arrays with their params' shardings, built from this process's shards.
    """
    layout = self.layout.matching(inner_state)
    shared, per_leaf = layout.split(inner_state)
    generation = int(np.asarray(generation))
    if not self.has_generation(generation):
      raise ValueError(
        f"offload: this optimizer state is stale: it names NVMe generation {generation}, which "
        f"the store {self.store.directory} no longer keeps (it keeps the newest generation and "
        "its parent). Read the state the latest update returned, or restore a checkpoint."
      )
    stored = self.store.read_generation(generation)
    arrays = {}
    for key, a in self.arrays.items():
      data = {}  # shard number -> its data (a sliced leaf's slices joined)
      for s in a.local:
        if a.pieces == (None,):
          data[s] = stored.pop(a.name(s))
        else:
          data[s] = np.concatenate([stored.pop(a.name(s, rows)) for rows in a.pieces])
      shards = [
        jax.device_put(
          data[a.number[d.id]], jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind)
        )
        for d in self._local_devices
      ]
      arrays[key] = jax.make_array_from_single_device_arrays(
        a.shape, self.sharding(key, memory_kind), shards
      )
    return layout.merge(shared, [_insert(i, part, arrays) for i, part in enumerate(per_leaf)])

  def check_updatable(self, generation: int) -> None:
    """Raises when an update from a state naming `generation` cannot run on this tier."""
    if self.closed:
      raise RuntimeError(
        f"offload: the NVMe store {self.store.directory} of this optimizer state was closed "
        "(oo.close_nvme), so the state can no longer be updated. Create a new state with "
        "tx.init(params), or restore a checkpoint into one (oo.OffloadRestore)." + DONATED
      )
    if generation < self._first_generation:
      raise RuntimeError(
        f"offload: this optimizer state names NVMe generation {generation}, which the store "
        f"{self.store.directory} did not make since it was opened (its generations start at "
        f"{self._first_generation}): the state comes from a store that was closed (oo.close_nvme) "
        "or from another process. Create a new state with tx.init(params), or restore a "
        "checkpoint into one (oo.OffloadRestore)." + DONATED
      )

  def close(self) -> None:
    """Waits for queued writes, closes the store (its threads and lock) and unregisters. Idempotent."""
    self.closed = True
    registry.unregister(self.id)
    self.store.close()

  def signature(self) -> tuple[Any, ...]:
    return (self.mesh, self.members, self.arrays)


def _insert(i: int, part: Any, arrays: Mapping[tuple[int, int], Any]) -> Any:
  leaves, treedef = jax.tree.flatten(part)
  return treedef.unflatten([arrays.get((i, j), x) for j, x in enumerate(leaves)])
