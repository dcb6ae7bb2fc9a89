"""What `offload` builds for one parameter tree on top of its plan: the stream spec, the NVMe tier
and the state's placement.

`make_setup` takes the tree's plan (`tree_plan.plan_tree`: the derivation `estimate` runs too) and
adds what only a real run needs: the chunks of each group's update and the `stream_spec.StreamSpec`
the update runs, and the `NvmeTier` (its store opened) when state goes to disk. It logs the plan
and warns about what a run would regret (many groups, a GPU's pinned pool too small).
`state_shardings` says where each array of the state lives.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import memory
from optax_offload._src import nvme
from optax_offload._src import nvme_tier
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src import stream_spec
from optax_offload._src import tree_plan
from optax_offload._src.units import format_bytes

logger = logging.getLogger("optax_offload._src.offload")  # the plan is logged as offload's

MANY_GROUPS = 96
"""Above this many unrolled groups (`stream_spec.unrolled_groups`: equal row slices of one leaf run in
a loop and do not count) `make_setup` warns about XLA:GPU compile time."""


@dataclasses.dataclass(frozen=True)
class Setup(tree_plan.TreePlan):
  """A tree's plan (`tree_plan.TreePlan`) with the resources of a run: the update's stream spec
  and the NVMe tier (None without state on disk)."""

  spec: stream_spec.StreamSpec
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

  def close(self) -> None:
    """Closes the NVMe store of a setup that will not be used (releasing its directory)."""
    if self.nvme is not None:
      self.nvme.close()


def device_memory() -> int | None:
  """The memory JAX may use on the first local device, when the backend reports it."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # some backends do not implement memory_stats
    stats = None
  return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def host_sharding(
  sharding: Any,
  part_shape: tuple[int, ...],
  param_shape: tuple[int, ...],
  param_on_host: bool = False,
):
  """Sharding of an offloaded state part: the param's, in pinned host memory.

  The state keeps the kind of sharding its params have (a one-device param's state a
  SingleDeviceSharding), so that a jitted step's outputs have its inputs' shardings and the step
  compiles once. It is spelled as a jitted step returns it (`as_returned`), except the state of a
  param that lives in pinned host memory itself (`param_on_host`): that param may be the step's
  first input, whose spelling jax gives every output equivalent to it.
  """
  same_shape = tuple(part_shape) == tuple(param_shape)
  if not same_shape and isinstance(sharding, jax.sharding.NamedSharding):
    sharding = memory.replicated(sharding)
  sharding = sharding.with_memory_kind("pinned_host")
  return sharding if param_on_host and same_shape else as_returned(sharding, len(part_shape))


def as_returned(sharding: Any, ndim: int) -> Any:
  """A NamedSharding spelled as a jitted function returns it for an array of `ndim` axes.

  On Explicit mesh axes (`jax.make_mesh`'s default) an output's sharding is its type's: a spec of
  `ndim` entries. On Auto axes jax spells an output equivalent to the step's first input (its
  first with a NamedSharding, memory kind included) as that input; others come back in XLA's
  form, with no trailing None. An array placed so keeps one spelling from step to step:
  ``P("x", None)`` for a host-tier array beside device params made a jitted step compile a second
  program.

  Examples:
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> auto = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    >>> explicit = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    >>> as_returned(NamedSharding(auto, P("x", None)), 2).spec
    P('x',)
    >>> as_returned(NamedSharding(explicit, P("x")), 2).spec
    P('x', None)
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec)
  if memory.on_explicit_axes(sharding):
    spec += (None,) * (ndim - len(spec))
  else:
    while spec and spec[-1] is None:
      spec = spec[:-1]
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind
  )


def map_arrays(part: Any, tiers: Sequence[plan_lib.Tier], fn) -> Any:
  """Applies ``fn(tier, j, array)`` to each array of a leaf's state part."""
  arrays, treedef = jax.tree.flatten(part)
  return treedef.unflatten([fn(t, j, x) for j, (t, x) in enumerate(zip(tiers, arrays))])


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


def row_chunks(unit, leaves, array_tiers, n_units: int) -> tuple[tuple[int, int], ...]:
  """`_chunks` for pieces split by rows only (no column splits)."""
  return _chunks(unit, leaves, array_tiers, [0] * len(leaves), n_units)


def _one_device(sharding: Any) -> bool:
  """Whether a leaf's sharding places it on one device (None: unknown, one device)."""
  if sharding is None:
    return True
  try:
    return len(sharding.device_set) == 1
  except Exception:  # an abstract mesh names no devices
    return getattr(getattr(sharding, "mesh", None), "size", 2) == 1


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
  """Plans one parameter tree (`tree_plan.plan_tree`), then adds the stream spec and, when state
  goes to disk, the NVMe tier (its store opened)."""
  window = tree_plan.window_bytes(window_bytes, device_memory())
  tp = tree_plan.plan_tree(
    inner,
    treedef,
    paths,
    avals,
    shardings,
    min_size=min_size,
    window_bytes=window,
    host_limit=host_limit,
    nvme=nvme_dir is not None,
    check_separable=check_separable,
  )
  the_plan, leaves, array_tiers = tp.plan, tp.leaves, tp.array_tiers
  # Column chunks need the update to split along axis 1 too (and that axis unsharded).
  cols = separable.splittable(inner, avals, tp.parts, tp.dims, min_size, axis=1, treedef=treedef)
  cols = [n if tree_plan.unsharded_axes(s) >= 2 else 0 for n, s in zip(cols, shardings)]
  spec = stream_spec.StreamSpec(
    the_plan.units,
    array_tiers,
    tp.dims,
    tuple(_chunks(u, leaves, array_tiers, cols, len(the_plan.units)) for u in the_plan.units),
    loop=all(_one_device(s) for s in shardings),
  )
  tier = None
  if any(plan_lib.Tier.NVME in ts for ts in array_tiers):
    tier = nvme_tier.NvmeTier(
      nvme_tier.process_directory(nvme_dir),
      tp.layout,
      the_plan.units,
      array_tiers,
      tp.parts,
      [tuple(a.shape) for a in avals],
      shardings,
      nvme_options,
    )
  logger.info("offload plan:\n%s", plan_lib.describe_plan(the_plan, leaves))
  unrolled = stream_spec.unrolled_groups(spec)
  if unrolled > MANY_GROUPS:
    logger.warning(
      "offload: %d of %d groups unrolled in the update (equal row slices of one leaf run in a "
      "loop; other groups, e.g. separate leaves, are unrolled). XLA:GPU's compile time grows "
      "faster than the number of unrolled groups (measured for an H100: 16 unrolled row slices "
      "of one leaf 7.9 s, 128 338 s; in a loop 4.1 s and 3.0 s); raise window_bytes (now %s) for "
      "fewer, larger groups.",
      unrolled,
      len(the_plan.units),
      format_bytes(window),
    )
  if jax.default_backend() == "gpu":
    devices = max(1, len(jax.local_devices()))
    warning = plan_lib.pinned_pool_warning(the_plan.bytes_per_tier["host"] // devices)
    if warning:
      logger.warning("offload: %s", warning)
  fields = {f.name: getattr(tp, f.name) for f in dataclasses.fields(tree_plan.TreePlan)}
  return Setup(**fields, spec=spec, nvme=tier)


def named_sharding(sharding: Any) -> jax.sharding.NamedSharding:
  """The same placement as a NamedSharding (one-device shardings on a one-device mesh)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  (device,) = sharding.device_set
  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  return jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
  )


def _default_sharding(shardings, named: bool) -> Any:
  """Where the state's shared leaves and handles live: replicated on the params' mesh, or the
  first param's device."""
  default = next((s for s in shardings if s is not None), None)
  if default is None:
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(default, jax.sharding.NamedSharding):
    default = memory.replicated(default)
  elif not isinstance(default, jax.sharding.SingleDeviceSharding):
    default = jax.sharding.SingleDeviceSharding(next(iter(default.device_set)))
  default = default.with_memory_kind("device")
  return named_sharding(default) if named else default


def _array_sharding(tier, x, sharding, param_shape, default, param_on_host):
  """Where one array of a leaf's state part lives (`state_shardings`' rule)."""
  if tier is plan_lib.Tier.HOST:
    return host_sharding(sharding, x.shape, param_shape, param_on_host)
  if tier is plan_lib.Tier.NVME or tuple(x.shape) != tuple(param_shape):
    if isinstance(sharding, jax.sharding.NamedSharding):
      return as_returned(memory.replicated(sharding), len(x.shape))
    return default
  if memory.on_explicit_axes(sharding):
    return as_returned(sharding, len(x.shape))
  return sharding  # (on Auto axes, as the param: it may be the step's first input)


def _split_shardings(setup: Setup, shared, per_leaf, shardings, named: bool):
  """`state_shardings` of a split state: the shared leaves', each leaf part's, the default."""
  default = _default_sharding(shardings, named)
  shared = [jax.tree.map(lambda x: as_returned(default, jnp.ndim(x)), s) for s in shared]
  placed = []
  for part, tiers, aval, sharding in zip(
    per_leaf, setup.array_tiers, setup.param_shapes, shardings
  ):
    on_host = memory.kind_is_host(sharding)
    sharding = default if sharding is None else sharding.with_memory_kind("device")
    if named:
      sharding = named_sharding(sharding)

    def where(t, j, x, sharding=sharding, aval=aval, on_host=on_host):
      return _array_sharding(t, x, sharding, aval, default, on_host)

    placed.append(map_arrays(part, tiers, where))
  return shared, placed, default


def state_shardings(setup: Setup, layout, abstract_inner: Any, shardings, named: bool):
  """A sharding for every array of an inner state, and the default one (for the handles).

  Offloaded parts take their param's sharding in pinned host memory; parts shaped like their param
  its sharding on the device; other parts and the shared leaves are replicated (on the params'
  mesh, or on the first param's device). Each is spelled as a jitted step returns it
  (`as_returned`). With `named`, one-device shardings become NamedShardings of a one-device mesh
  (what abstract tracing needs in jax 0.10).
  """
  shared, placed, default = _split_shardings(setup, *layout.split(abstract_inner), shardings, named)
  return layout.merge(shared, placed), default


def _pin(x: jax.Array, sharding: Any) -> jax.Array:
  if memory.on_explicit_axes(sharding):
    return jax.sharding.reshard(x, sharding)  # (the type's sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _sharded(setup: Setup) -> bool:
  """Whether some param is sharded over several devices (a NamedSharding)."""
  return any(
    isinstance(s, jax.sharding.NamedSharding) and not _one_device(s) for s in setup.shardings
  )


def pin_device_state(setup: Setup, shared, per_leaf):
  """The update's new state on the device, constrained to where `init` placed it
  (`state_shardings`).

  XLA's sharding propagation may give an array not shaped like its param another sharding than
  `init`'s replicated one (8-bit moments' block scales of a leaf sharded along its rows came back
  sharded along them): a jitted step would then compile a second program for its second call, and
  a state restored into `init`'s placement would run the first one again, which may round
  differently. Pinned only where some param is sharded over several devices (then every
  device-side array); host-tier arrays are placed by the update itself.
  """
  if not _sharded(setup):
    return shared, per_leaf
  shared_at, placed, _ = _split_shardings(setup, shared, per_leaf, setup.shardings, named=False)
  shared = [jax.tree.map(_pin, s, at) for s, at in zip(shared, shared_at)]
  pinned = []
  for part, at, tiers in zip(per_leaf, placed, setup.array_tiers):
    at = jax.tree.leaves(at)  # (NVMe-tier arrays are placeholders on the device: pinned too)
    pinned.append(
      map_arrays(
        part, tiers, lambda t, j, x, at=at: x if t is plan_lib.Tier.HOST else _pin(x, at[j])
      )
    )
  return shared, pinned


def pin_device_params(setup: Setup, params: Sequence[Any]) -> list[Any]:
  """`value_and_update`'s new params on the device, constrained to the shardings the params had
  at `init`, as `pin_device_state` pins the state: a replicated norm's scale came back sharded
  along the mesh (plain optax's step with `jax.value_and_grad` too), so the step compiled twice.
  Params in host memory (a layer stack) are placed by the update itself."""
  if not _sharded(setup):
    return list(params)
  return [
    x
    if x is None or s is None or memory.in_host(x) or memory.kind_is_host(s)
    else _pin(x, s.with_memory_kind("device"))
    for x, s in zip(params, setup.shardings)
  ]
