"""The NVMe tier of `offload`: which state parts live in the store, and the jit callbacks that move them.

One `NvmeTier` per parameter tree of an `offload` transformation. It owns an `NvmeStore` in
``nvme_dir/process_{i}`` and is found again from a state through the id the state carries
(``OffloadState.nvme_store``), so that `footprint`, `to_inner` and checkpoints can reach the data.

Sharding: every NVMe array keeps its param's sharding (a ``NamedSharding`` over one mesh; params on
one device form a one-device mesh). Each process stores only the distinct shards its devices hold,
once each (a replicated array once per process, not once per device), as store leaves
``leaf{i}_part{j}_shard{s}`` (``s`` numbers the array's distinct shards in the order of their
offsets).

Row slices: the plan streams a big leaf in row slices (`plan.Piece`) when its update is row-separable
and its leading axis is not sharded. The NVMe tier then stores each slice's rows of every shard
separately, as store leaves ``leaf{i}_part{j}_shard{s}_rows{start}-{stop}`` in the store group of the
plan group that updates the slice, so a group's fetch and put move only its slice, and the store's
buffers hold slices, not the whole leaf. The plan is the same whatever the tier, so a leaf on NVMe
is updated in the same groups (and to the same bits) as on the host.

The callbacks run shard-locally, inside `jax.shard_map`, on every device of the mesh; a
`_Rendezvous` joins the calls of one process's devices into one store operation each, so in a
jitted update each group with NVMe leaves costs one store fetch (served from the prefetch pool) and
one store put (written behind), and each update one allocation and one commit of a generation.

Length: over the ~500 lines we aim for: the tier's callbacks (begin, fetch, put, commit) and the
state-facing interface checkpoints use share the per-array bookkeeping of `NvmeTier`; shards and
the multi-process rendezvous already live apart (`nvme_shards`, `nvme_rendezvous`).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import pathlib
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_offload._src import nvme
from optax_offload._src import nvme_rendezvous as rendezvous_lib
from optax_offload._src import nvme_shards as shards_lib
from optax_offload._src import plan as plan_lib
from optax_offload._src.nvme_shards import Key
from optax_offload._src.nvme_shards import Region

NvmeOptions = nvme.NvmeOptions

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)
_TOKEN = jax.ShapeDtypeStruct((3,), jnp.int32)
_EXIT_WAIT_S = 60.0
"""At exit, how long a tier waits for updates in flight (begun, not yet committed) before closing."""


def lookup(store_id: Any) -> NvmeTier:
  """The live `NvmeTier` a state names by its ``nvme_store`` id (see `NvmeTier.lookup`)."""
  return NvmeTier.lookup(store_id)


def process_directory(nvme_dir: str | os.PathLike) -> str:
  """This process's store directory under `nvme_dir` (one per process, as Orbax does)."""
  return os.path.join(os.path.abspath(os.fspath(nvme_dir)), f"process_{jax.process_index()}")


def placeholder(x: Any) -> jax.Array:
  """What the state holds in place of an NVMe array: an empty array of its dtype."""
  return jnp.zeros((0,), x.dtype)


@dataclasses.dataclass(frozen=True)
class _Slot:
  key: Key


@atexit.register
def _close_open_tiers() -> None:
  """Closes the tiers still open at interpreter exit, each once its updates in flight are committed.

  Runs before the stores' own exit hook (this module is imported after the store's) and before JAX's
  (imported first): an update whose program is still running at exit gets its commit queued, and
  the store then writes and commits everything queued.
  """
  for tier in sorted(NvmeTier._open.values(), key=lambda t: t.id, reverse=True):
    if not tier._rendezvous.wait_for_updates(_EXIT_WAIT_S):
      logger.warning(
        "NVMe store %s: updates still running %.0f s after exit began; closing at the last commit.",
        tier.directory,
        _EXIT_WAIT_S,
      )
    try:
      tier.close()
    except nvme.NvmeError as e:
      logger.error("NVMe store %s: error while closing at exit: %s", tier.directory, e)


class NvmeTier:
  """The NVMe-tier state arrays of one parameter tree, and their store.

  Lifetime: a tier registers itself under its `id` when it opens its store, and stays registered
  (its store open, its directory locked) until `close` (`oo.close_nvme`), even when the `offload`
  transformation that made it is gone: the states that name it stay usable. The registry is the one
  way to find a tier from a state (`lookup`): updates, `footprint`, `to_inner` and checkpoints all
  use it. At interpreter exit an open tier waits for updates in flight, then its store writes and
  commits what is queued (a state's last update is committed without `oo.sync_nvme`).

  The interface the rest of the package uses (checkpoints, `footprint`, `to_inner`): `keys`,
  `shape_dtype`, `replace_arrays`, `array_paths`, `bytes`, `directory`, `sync`, `pin`/`unpin`,
  `has_generation`, `stored_parts`, `write_generation`, `materialize` and `close`.

  Args:
    directory: the store's directory (this process's).
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

  layout: Any = None  # the `StateLayout` of the parameter tree, set by `offload`
  closed: bool = False
  _open: dict[int, NvmeTier] = {}  # the registry: open tiers by id

  def __init__(
    self,
    directory: str,
    units: Sequence[Sequence[plan_lib.Piece]],
    array_tiers: Sequence[Sequence[plan_lib.Tier]],
    parts: Sequence[Any],
    param_shapes: Sequence[tuple[int, ...]],
    shardings: Sequence[Any],
    options: nvme.NvmeOptions | None = None,
  ):
    units = [tuple(unit) for unit in units]
    self._arrays, self.mesh = shards_lib.stored_arrays(
      units, array_tiers, parts, param_shapes, shardings
    )
    self.part_defs = [jax.tree.structure(part) for part in parts]  # of each leaf's state part
    self._local_devices = [
      d for d in self.mesh.devices.flat if d.process_index == jax.process_index()
    ]
    self.groups, self._members = shards_lib.store_groups(units, self._arrays)
    specs = shards_lib.leaf_specs(self._members, self._arrays)
    self._names = [[spec.name for spec in group] for group in specs]
    self.store = nvme.NvmeStore(
      directory, specs, **dataclasses.asdict(nvme.NvmeOptions.of(options))
    )
    self._rendezvous = rendezvous_lib.Rendezvous(self.store, len(self._local_devices))
    # Generations this tier makes are newer than any on disk when it opened the store; a state
    # naming an older one was made by another store (closed, or in another process).
    self._first_generation = (
      max([self.store.committed_generation, *self.store.generations_on_disk]) + 1
    )
    self.id = next(_IDS)
    NvmeTier._open[self.id] = self

  # -- host side --------------------------------------------------------------------------------------

  def bytes(self) -> int:
    """Bytes of one generation in this process's store (its shards)."""
    return self.store.bytes_on_disk()

  def keys(self) -> list[tuple[int, int]]:
    """The NVMe arrays, as (leaf index, index of the array in the leaf's state part)."""
    return sorted(self._arrays)

  def shape_dtype(self, key: tuple[int, int]) -> tuple[tuple[int, ...], np.dtype]:
    """The global shape and dtype of an NVMe array."""
    a = self._arrays[key]
    return a.shape, a.dtype

  def sharding(self, key: tuple[int, int], memory_kind: str | None = None) -> NamedSharding:
    """The sharding of an NVMe array (its param's mesh)."""
    return NamedSharding(self.mesh, self._arrays[key].spec, memory_kind=memory_kind)

  def stored_parts(self, key: Key, generation: int) -> list[tuple[Region, pathlib.Path]]:
    """Where this process stores an NVMe array in a committed generation.

    Returns (region, zarr3 directory) of each shard, or of each row slice of each shard for a leaf
    updated in slices. The files are immutable, and stay on disk while the generation is the
    committed one, its parent, or pinned (`pin`).
    """
    a = self._arrays[key]
    return [
      (a.region(s, rows), self.store.leaf_path(generation, a.name(s, rows)))
      for s, rows in a.stored()
    ]

  def store_leaves(self, store_group: int) -> list[tuple[Key, Region]]:
    """The leaves of a store group, in store order: (NVMe array key, the region it holds)."""
    return [
      (key, self._arrays[key].region(s, rows))
      for key, rows in self._members[store_group]
      for s in self._arrays[key].local
    ]

  def replace_arrays(self, inner: Any, fn: Callable[[Key, Any], Any]) -> Any:
    """`inner` (a state's inner state) with each NVMe array's placeholder `x` replaced by
    ``fn(key, x)``; the params' containers may differ from those `init` saw (Flax NNX)."""
    layout = self.layout.matching(inner)
    shared, per_leaf = layout.split(inner)

    def replace(i, part):
      arrays, treedef = jax.tree.flatten(part)
      return treedef.unflatten(
        [fn((i, j), x) if (i, j) in self._arrays else x for j, x in enumerate(arrays)]
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
    """Whether `generation` is committed and still on disk, once queued commits are durable."""
    self.store.sync()
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
    """
    self.store.sync()
    generation = self.store.new_generation()
    for group in range(len(self._members)):
      self.store.put(group, generation, fill(self.store_leaves(group)))
    self.store.commit(generation)
    self.store.sync()
    return generation

  def write_group(self, plan_group: int, generation: int, parts: Mapping[int, Any]) -> None:
    """Queues one plan group's NVMe arrays of a generation (write-behind); `parts` by leaf index.

    The arrays are global `jax.Array`s (this process's shards are read) or numpy arrays: for a
    row slice of a leaf, the slice's rows (or the whole leaf's array, whose rows are taken), else
    the whole array.
    """
    sg = self.groups[plan_group]
    arrays = []
    for (key, rows), x in zip(self._members[sg], _select(parts, [k for k, _ in self._members[sg]])):
      a = self._arrays[key]
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
    stored = self.store.read_generation(int(np.asarray(generation)))
    arrays = {}
    for key, a in self._arrays.items():
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

  def _check_updatable(self, generation: int) -> None:
    """Raises when an update from a state naming `generation` cannot run on this tier."""
    if self.closed:
      raise RuntimeError(
        f"offload: the NVMe store {self.store.directory} of this optimizer state was closed "
        "(oo.close_nvme), so the state can no longer be updated. Create a new state with "
        "tx.init(params), or restore a checkpoint into one (oo.OffloadRestore)."
      )
    if generation < self._first_generation:
      raise RuntimeError(
        f"offload: this optimizer state names NVMe generation {generation}, which the store "
        f"{self.store.directory} did not make since it was opened (its generations start at "
        f"{self._first_generation}): the state comes from a store that was closed (oo.close_nvme) "
        "or from another process. Create a new state with tx.init(params), or restore a "
        "checkpoint into one (oo.OffloadRestore)."
      )

  def close(self) -> None:
    """Waits for queued writes, closes the store (its threads and lock) and unregisters. Idempotent."""
    self.closed = True
    NvmeTier._open.pop(self.id, None)
    self.store.close()

  @classmethod
  def lookup(cls, store_id: Any) -> NvmeTier:
    """The open tier a state names by its ``nvme_store`` id.

    Raises:
      RuntimeError: no open tier has that id (closed, or made in another process).
    """
    key = int(np.asarray(store_id))
    tier = cls._open.get(key)
    if tier is None:
      raise RuntimeError(
        f"The NVMe store {key} named by this state is closed or belongs to another process. "
        "Create the state with tx.init(params) of the offload transformation that owns the nvme_dir "
        "(restore checkpoints into such a state)."
      )
    return tier

  def _signature(self) -> tuple[Any, ...]:
    return (self.mesh, self._members, self._arrays)

  def _resolve(self, store_id: int) -> NvmeTier:
    """The tier a state names by its store id, for a program traced with this one.

    A jitted update keeps the tier it was traced with; a state made by ``tx.init`` after
    `close_nvme` names a new tier of the same layout, which the program then uses instead.
    """
    tier = NvmeTier._open.get(store_id)
    if tier is None and store_id == self.id:
      return self  # closed: `_check_updatable` says so
    if tier is None:
      raise RuntimeError(
        f"offload: the NVMe store {store_id} named by this optimizer state is closed "
        "(oo.close_nvme) or belongs to another process, so the state can no longer be updated. "
        "Create a new state with tx.init(params), or restore a checkpoint into one "
        "(oo.OffloadRestore)."
      )
    if tier is not self and tier._signature() != self._signature():
      raise ValueError(
        f"offload: this optimizer state's NVMe store {tier.store.directory} holds another layout "
        f"than the store {self.store.directory} this update was traced with: the state was made "
        "by another offload transformation or for other params. Update it with the "
        "transformation whose tx.init made it."
      )
    return tier

  # -- traced side (inside jit) -----------------------------------------------------------------------
  # Each callback runs on every device of the mesh (`jax.shard_map`) and takes and returns a token,
  # ``[parent, child, store]``: the generation the state names, the one this update writes, and the
  # id of the tier whose store holds them, so that the callbacks run in program order through data
  # dependencies. (Ordered io_callbacks would do the same, but JAX 0.10 fails to lower them in a jit
  # whose outputs carry memory kinds.) The child is a fresh generation number, not ``parent + 1``:
  # an update may start again from the same state (`optax.MultiSteps` computes every mini-step from
  # the state of the last real step).

  def _device(self, position: Any) -> int:
    return self.mesh.devices[tuple(int(v) for v in np.asarray(position))].id

  def _shard_local(self, callback, result_shapes, out_specs, *args, in_specs):
    """Runs ``callback(device_id, *local_args)`` as an io_callback on every device of the mesh."""
    mesh = self.mesh
    if mesh.size == 1:
      # No shard_map over a mesh of one device: values computed from its outputs would carry the
      # mesh in their types (``f32[..]({Auto: ('nvme_device',)})``), so each step's outputs would
      # differ in type from its inputs and a jitted step would compile again, twice.
      (device,) = mesh.devices.flat
      return io_callback(
        lambda *xs: callback(device.id, *[np.asarray(x) for x in xs]), result_shapes, *args
      )

    def body(*local):
      position = jnp.stack([jax.lax.axis_index(a) for a in mesh.axis_names]).astype(jnp.int32)
      return io_callback(
        # numpy views, not jax.Arrays: indexing a jax.Array here would dispatch a computation to the
        # device that is running this callback, and deadlock.
        lambda pos, *xs: callback(self._device(pos), *[np.asarray(x) for x in xs]),
        result_shapes,
        position,
        *local,
      )

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      *args
    )

  def begin_traced(self, generation: jax.Array, store: jax.Array | None = None) -> jax.Array:
    """Allocates the generation this update writes; returns the token.

    Args:
      generation: the generation the state names (``OffloadState.nvme_generation``).
      store: the store id the state names (``OffloadState.nvme_store``); the update then runs on
        that tier (of this tier's layout). None: this tier.

    When the program runs, its first callback raises a `RuntimeError` when the state's store is
    closed or the state comes from another store, and a `ValueError` when the state is stale (see
    `nvme.NvmeStore.new_generation`), before the update touches the store.
    """
    if store is None:
      store = jnp.asarray(self.id, jnp.int32)

    def _begin(device, parent, store):
      tier = self._resolve(int(store))
      tier._check_updatable(int(parent))
      try:
        child = tier._rendezvous.begin(device, int(parent))
      except nvme.StaleGenerationError as e:
        raise ValueError(
          f"offload: this optimizer state is stale: it names NVMe generation {int(parent)}, but "
          f"updates have moved on from it ({e}). Update the state the latest update returned (it "
          "is unaffected by this error), or restore a checkpoint into it with oo.OffloadRestore. "
          "An update may start only from the latest state or the one it was made from (as "
          "optax.MultiSteps does)."
        ) from None
      return np.asarray([parent, child, store], np.int32)

    return self._shard_local(_begin, _TOKEN, P(), generation, store, in_specs=(P(), P()))

  def fetch(
    self, plan_group: int, token: jax.Array
  ) -> tuple[dict[tuple[int, int], Any], jax.Array]:
    """The group's NVMe arrays of the parent generation (global, sharded like their params).

    For a row slice of a leaf, each array holds the slice's rows (its leading axis is the
    slice's); for a whole leaf, the whole array.
    """
    sg = self.groups[plan_group]
    members = [(self._arrays[key], rows) for key, rows in self._members[sg]]
    shapes = [jax.ShapeDtypeStruct(a.shard_shape(rows), a.dtype) for a, rows in members]

    def _fetch(device, token):
      tier = self._resolve(int(token[2]))
      arrays = tier._rendezvous.fetch(device, sg, int(token[0]), self._names[sg])
      return [
        np.asarray(token),
        *[np.asarray(arrays[a.name(a.number[device], rows)]) for a, rows in members],
      ]

    out_specs = [P(), *[a.spec for a, _ in members]]
    token, *flat = self._shard_local(_fetch, [_TOKEN, *shapes], out_specs, token, in_specs=(P(),))
    return dict(zip([key for key, _ in self._members[sg]], flat)), token

  def put(self, plan_group: int, token: jax.Array, parts: Mapping[int, Any]) -> jax.Array:
    """Hands the group's new arrays (of the child generation) to the writer thread.

    `parts` holds, by leaf index, the state parts of the group's leaves, shaped as `fetch` returns
    them: a row slice's rows, or a whole leaf's arrays.
    """
    sg = self.groups[plan_group]
    members = [(self._arrays[key], rows) for key, rows in self._members[sg]]

    def _put(device, token, *shards):
      arrays = {a.name(a.number[device], rows): x for (a, rows), x in zip(members, shards)}
      tier = self._resolve(int(token[2]))
      tier._rendezvous.put(device, sg, int(token[1]), arrays, self._names[sg])
      return np.asarray(token)

    flat = _select(parts, [key for key, _ in self._members[sg]])
    for (a, rows), x in zip(members, flat):
      want = a.shape if rows is None else (rows[1] - rows[0], *a.shape[1:])
      if tuple(jnp.shape(x)) != want:
        raise ValueError(
          f"NvmeTier.put: NVMe array {a.key} of plan group {plan_group} has shape "
          f"{tuple(jnp.shape(x))}, expected {want} (rows {rows})."
        )
    return self._shard_local(
      _put, _TOKEN, P(), token, *flat, in_specs=(P(), *[a.spec for a, _ in members])
    )

  def commit_traced(self, token: jax.Array) -> jax.Array:
    """Commits the child generation (once every device put its shards); returns its number."""

    def _commit(device, token):
      self._resolve(int(token[2]))._rendezvous.commit(device, int(token[1]), int(token[0]))
      return np.asarray(token[1], np.int32)

    return self._shard_local(
      _commit, jax.ShapeDtypeStruct((), jnp.int32), P(), token, in_specs=(P(),)
    )


def _select(parts: Mapping[int, Any], keys: Sequence[tuple[int, int]]) -> list[Any]:
  flat = {i: jax.tree.leaves(parts[i]) for i in {i for i, _ in keys}}
  return [flat[i][j] for i, j in keys]


def _insert(i: int, part: Any, arrays: Mapping[tuple[int, int], Any]) -> Any:
  leaves, treedef = jax.tree.flatten(part)
  return treedef.unflatten([arrays.get((i, j), x) for j, x in enumerate(leaves)])
