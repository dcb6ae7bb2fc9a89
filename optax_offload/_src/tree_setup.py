"""Planning `offload` for one parameter tree: tiers, groups, row slices, chunks and placements.

`make_setup` derives everything `offload` needs from the params' shapes, dtypes and shardings:
the placement plan (`plan.make_plan`), where each state array rests (`array_tiers`), the stream
spec the update runs (`stream.StreamSpec`), and the NVMe tier when state goes to disk. Pure apart
from opening that tier. `state_shardings` says where each array of the state lives.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import layout as layout_lib
from optax_offload._src import memory
from optax_offload._src import nvme
from optax_offload._src import nvme_tier
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src import stream
from optax_offload._src.units import format_bytes

logger = logging.getLogger("optax_offload._src.offload")  # the plan is logged as offload's

MANY_GROUPS = 96
"""Above this many groups `make_setup` warns about XLA:GPU compile time."""


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything `offload` derives from one parameter tree at init: the plan and its resources."""

  paths: tuple[str, ...]
  param_shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  leaves: tuple[plan_lib.LeafInfo, ...]
  plan: plan_lib.Plan
  part_shapes: tuple[list[tuple[int, ...]], ...]  # shapes of each leaf's state arrays
  array_tiers: tuple[tuple[plan_lib.Tier, ...], ...]  # tier of each leaf's state arrays
  spec: stream.StreamSpec
  layout: layout_lib.StateLayout  # of the tree init saw
  nvme: nvme_tier.NvmeTier | None

  @functools.cached_property
  def callbacks(self) -> nvme_tier.TracedTier | None:
    """The NVMe tier's side of the update (its jit callbacks), or None without a tier."""
    return None if self.nvme is None else nvme_tier.TracedTier(self.nvme)

  def handles(self, generation: int) -> tuple[jax.Array, jax.Array]:
    store = -1 if self.nvme is None else self.nvme.id
    return jnp.asarray(store, jnp.int32), jnp.asarray(generation, jnp.int32)

  @property
  def usable(self) -> bool:
    return self.nvme is None or not self.nvme.closed


def default_window_bytes() -> int:
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # some backends do not implement memory_stats
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"] * plan_lib.DEFAULT_WINDOW_FRACTION)
  return plan_lib.FALLBACK_WINDOW_BYTES


def _state_bytes(part: Any, shape: tuple[int, ...], sharding: Any) -> int:
  """Bytes per device of one leaf's state parts; parts shaped like the param share its sharding."""
  total = 0
  for x in jax.tree.leaves(part):
    shard = x.shape
    if sharding is not None and tuple(x.shape) == tuple(shape):
      shard = sharding.shard_shape(tuple(shape))
    total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
  return total


def _moving_bytes(aval: Any, sharding: Any) -> int:
  """Bytes a param and its gradient add to the window when they live in host memory."""
  if not memory.is_pinned_host(sharding):
    return 0
  return 2 * _state_bytes(aval, aval.shape, sharding)


def _local_device_count(sharding: Any) -> int:
  """How many of this process's devices hold a shard (or a copy) of an array with `sharding`."""
  if sharding is None:
    return 1
  return sum(d.process_index == jax.process_index() for d in sharding.device_set)


def host_sharding(sharding: Any, part_shape: tuple[int, ...], param_shape: tuple[int, ...]):
  """Sharding of an offloaded state part: the param's, in pinned host memory.

  The state keeps the kind of sharding its params have (a one-device param's state a
  SingleDeviceSharding), so that a jitted step's outputs have its inputs' shardings and the step
  compiles once.
  """
  if tuple(part_shape) != tuple(param_shape) and isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return sharding.with_memory_kind("pinned_host")


def map_arrays(part: Any, tiers: Sequence[plan_lib.Tier], fn) -> Any:
  """Applies ``fn(tier, j, array)`` to each array of a leaf's state part."""
  arrays, treedef = jax.tree.flatten(part)
  return treedef.unflatten([fn(t, j, x) for j, (t, x) in enumerate(zip(tiers, arrays))])


def _array_tiers(part: Any, tier: plan_lib.Tier, min_size: int) -> tuple[plan_lib.Tier, ...]:
  """The leaf's tier for each of its state arrays, but arrays below `min_size` stay on device.

  Besides saving transfers of tiny arrays (e.g. adafactor's (1,) placeholders), this keeps
  JAX's donation matching right: it pairs donated inputs to outputs by shape and dtype, ignoring
  memory kinds, so a tiny host array and a tiny device array of the same shape could be swapped.
  """
  return tuple(
    tier if math.prod(x.shape) >= min_size else plan_lib.Tier.DEVICE for x in jax.tree.leaves(part)
  )


def _unsharded_axes(sharding: Any) -> int:
  """How many leading axes of a param are not sharded (at most 2)."""
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return 2
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None, None)
    return 0 if spec[0] is not None else (1 if spec[1] is not None else 2)
  return 0


CHUNKS = 4
"""Row chunks of a group's update: at least two, so that every copy can overlap an update (XLA:GPU
keeps two copies in flight) and the update is written in place; more make the chunk's own results
(temporaries outside the window) smaller."""


def _chunks(unit, leaves, array_tiers, cols, n_units: int) -> tuple[tuple[int, int], ...]:
  """``(axis, count)`` per piece: enough updates per group for every copy to overlap one (XLA:GPU
  keeps two copies in flight) and the update in place; rows when the piece has enough, else columns;
  one chunk when the plan has one group or the leaf cannot split.
  """
  out = []
  for piece in unit:
    leaf = leaves[piece.leaf]
    offloaded = any(t is not plan_lib.Tier.DEVICE for t in array_tiers[piece.leaf])
    rows = leaf.rows if piece.whole else piece.stop - piece.start
    if n_units < 2 or not offloaded:
      out.append((0, 1))
    elif leaf.rows and rows >= CHUNKS:
      out.append((0, CHUNKS))
    elif cols[piece.leaf] >= CHUNKS:
      out.append((1, CHUNKS))
    elif leaf.rows and rows >= 2:
      out.append((0, rows))
    else:
      out.append((0, 1))
  return tuple(out)


def make_setup(
  inner: optax.GradientTransformationExtraArgs,
  treedef: Any,
  paths: Sequence[str],
  avals: Sequence[jax.ShapeDtypeStruct],
  shardings: Sequence[Any],
  *,
  min_size: int,
  window_bytes: int | None,
  host_limit: int | None,
  nvme_dir: Any = None,
  nvme_options: nvme.NvmeOptions | None = None,
  check_separable: bool = True,
) -> Setup:
  """Plans one parameter tree: tiers, groups, row slices and chunks; opens the NVMe store if used."""
  layout = layout_lib.StateLayout(inner, treedef)
  abstract_state = jax.eval_shape(inner.init, treedef.unflatten(list(avals)))
  _, per_leaf = layout.split(abstract_state)
  if check_separable:
    separable.check_separable(inner, layout, paths, avals)
  dims = tuple(separable.shared_dims(part, a.shape) for part, a in zip(per_leaf, avals))
  unsharded = [_unsharded_axes(s) for s in shardings]
  rows = separable.splittable(inner, avals, per_leaf, dims, min_size, axis=0)
  cols = separable.splittable(inner, avals, per_leaf, dims, min_size, axis=1)
  rows = [n if u >= 1 else 0 for n, u in zip(rows, unsharded)]
  cols = [n if u >= 2 else 0 for n, u in zip(cols, unsharded)]
  leaves = tuple(
    plan_lib.LeafInfo(
      p,
      math.prod(a.shape),
      _state_bytes(part, a.shape, s),
      _state_bytes(part, a.shape, s) * _local_device_count(s),
      rows=n,
      moving_bytes=_moving_bytes(a, s),
    )
    for p, a, part, s, n in zip(paths, avals, per_leaf, shardings, rows)
  )
  the_plan = plan_lib.make_plan(
    leaves,
    min_size=min_size,
    window_bytes=window_bytes if window_bytes is not None else default_window_bytes(),
    host_limit=host_limit,
    nvme=nvme_dir is not None,
  )
  part_shapes = tuple([tuple(x.shape) for x in jax.tree.leaves(part)] for part in per_leaf)
  array_tiers = tuple(_array_tiers(part, t, min_size) for part, t in zip(per_leaf, the_plan.tiers))
  spec = stream.StreamSpec(
    the_plan.units,
    array_tiers,
    dims,
    tuple(_chunks(u, leaves, array_tiers, cols, len(the_plan.units)) for u in the_plan.units),
  )
  tier = None
  if any(plan_lib.Tier.NVME in ts for ts in array_tiers):
    tier = nvme_tier.NvmeTier(
      nvme_tier.process_directory(nvme_dir),
      layout,
      the_plan.units,
      array_tiers,
      per_leaf,
      [tuple(a.shape) for a in avals],
      shardings,
      nvme_options,
    )
  logger.info("offload plan:\n%s", plan_lib.describe_plan(the_plan, leaves))
  if len(the_plan.units) > MANY_GROUPS:
    logger.warning(
      "offload: %d groups. XLA:GPU's compile time grows faster than the number of groups, above "
      "all for row slices of one stacked leaf (measured for an H100: 128 slices of one leaf "
      "90-120 s, 128 separate leaves 12 s); raise window_bytes (now %s) for fewer, larger groups.",
      len(the_plan.units),
      format_bytes(window_bytes if window_bytes is not None else default_window_bytes()),
    )
  if jax.default_backend() == "gpu":
    devices = max(1, len(jax.local_devices()))
    warning = plan_lib.pinned_pool_warning(the_plan.bytes_per_tier["host"] // devices)
    if warning:
      logger.warning("offload: %s", warning)
  return Setup(
    tuple(paths),
    tuple(tuple(a.shape) for a in avals),
    tuple(jnp.dtype(a.dtype) for a in avals),
    leaves,
    the_plan,
    part_shapes,
    array_tiers,
    spec,
    layout,
    tier,
  )


def named_sharding(sharding: Any) -> jax.sharding.NamedSharding:
  """The same placement as a NamedSharding (one-device shardings on a one-device mesh)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  (device,) = sharding.device_set
  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  return jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
  )


def state_shardings(setup: Setup, layout, abstract_inner: Any, shardings, named: bool):
  """A sharding for every array of an inner state, and the default one (for the handles).

  Offloaded parts take their param's sharding in pinned host memory; parts shaped like their param
  its sharding on the device; other parts and the shared leaves are replicated (on the params'
  mesh, or on the first param's device). With `named`, one-device shardings become NamedShardings
  of a one-device mesh (what abstract tracing needs in jax 0.10).
  """
  default = next((s for s in shardings if s is not None), None)
  if default is None:
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(default, jax.sharding.NamedSharding):
    default = jax.sharding.NamedSharding(default.mesh, jax.sharding.PartitionSpec())
  elif not isinstance(default, jax.sharding.SingleDeviceSharding):
    default = jax.sharding.SingleDeviceSharding(next(iter(default.device_set)))
  default = default.with_memory_kind("device")
  if named:
    default = named_sharding(default)
  shared, per_leaf = layout.split(abstract_inner)
  shared = [jax.tree.map(lambda _: default, s) for s in shared]
  placed = []
  for part, tiers, aval, sharding in zip(
    per_leaf, setup.array_tiers, setup.param_shapes, shardings
  ):
    sharding = default if sharding is None else sharding.with_memory_kind("device")
    if named:
      sharding = named_sharding(sharding)

    def spec(tier, j, x, sharding=sharding, shape=aval):
      if tier is plan_lib.Tier.HOST:
        return host_sharding(sharding, x.shape, shape)
      if tier is plan_lib.Tier.NVME or tuple(x.shape) != tuple(shape):
        if isinstance(sharding, jax.sharding.NamedSharding):
          return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        return default
      return sharding

    placed.append(map_arrays(part, tiers, spec))
  return layout.merge(shared, placed), default
