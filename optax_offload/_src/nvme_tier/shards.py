"""Which parts of each NVMe array this process stores, and under which names.

An NVMe array keeps its param's sharding (a ``NamedSharding`` over one mesh; params on one device
form a one-device mesh). Each process stores the distinct shards its devices hold, once each, as
store leaves ``leaf{i}_part{j}_shard{s}`` (``s`` numbers the array's distinct shards in the order
of their offsets), and for a leaf the plan updates in row slices, each slice's rows of each shard
apart, as ``leaf{i}_part{j}_shard{s}_rows{start}-{stop}``, in the store group of the plan group
that updates the slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_offload._src import nvme
from optax_offload._src import plan as plan_lib

SINGLE_AXIS = "nvme_device"
"""The axis name of the one-device mesh of params on one device."""

Region = tuple[tuple[int, int], ...]
"""A box of an array: (start, stop) per dimension."""

Rows = tuple[int, int] | None
"""The rows ``[start, stop)`` of a row slice of a leaf, or None for the whole leaf."""

Key = tuple[int, int]
"""An NVMe array: (leaf index, index of the array in the leaf's state part)."""


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


def mesh_and_spec(sharding: Any, part_shape, param_shape) -> tuple[jax.sharding.Mesh, P]:
  """Where an NVMe array lives: its param's mesh and spec (replicated when shaped otherwise)."""
  if isinstance(sharding, NamedSharding):
    spec = sharding.spec if tuple(part_shape) == tuple(param_shape) else P()
    return sharding.mesh, spec
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    device = jax.local_devices()[0] if sharding is None else next(iter(sharding.device_set))
    return jax.sharding.Mesh(np.array([device]), (SINGLE_AXIS,)), P()
  raise NotImplementedError(
    f"The NVMe tier needs params with a NamedSharding (or on one device), got {sharding}. Put the "
    "params on a jax.sharding.Mesh with NamedSharding."
  )


def check_sliceable(
  key: Key,
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
class StoredArray:
  """One NVMe-tier array: its place in the state, its sharding, and the shards this process stores."""

  key: Key
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


def stored_arrays(
  units: Sequence[Sequence[plan_lib.Piece]],
  array_tiers: Sequence[Sequence[plan_lib.Tier]],
  parts: Sequence[Any],
  param_shapes: Sequence[tuple[int, ...]],
  shardings: Sequence[Any],
) -> tuple[dict[Key, StoredArray], jax.sharding.Mesh]:
  """Every NVMe array of a parameter tree, with the shards (and row slices) this process stores.

  Raises:
    TypeError: `units` are not the plan's (tuples of `plan.Piece`).
    NotImplementedError: params whose state goes to NVMe are on different meshes.
    ValueError: a sliced leaf has an NVMe array that does not follow its rows, or whose leading
      axis is sharded.
  """
  slices: dict[int, list[tuple[int, int]]] = {}  # sliced leaf -> its row slices
  for unit in units:
    for piece in unit:
      if not isinstance(piece, plan_lib.Piece):
        raise TypeError(f"NvmeTier needs the plan's units (tuples of Piece), got {piece!r}.")
      if not piece.whole:
        slices.setdefault(piece.leaf, []).append((piece.start, piece.stop))
  arrays: dict[Key, StoredArray] = {}
  meshes = {}
  for i, kinds in enumerate(array_tiers):
    for j, x in enumerate(jax.tree.leaves(parts[i])):
      if kinds[j] is not plan_lib.Tier.NVME:
        continue
      mesh, spec = mesh_and_spec(shardings[i], x.shape, param_shapes[i])
      meshes.setdefault(mesh, (i, shardings[i]))
      regions, number = shard_regions(NamedSharding(mesh, spec), x.shape)
      local = sorted(
        {number[d.id] for d in mesh.devices.flat if d.process_index == jax.process_index()}
      )
      pieces: tuple[Rows, ...] = (None,)
      if i in slices:
        pieces = tuple(sorted(slices[i]))
        check_sliceable((i, j), x.shape, param_shapes[i], regions, pieces)
      arrays[(i, j)] = StoredArray(
        (i, j), tuple(x.shape), np.dtype(x.dtype), spec, regions, number, local, pieces
      )
  if len(meshes) > 1:
    raise NotImplementedError(
      "The NVMe tier needs every param whose state goes to NVMe on one mesh; got "
      f"{len(meshes)}: "
      + "; ".join(f"leaf {i}: {sh}" for i, sh in meshes.values())
      + ". Put the params on one jax.sharding.Mesh (NamedSharding), or raise host_limit."
    )
  (mesh,) = meshes
  return arrays, mesh


def store_groups(
  units: Sequence[Sequence[plan_lib.Piece]], arrays: Mapping[Key, StoredArray]
) -> tuple[dict[int, int], list[list[tuple[Key, Rows]]]]:
  """The store's groups: the plan's groups restricted to NVMe arrays, in update order.

  Each holds, for every piece of the plan group and every NVMe array of the piece's leaf, the
  piece's rows (None: a whole leaf). Returns the store group of each plan group that has one, and
  each store group's members.
  """
  groups: dict[int, int] = {}
  members_of: list[list[tuple[Key, Rows]]] = []
  for k, unit in enumerate(units):
    leaves = [p.leaf for p in unit]
    if len(set(leaves)) != len(leaves):
      raise ValueError(f"NvmeTier: plan group {k} holds a leaf twice: {unit}.")
    members = [
      (key, None if piece.whole else (piece.start, piece.stop))
      for piece in unit
      for key in sorted(arrays)
      if key[0] == piece.leaf
    ]
    if members:
      groups[k] = len(members_of)
      members_of.append(members)
  return groups, members_of


def leaf_specs(
  members_of: Sequence[Sequence[tuple[Key, Rows]]], arrays: Mapping[Key, StoredArray]
) -> list[list[nvme.LeafSpec]]:
  """The store's leaves, by store group: each member's rows of each shard this process stores."""
  return [
    [
      nvme.LeafSpec(a.name(s, rows), a.shard_shape(rows), a.dtype)
      for key, rows in members
      for a in [arrays[key]]
      for s in a.local
    ]
    for members in members_of
  ]


def select(parts: Mapping[int, Any], keys: Sequence[Key]) -> list[Any]:
  """The arrays `keys` name, taken from state parts by leaf index (`jax.tree.leaves` order)."""
  flat = {i: jax.tree.leaves(parts[i]) for i in {i for i, _ in keys}}
  return [flat[i][j] for i, j in keys]
