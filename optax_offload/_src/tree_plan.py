"""The plan of one parameter tree: what `offload` decides for each leaf, from shapes alone.

`plan_tree` is the one derivation that `offload` (through `tree_setup.make_setup`, which adds the
stream spec and the NVMe tier) and `estimate` both run. From the inner transformation and the
params' tree structure, paths, shapes, dtypes and shardings it derives, in order:

1. `derive_leaves`: the state's layout and its abstract parts (``jax.eval_shape`` of ``init``), the
   axes each state array shares with its param, and one `plan.LeafInfo` per leaf: the bytes of
   state the plan places, per device and per process; the rows the leaf may be sliced in (its
   update row-separable, its leading axis not sharded); the bytes of weights and gradients that
   stream with it when they live in pinned host memory.
2. `place`: `plan.make_plan` on those infos (tier of each leaf, groups, row slices), the tier of
   every state array (arrays under ``min_size`` stay on the device whatever their leaf's tier),
   and the state bytes that stay on the device.

Pure: no array is allocated (the separability check and the split probes run on miniatures).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import compress
from optax_offload._src import layout as layout_lib
from optax_offload._src import master as master_lib
from optax_offload._src import memory
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src import update_dtypes
from optax_offload._src.nvme_tier import shards as shards_lib


def offloaded_inner(
  inner: optax.GradientTransformation, master_dtype: Any = None, moment_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
  """The transformation `offload` runs group by group and `estimate` plans: `inner` with
  extra-args support, its state in the dtypes its update returns (`update_dtypes`), its moments
  kept in `moment_dtype` (when given, `compress.with_moment_dtype`), updating master copies in
  `master_dtype` (when given) of the params narrower than it (the master wraps the moments'
  wrapper, so the master copy keeps its dtype)."""
  inner = update_dtypes.with_update_dtypes(optax.with_extra_args_support(inner))
  return _wrapped(inner, master_dtype, moment_dtype)


def _wrapped(inner, master_dtype, moment_dtype):
  twin = None
  if moment_dtype is not None:
    twin = _wrapped(inner, master_dtype, None)
    inner = compress.with_moment_dtype(inner, moment_dtype)
  if master_dtype is not None:
    inner = master_lib.with_master_weights(inner, master_dtype)
  if twin is not None:
    separable.register_twin(inner, twin)
  return inner


def window_bytes(given: int | None, device_memory: int | None) -> int:
  """The update's window: as given, else a fraction of the device's memory, else 1 GiB.

  Examples:
    >>> window_bytes(None, 24 * 2**30), window_bytes(None, None), window_bytes(1 << 20, 2**30)
    (2576980377, 1073741824, 1048576)
  """
  if given is not None:
    return given
  if device_memory:
    return int(device_memory * plan_lib.DEFAULT_WINDOW_FRACTION)
  return plan_lib.FALLBACK_WINDOW_BYTES


@dataclasses.dataclass(frozen=True)
class TreeLeaves:
  """What `offload` derives for each leaf of one parameter tree before placing it.

  Attributes:
    paths: the leaves' key paths, for messages.
    param_shapes: the params' shapes.
    dtypes: the params' dtypes.
    shardings: the params' shardings (None: the default device).
    layout: where the per-leaf parts sit in the inner state.
    shared: the inner state's shared leaves, abstract (`StateLayout.split`).
    parts: each leaf's state part, abstract (`jax.ShapeDtypeStruct` trees).
    dims: per leaf, how many leading axes each array of its part shares with the param.
    leaves: one `plan.LeafInfo` per leaf.
    min_size: leaves with fewer elements, and state arrays with fewer (and scalar ones), stay on
      the device.
    shared_bytes: bytes of the shared leaves held by this process (one copy per device of the
      params' mesh, as the state places them).
  """

  paths: tuple[str, ...]
  param_shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  shardings: tuple[Any, ...]
  layout: layout_lib.StateLayout
  shared: tuple[Any, ...]
  parts: tuple[Any, ...]
  dims: tuple[tuple[int, ...], ...]
  leaves: tuple[plan_lib.LeafInfo, ...]
  min_size: int
  shared_bytes: int

  @property
  def part_shapes(self) -> tuple[list[tuple[int, ...]], ...]:
    """The shapes of each leaf's state arrays."""
    return tuple([tuple(x.shape) for x in jax.tree.leaves(part)] for part in self.parts)


@dataclasses.dataclass(frozen=True)
class TreePlan(TreeLeaves):
  """`TreeLeaves` placed: the plan, the tier of every state array, the state left on the device.

  Attributes:
    plan: the `plan.Plan` (tier of each leaf, groups, row slices).
    array_tiers: per leaf, the tier of each array of its state part (`jax.tree.leaves` order).
    device_state_bytes: state bytes this process keeps on its devices: the shared leaves and every
      array whose tier is the device (as `footprint` counts them, without `OffloadState`'s two
      int32 handles).
  """

  plan: plan_lib.Plan
  array_tiers: tuple[tuple[plan_lib.Tier, ...], ...]
  device_state_bytes: int


def shard_bytes(x: Any, param_shape: Sequence[int], sharding: Any) -> int:
  """Bytes per device of one state array: a shard when it is shaped like its param (it takes the
  param's sharding), else the whole array (replicated)."""
  shape = tuple(x.shape)
  if sharding is not None and shape == tuple(param_shape):
    shape = tuple(sharding.shard_shape(shape))
  return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def local_devices(sharding: Any) -> int:
  """How many of this process's devices hold a shard (or a copy) of an array with `sharding`.

  On an `jax.sharding.AbstractMesh` (planning before devices exist, as `estimate` may), one
  process is taken to hold the whole mesh.
  """
  if sharding is None:
    return 1
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return mesh.size
  return sum(d.process_index == jax.process_index() for d in sharding.device_set)


def distinct_local_shards(sharding: Any, shape: Sequence[int]) -> int:
  """How many distinct shards of an array with `sharding` this process's devices hold: what the
  NVMe tier stores, once each (`nvme_tier.shards`).

  On an `jax.sharding.AbstractMesh`, one process is taken to hold the whole mesh.
  """
  if sharding is None:
    return 1
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):
    used = {a for entry in sharding.spec if entry is not None for a in _axis_names(entry)}
    return math.prod(mesh.shape[a] for a in used)
  _, number = shards_lib.shard_regions(sharding, shape)
  here = {d.id for d in sharding.device_set if d.process_index == jax.process_index()}
  return len({n for device, n in number.items() if device in here})


def _axis_names(entry: Any) -> tuple[str, ...]:
  return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def unsharded_axes(sharding: Any) -> int:
  """How many leading axes of a param are not sharded (at most 2)."""
  if sharding is None or isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return 2
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None, None)
    return 0 if spec[0] is not None else (1 if spec[1] is not None else 2)
  return 0


def array_tiers(part: Any, tier: plan_lib.Tier, min_size: int) -> tuple[plan_lib.Tier, ...]:
  """The leaf's tier for each of its state arrays, but arrays below `min_size`, and scalars, stay
  on device.

  Besides saving transfers of tiny arrays (e.g. adafactor's (1,) placeholders), this keeps
  JAX's donation matching right: it pairs donated inputs to outputs by shape and dtype, ignoring
  memory kinds, so a tiny host array and a tiny device array of the same shape could be swapped.
  A scalar stays even with ``min_size`` 0 or 1: optax computes scalar states anew in device memory
  (``optax.MultiSteps``' ``jnp.where`` between the new and the old state gives a device scalar,
  which its ``lax.cond`` refuses beside a host one).
  """
  return tuple(
    tier if _placeable(x, min_size) else plan_lib.Tier.DEVICE for x in jax.tree.leaves(part)
  )


def _placeable(x: Any, min_size: int) -> bool:
  """Whether a state array may leave the device: not a scalar, and `min_size` elements or more."""
  return len(x.shape) > 0 and math.prod(x.shape) >= min_size


def _placed_arrays(part: Any, size: int, min_size: int) -> list[Any]:
  """The arrays of a leaf's state that the plan places: all of a leaf under `min_size` (its state
  stays on the device), else those with at least `min_size` elements (smaller ones stay on the
  device whatever the leaf's tier, `array_tiers`)."""
  arrays = jax.tree.leaves(part)
  if size < min_size:
    return arrays
  return [x for x in arrays if _placeable(x, min_size)]


def derive_leaves(
  inner: optax.GradientTransformationExtraArgs,
  treedef: Any,
  paths: Sequence[str],
  avals: Sequence[jax.ShapeDtypeStruct],
  shardings: Sequence[Any],
  *,
  min_size: int,
  check_separable: bool = True,
) -> TreeLeaves:
  """Derives what the plan needs of each leaf (see the module's docstring).

  Args:
    inner: the transformation offload runs (`offloaded_inner`).
    treedef: the params' tree structure.
    paths: the leaves' key paths.
    avals: the params' shapes and dtypes.
    shardings: the params' shardings (None where unknown: the default device).
    min_size: as `offload`'s.
    check_separable: check that `inner` does not mix leaves (`separable.check_separable`).

  Raises:
    TypeError: the inner state cannot be split per parameter.
    ValueError: `inner` mixes leaves.
  """
  layout = layout_lib.StateLayout(inner, treedef)
  state = jax.eval_shape(inner.init, treedef.unflatten(list(avals)))
  try:
    shared, parts = layout.split(state)
  except (ValueError, TypeError) as e:
    hint = (
      " As optax.lookahead's, whose fast optimizer's state follows the fast params: offload the "
      "transformation it wraps instead, e.g. optax.lookahead(oo.offload(optax.adam(1e-3)), 5, 0.5)."
      if "LookaheadParams" in str(treedef)
      else " A mask or labels given as a function that reads the params' leaves (which the layout "
      "sees as optax's params placeholders) can be given as a pytree instead, e.g. "
      "optax.multi_transform(transforms, labels_fn(params))."
      if layout.template_from_leaves
      else ""
    )
    raise TypeError(
      "offload: the inner transformation's state does not hold its per-parameter parts in the "
      f"params' tree ({type(e).__name__}: {str(e).partition(chr(10))[0][:100]}).{hint}"
    ) from e
  if check_separable:
    twin = separable.twin(inner)
    twin_layout = layout if twin is inner else layout_lib.StateLayout(twin, treedef)
    separable.check_separable(twin, twin_layout, paths, avals)
  dims = tuple(separable.shared_dims(part, a.shape) for part, a in zip(parts, avals))
  rows = separable.splittable(inner, avals, parts, dims, min_size, axis=0, treedef=treedef)
  # A row slice of a leaf whose leading axis is sharded would cut across shards.
  rows = [n if unsharded_axes(s) >= 1 else 0 for n, s in zip(rows, shardings)]
  leaves = []
  for path, a, part, s, n in zip(paths, avals, parts, shardings, rows):
    size = math.prod(a.shape)
    per_device = sum(shard_bytes(x, a.shape, s) for x in _placed_arrays(part, size, min_size))
    # Weights offloaded too: the param and its gradient stream through the window with the state.
    moving = 2 * shard_bytes(a, a.shape, s) if memory.is_pinned_host(s) else 0
    leaves.append(
      plan_lib.LeafInfo(
        path,
        size,
        per_device,
        per_device * local_devices(s),
        rows=n,
        moving_bytes=moving,
        nvme_bytes=per_device * distinct_local_shards(s, a.shape),
      )
    )
  default = next((s for s in shardings if s is not None), None)
  shared_bytes = sum(
    math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(shared)
  )
  if isinstance(default, jax.sharding.NamedSharding):  # replicated over the params' mesh
    shared_bytes *= local_devices(default)
  return TreeLeaves(
    tuple(paths),
    tuple(tuple(a.shape) for a in avals),
    tuple(jnp.dtype(a.dtype) for a in avals),
    tuple(shardings),
    layout,
    tuple(shared),
    tuple(parts),
    dims,
    tuple(leaves),
    min_size,
    shared_bytes,
  )


def place(
  derived: TreeLeaves, *, window_bytes: int, host_limit: int | None, nvme: bool
) -> TreePlan:
  """Places the leaves: `plan.make_plan`, then the tier of every state array.

  Raises:
    ValueError: the offloaded state exceeds `host_limit` and there is no NVMe tier.
  """
  the_plan = plan_lib.make_plan(
    derived.leaves,
    min_size=derived.min_size,
    window_bytes=window_bytes,
    host_limit=host_limit,
    nvme=nvme,
  )
  tiers = tuple(
    array_tiers(part, t, derived.min_size) for part, t in zip(derived.parts, the_plan.tiers)
  )
  on_device = derived.shared_bytes
  for part, ts, shape, s in zip(derived.parts, tiers, derived.param_shapes, derived.shardings):
    on_device += local_devices(s) * sum(
      shard_bytes(x, shape, s)
      for x, t in zip(jax.tree.leaves(part), ts)
      if t is plan_lib.Tier.DEVICE
    )
  fields = {f.name: getattr(derived, f.name) for f in dataclasses.fields(TreeLeaves)}
  return TreePlan(**fields, plan=the_plan, array_tiers=tiers, device_state_bytes=on_device)


def plan_tree(
  inner: optax.GradientTransformationExtraArgs,
  treedef: Any,
  paths: Sequence[str],
  avals: Sequence[jax.ShapeDtypeStruct],
  shardings: Sequence[Any],
  *,
  min_size: int,
  window_bytes: int,
  host_limit: int | None,
  nvme: bool,
  check_separable: bool = True,
) -> TreePlan:
  """`derive_leaves` then `place`: the plan of one parameter tree (see the module's docstring).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> params = {"w": jax.ShapeDtypeStruct((512, 256), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
    >>> flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    >>> t = plan_tree(offloaded_inner(optax.adam(1e-3)), treedef,
    ...               [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat],
    ...               [None, None], min_size=4096, window_bytes=1 << 20, host_limit=None,
    ...               nvme=False)
    >>> [tier.value for tier in t.plan.tiers], t.plan.bytes_per_tier["host"]  # b, w: mu and nu
    (['device', 'host'], 1048576)
    >>> [(p.leaf, p.start, p.stop) for unit in t.plan.units for p in unit]  # w in 4 equal row slices
    [(0, None, None), (1, 0, 128), (1, 128, 256), (1, 256, 384), (1, 384, 512)]
  """
  derived = derive_leaves(
    inner,
    treedef,
    paths,
    avals,
    shardings,
    min_size=min_size,
    check_separable=check_separable,
  )
  return place(derived, window_bytes=window_bytes, host_limit=host_limit, nvme=nvme)
