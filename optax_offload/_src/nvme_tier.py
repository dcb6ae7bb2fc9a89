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
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import pathlib
import threading
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
from optax_offload._src import plan as plan_lib

NvmeOptions = nvme.NvmeOptions

logger = logging.getLogger(__name__)

# Open tiers by id. A tier stays here (and its store open) until `close`, even when the `offload`
# transformation that made it is gone: the states that name it stay usable.
_REGISTRY: dict[int, NvmeTier] = {}
_IDS = itertools.count(1)
_TOKEN = jax.ShapeDtypeStruct((3,), jnp.int32)
_SINGLE_AXIS = "nvme_device"


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


Region = tuple[tuple[int, int], ...]
"""A box of an array: (start, stop) per dimension."""

Rows = tuple[int, int] | None
"""The rows ``[start, stop)`` of a row slice of a leaf, or None for the whole leaf."""


def shard_regions(
  sharding: jax.sharding.Sharding, shape: Sequence[int]
) -> tuple[list[Region], dict[int, int]]:
  """The distinct shards of an array (sorted by offsets) and each device's shard number, by device id."""
  shape = tuple(shape)

  def region(index) -> Region:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))

  by_device = {d.id: region(i) for d, i in sharding.devices_indices_map(shape).items()}
  regions = sorted(set(by_device.values()))
  number = {r: n for n, r in enumerate(regions)}
  return regions, {d: number[r] for d, r in by_device.items()}


def _mesh_and_spec(sharding: Any, part_shape, param_shape) -> tuple[jax.sharding.Mesh, P]:
  """Where an NVMe array lives: its param's mesh and spec (replicated when shaped otherwise)."""
  if isinstance(sharding, NamedSharding):
    spec = sharding.spec if tuple(part_shape) == tuple(param_shape) else P()
    return sharding.mesh, spec
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    device = jax.local_devices()[0] if sharding is None else next(iter(sharding.device_set))
    return jax.sharding.Mesh(np.array([device]), (_SINGLE_AXIS,)), P()
  raise NotImplementedError(
    f"The NVMe tier needs params with a NamedSharding (or on one device), got {sharding}. Put the "
    "params on a jax.sharding.Mesh with NamedSharding."
  )


def _check_sliceable(
  key: tuple[int, int],
  shape: Sequence[int],
  param_shape: Sequence[int],
  regions: Sequence[Region],
  pieces: Sequence[tuple[int, int]],
) -> None:
  """Raises unless the row slices `pieces` tile the rows of every shard of an NVMe array."""
  rows = param_shape[0] if len(param_shape) else 0
  problem = None
  if not len(shape) or shape[0] != rows:
    problem = f"its shape {tuple(shape)} does not follow the param's rows ({rows})"
  elif any(region[0] != (0, rows) for region in regions):
    problem = "its leading axis is sharded"
  elif [a for a, _ in pieces] != [0, *[b for _, b in pieces[:-1]]] or pieces[-1][1] != rows:
    problem = f"the slices {list(pieces)} do not tile its {rows} rows"
  if problem:
    raise ValueError(
      f"NvmeTier: leaf {key[0]} is updated in row slices, but its NVMe array {key[1]} cannot be "
      f"stored in them: {problem}. Keep the leaf whole (a larger window_bytes) or off NVMe."
    )


@dataclasses.dataclass(frozen=True)
class _Array:
  """One NVMe-tier array: its place in the state, its sharding, and the shards this process stores."""

  key: tuple[int, int]  # (leaf index, index of the array in the leaf's state part)
  shape: tuple[int, ...]
  dtype: np.dtype
  spec: P
  regions: list[Region]  # all distinct shards
  number: dict[int, int]  # device id -> shard number
  local: list[int]  # the shard numbers this process stores
  pieces: tuple[Rows, ...] = (None,)  # the row slices stored apart, in row order; (None,): whole

  def name(self, shard: int, rows: Rows = None) -> str:
    i, j = self.key
    name = f"leaf{i:05d}_part{j}_shard{shard:04d}"
    return name if rows is None else f"{name}_rows{rows[0]:06d}-{rows[1]:06d}"

  def region(self, shard: int, rows: Rows = None) -> Region:
    """The box of the array that a shard's rows `rows` cover (the whole shard for None)."""
    region = self.regions[shard]
    return region if rows is None else (tuple(rows), *region[1:])

  def shard_shape(self, rows: Rows = None) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.region(self.local[0], rows))

  def stored(self) -> list[tuple[int, Rows]]:
    """(shard, rows) of every store leaf of this array that this process holds."""
    return [(s, rows) for s in self.local for rows in self.pieces]


class _Rendezvous:
  """Joins the callbacks of this process's devices into one store operation each.

  Every device of the mesh runs each callback of the update with its own shards. The first device
  to fetch a group reads it (from the prefetch pool) for all; the last device to put a group hands
  the group to the store; the last to commit commits; the generation an update writes is allocated
  once per update. A device that runs ahead waits for the others' puts before it reads what they
  put. A failure in one device's callback is re-raised in the others'.
  """

  def __init__(self, store: nvme.NvmeStore, devices: int):
    self.store, self.devices = store, devices
    self._cond = threading.Condition()
    self._begins: collections.Counter[int] = collections.Counter()  # device -> updates begun
    self._children: dict[int, list[Any]] = {}  # update number -> [generation, devices left]
    self._fetch_counts: collections.Counter[tuple[int, int]] = collections.Counter()
    self._fetched: dict[
      tuple[int, int], list[Any]
    ] = {}  # (group, n) -> [arrays by name, devices left]
    self._puts: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    self._putting: set[tuple[int, int]] = set()
    self._commits: collections.Counter[int] = collections.Counter()
    self._error: BaseException | None = None

  def _check(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"NVMe tier: another device's callback failed: {self._error}")

  def _fail(self, error: BaseException) -> None:
    with self._cond:
      self._error = self._error or error
      self._cond.notify_all()

  def begin(self, device: int, parent: int) -> int:
    with self._cond:
      self._check()
      n = self._begins[device]
      if n not in self._children:
        # Raises for a stale parent before anything is counted: every device refuses alike, and
        # the next update starts afresh.
        self._children[n] = [self.store.new_generation(parent=parent), self.devices]
      self._begins[device] += 1
      entry = self._children[n]
      entry[1] -= 1
      if entry[1] == 0:
        del self._children[n]
      return entry[0]

  def fetch(self, device: int, group: int, generation: int, names: Sequence[str]) -> dict[str, Any]:
    key = (group, generation)
    with self._cond:
      # The n-th fetch of a group by each device is one store fetch (an update fetches each once).
      n = self._fetch_counts[(device, group)]
      self._fetch_counts[(device, group)] += 1
      while True:
        self._check()
        entry = self._fetched.get((group, n))
        if entry is not None:
          reader = False
          break
        if key not in self._puts and key not in self._putting:  # wait for what others still put
          entry = self._fetched[(group, n)] = [None, self.devices]
          reader = True
          break
        self._cond.wait()
      while not reader and entry[0] is None:
        self._cond.wait()
        self._check()
    if reader:
      try:
        arrays = self.store.fetch(group, generation)
      except BaseException as e:
        self._fail(e)
        raise
      with self._cond:
        entry[0] = dict(zip(names, arrays))
        self._cond.notify_all()
    with self._cond:
      entry[1] -= 1
      if entry[1] == 0:
        del self._fetched[(group, n)]
      return entry[0]

  def put(self, device: int, group: int, generation: int, arrays: dict[str, Any], names) -> None:
    key = (group, generation)
    with self._cond:
      self._check()
      puts = self._puts.setdefault(key, {})
      puts[device] = arrays
      if len(puts) < self.devices:
        return
      del self._puts[key]
      self._putting.add(key)
    merged: dict[str, Any] = {}
    for arrays_of_device in puts.values():
      for name, array in arrays_of_device.items():
        merged.setdefault(name, array)
    try:
      self.store.put(group, generation, [merged[name] for name in names])
    except BaseException as e:
      self._fail(e)
      raise
    finally:
      with self._cond:
        self._putting.discard(key)
        self._cond.notify_all()

  def commit(self, device: int, generation: int, parent: int) -> None:
    with self._cond:
      self._check()
      self._commits[generation] += 1
      if self._commits[generation] < self.devices:
        return
      del self._commits[generation]
    try:
      self.store.commit(generation, parent=parent)
    except BaseException as e:
      self._fail(e)
      raise


class NvmeTier:
  """The NVMe-tier state arrays of one parameter tree, and their store.

  Args:
    directory: the store's directory (this process's).
    units: the plan's groups (`plan.Plan.units`): tuples of `plan.Piece`s, whole leaves or row
      slices. The NVMe arrays of a sliced leaf are stored slice by slice, each slice in the store
      group of the plan group that holds it.
    array_tiers: per leaf, the tier of each array of its state part (in `jax.tree.leaves` order).
    parts: abstract state parts per leaf (`jax.ShapeDtypeStruct` trees).
    param_shapes: per leaf, the param's shape.
    shardings: per leaf, the param's sharding (None: the first local device).
    options: the store's options (`nvme.NvmeOptions`); None: the defaults.

  Raises:
    NotImplementedError: params whose state goes to NVMe are on different meshes.
    ValueError: a sliced leaf has an NVMe array that does not follow its rows, or whose leading
      axis is sharded.
  """

  layout: Any = None  # the `StateLayout` of the parameter tree, set by `offload`
  closed: bool = False

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
    slices: dict[int, list[tuple[int, int]]] = {}  # sliced leaf -> its row slices
    for unit in units:
      for piece in unit:
        if not isinstance(piece, plan_lib.Piece):
          raise TypeError(f"NvmeTier needs the plan's units (tuples of Piece), got {piece!r}.")
        if not piece.whole:
          slices.setdefault(piece.leaf, []).append((piece.start, piece.stop))
    self._arrays: dict[tuple[int, int], _Array] = {}
    self.part_defs = [jax.tree.structure(part) for part in parts]  # of each leaf's state part
    meshes = {}
    for i, kinds in enumerate(array_tiers):
      for j, x in enumerate(jax.tree.leaves(parts[i])):
        if kinds[j] is not plan_lib.Tier.NVME:
          continue
        mesh, spec = _mesh_and_spec(shardings[i], x.shape, param_shapes[i])
        meshes.setdefault(mesh, (i, shardings[i]))
        regions, number = shard_regions(NamedSharding(mesh, spec), x.shape)
        local = sorted(
          {number[d.id] for d in mesh.devices.flat if d.process_index == jax.process_index()}
        )
        pieces: tuple[Rows, ...] = (None,)
        if i in slices:
          pieces = tuple(sorted(slices[i]))
          _check_sliceable((i, j), x.shape, param_shapes[i], regions, pieces)
        self._arrays[(i, j)] = _Array(
          (i, j), tuple(x.shape), np.dtype(x.dtype), spec, regions, number, local, pieces
        )
    if len(meshes) > 1:
      raise NotImplementedError(
        "The NVMe tier needs every param whose state goes to NVMe on one mesh; got "
        f"{len(meshes)}: "
        + "; ".join(f"leaf {i}: {sh}" for i, sh in meshes.values())
        + ". Put the params on one jax.sharding.Mesh (NamedSharding), or raise host_limit."
      )
    (self.mesh,) = meshes
    self._local_devices = [
      d for d in self.mesh.devices.flat if d.process_index == jax.process_index()
    ]
    # Store groups: the plan's groups restricted to NVMe arrays, in update order. Each holds, for
    # every piece of the group and every NVMe array of the piece's leaf, the piece's rows of the
    # shards this process stores (a whole leaf's: its shards).
    self.groups: dict[int, int] = {}
    self._members: list[list[tuple[tuple[int, int], Rows]]] = []
    for k, unit in enumerate(units):
      leaves = [p.leaf for p in unit]
      if len(set(leaves)) != len(leaves):
        raise ValueError(f"NvmeTier: plan group {k} holds a leaf twice: {unit}.")
      members = [
        (key, None if piece.whole else (piece.start, piece.stop))
        for piece in unit
        for key in sorted(self._arrays)
        if key[0] == piece.leaf
      ]
      if members:
        self.groups[k] = len(self._members)
        self._members.append(members)
    specs = [
      [
        nvme.LeafSpec(a.name(s, rows), a.shard_shape(rows), a.dtype)
        for key, rows in members
        for a in [self._arrays[key]]
        for s in a.local
      ]
      for members in self._members
    ]
    self._names = [[spec.name for spec in group] for group in specs]
    self.store = nvme.NvmeStore(
      directory, specs, **dataclasses.asdict(nvme.NvmeOptions.of(options))
    )
    self._rendezvous = _Rendezvous(self.store, len(self._local_devices))
    # Generations this tier makes are newer than any on disk when it opened the store; a state
    # naming an older one was made by another store (closed, or in another process).
    self._first_generation = (
      max([self.store.committed_generation, *self.store.generations_on_disk]) + 1
    )
    self.id = next(_IDS)
    _REGISTRY[self.id] = self

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

  def local_shards(
    self, key: tuple[int, int], generation: int
  ) -> list[tuple[Region, pathlib.Path]]:
    """This process's stored parts of an NVMe array in a committed generation: (region, zarr3
    directory) of each shard, or of each row slice of each shard for a leaf updated in slices."""
    a = self._arrays[key]
    gen = self.store.generation_path(generation)
    return [
      (a.region(s, rows), gen / nvme._leaf_dirname(a.name(s, rows))) for s, rows in a.stored()
    ]

  def store_leaves(self, store_group: int) -> list[tuple[tuple[int, int], Region]]:
    """The leaves of a store group, in store order: (NVMe array key, the region it holds)."""
    return [
      (key, self._arrays[key].region(s, rows))
      for key, rows in self._members[store_group]
      for s in self._arrays[key].local
    ]

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
    self.closed = True
    self.store.close()
    _REGISTRY.pop(self.id, None)

  def _signature(self) -> tuple[Any, ...]:
    return (self.mesh, self._members, self._arrays)

  def _resolve(self, store_id: int) -> NvmeTier:
    """The tier a state names by its store id, for a program traced with this one.

    A jitted update keeps the tier it was traced with; a state made by ``tx.init`` after
    `close_nvme` names a new tier of the same layout, which the program then uses instead.
    """
    if store_id == self.id:
      return self
    tier = _REGISTRY.get(store_id)
    if tier is None:
      raise RuntimeError(
        f"offload: the NVMe store {store_id} named by this optimizer state is closed "
        "(oo.close_nvme) or belongs to another process, so the state can no longer be updated. "
        "Create a new state with tx.init(params), or restore a checkpoint into one "
        "(oo.OffloadRestore)."
      )
    if tier._signature() != self._signature():
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
