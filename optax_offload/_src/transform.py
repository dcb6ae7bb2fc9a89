"""`offload`: an optax transformation whose inner state lives off the device, updated in a window."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import _compat
from optax_offload._src import layout as layout_lib
from optax_offload._src import master as master_lib
from optax_offload._src import nvme_tier
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src import stream

logger = logging.getLogger(__name__)

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
_UPDATE_ON = ("device", "host")


class OffloadState(NamedTuple):
  """State of `offload`: the inner state, with large per-parameter parts in host memory."""

  inner: optax.OptState  # NVMe-tier parts are empty placeholders: their data is in the store
  nvme_store: jax.Array  # int32 scalar: id of the NVMe store holding NVMe-tier parts; -1: none
  nvme_generation: jax.Array  # int32 scalar: the store generation this state names; -1: none


@dataclasses.dataclass(frozen=True)
class _Setup:
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

  def handles(self, generation: int) -> tuple[jax.Array, jax.Array]:
    store = -1 if self.nvme is None else self.nvme.id
    return jnp.asarray(store, jnp.int32), jnp.asarray(generation, jnp.int32)

  @property
  def usable(self) -> bool:
    return self.nvme is None or not self.nvme.closed


def _default_window_bytes() -> int:
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


def _local_device_count(sharding: Any) -> int:
  """How many of this process's devices hold a shard (or a copy) of an array with `sharding`."""
  if sharding is None:
    return 1
  return sum(d.process_index == jax.process_index() for d in sharding.device_set)


def _host_sharding(sharding: Any, part_shape: tuple[int, ...], param_shape: tuple[int, ...]):
  """Sharding of an offloaded state part: the param's, in pinned host memory.

  The state keeps the kind of sharding its params have (a one-device param's state a
  SingleDeviceSharding), so that a jitted step's outputs have its inputs' shardings and the step
  compiles once.
  """
  if tuple(part_shape) != tuple(param_shape) and isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return sharding.with_memory_kind("pinned_host")


def _map_arrays(part: Any, tiers: Sequence[plan_lib.Tier], fn) -> Any:
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


def _leaf_path(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


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
  nvme_options: dict[str, Any] | None = None,
  check_separable: bool = True,
) -> _Setup:
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
    )
    for p, a, part, s, n in zip(paths, avals, per_leaf, shardings, rows)
  )
  the_plan = plan_lib.make_plan(
    leaves,
    min_size=min_size,
    window_bytes=window_bytes if window_bytes is not None else _default_window_bytes(),
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
      the_plan.units,
      array_tiers,
      per_leaf,
      [tuple(a.shape) for a in avals],
      shardings,
      **(nvme_options or {}),
    )
    tier.layout = layout
  logger.info("offload plan:\n%s", plan_lib.describe_plan(the_plan, leaves))
  if jax.default_backend() == "gpu":
    devices = max(1, len(jax.local_devices()))
    warning = plan_lib.pinned_pool_warning(the_plan.bytes_per_tier["host"] // devices)
    if warning:
      logger.warning("offload: %s", warning)
  return _Setup(
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


def offload(
  inner: optax.GradientTransformation,
  *,
  host_limit: int | str | None = None,
  nvme_dir: str | None = None,
  update_on: str = "device",
  master_dtype: Any = None,
  min_size: int = 4096,
  window_bytes: int | str | None = None,
  check_separable: bool = True,
  nvme_options: dict[str, Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Keeps the state of a separable optax transformation in pinned host memory.

  The large per-parameter parts of the inner state (Adam's moments, ...) live in ``pinned_host``
  memory between steps. ``update`` runs the inner transformation group by group: each group's state
  is brought to the device, updated and sent back, with the next group prefetched while the current
  one computes, so at most ``window_bytes`` of offloaded state is on the device at once. Shared
  leaves (step count, injected hyper-parameters) and the state of leaves with fewer than
  ``min_size`` elements stay on the device.

  Args:
    inner: a separable optax transformation (a leaf's update depends only on its own gradient, state
      and parameter and on shared scalars). Put leaf-mixing transformations such as
      ``optax.clip_by_global_norm`` outside: ``optax.chain(optax.clip_by_global_norm(1.0),
      offload(optax.adamw(1e-3)))``.
    host_limit: pinned-host budget for the offloaded state, in bytes or a string like ``"64GiB"``;
      None for no limit.
    nvme_dir: directory for state beyond ``host_limit``: TensorStore arrays in
      ``nvme_dir/process_{i}``, one generation per step, committed atomically. The directory is
      locked by this process until `close_nvme` (or exit); `sync_nvme` waits for
      pending writes.
    update_on: ``"device"`` streams state groups to the accelerator and updates them there;
      ``"host"`` runs each group's update on the host next to its state (ZeRO-Offload style): only
      gradients go to the host and updates come back.
    master_dtype: e.g. ``jnp.float32``: keep a master copy of every param narrower than it (bf16,
      fp16) in the offloaded state; the inner transformation updates the master, and the returned
      updates (in ``master_dtype``) make ``optax.apply_updates(params, updates)`` equal the master
      rounded to the param dtype. `master_params` reads the masters.
    min_size: leaves with fewer elements keep their state on the device.
    window_bytes: most offloaded-state bytes on the device at once during ``update``; each group holds
      at most half of it (one group computes while the next is prefetched). A leaf larger than that
      is a group of its own. Default: 10% of the device's memory when the backend reports it, else
      1 GiB.
    check_separable: at ``init``, check on a miniature of the parameter tree that ``inner`` does not
      mix leaves, and refuse it otherwise.
    nvme_options: keyword arguments for the NVMe store: ``prefetch_depth`` (groups read ahead,
      default 1), ``write_depth`` (groups written behind, default 1), ``chunk_bytes`` (default
      16 MiB). Host RAM held by the store: at most (prefetch_depth + write_depth + 1) x the largest
      group's NVMe bytes (`NvmeStore.host_buffer_bound`). The update's callbacks add transient
      copies of about two more groups (a fetched group is copied into the program's buffers; a put's
      operands are copied to host arrays), and on a CPU backend the device window (`window_bytes`)
      is host memory too.

  Returns:
    An `optax.GradientTransformationExtraArgs`. Its state is an `OffloadState`.

  Raises:
    ValueError: for a bad argument.
    NotImplementedError: at init, when params whose state goes to NVMe are not on one mesh.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_offload as oo
    >>> params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
    >>> tx = oo.offload(optax.adam(1e-2))
    >>> state = tx.init(params)
    >>> state.inner[0].mu["w"].sharding.memory_kind, state.inner[0].mu["b"].sharding.memory_kind
    ('pinned_host', 'device')
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> oo.footprint(state)
    {'device': 1036, 'host': 65536, 'nvme': 0}
  """
  if update_on not in _UPDATE_ON:
    raise ValueError(f"update_on must be one of {_UPDATE_ON}, got {update_on!r}.")
  if master_dtype is not None:
    try:
      master_dtype = jnp.dtype(master_dtype)
    except TypeError:
      raise TypeError(
        f"master_dtype must be a dtype such as jnp.float32, got {master_dtype!r}."
      ) from None
    if not jnp.issubdtype(master_dtype, jnp.floating):
      raise ValueError(
        f"master_dtype must be a floating dtype such as jnp.float32, got {master_dtype}."
      )
  if nvme_dir is not None and not isinstance(nvme_dir, str | os.PathLike):
    raise TypeError(f"nvme_dir must be a directory path, got {type(nvme_dir).__name__}.")
  nvme_options = dict(nvme_options or {})
  if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f"min_size must be an int >= 0 (number of elements), got {min_size!r}.")
  host_limit_bytes = plan_lib.parse_bytes(host_limit, "host_limit")
  window = plan_lib.parse_bytes(window_bytes, "window_bytes")
  if window == 0:
    raise ValueError("window_bytes must be > 0; pass None for the default.")

  inner = optax.with_extra_args_support(inner)
  if master_dtype is not None:
    inner = master_lib.with_master_weights(inner, master_dtype)
  # One setup per parameter shapes: init makes it (and opens the NVMe store, if any); update finds
  # it again from the gradients' shapes, whatever their container types (Flax NNX hands init
  # `nnx.Param` variables and update plain arrays) or dtypes.
  setups: dict[tuple[tuple[int, ...], ...], _Setup] = {}
  layouts: dict[Any, layout_lib.StateLayout] = {}
  options = dict(
    min_size=min_size,
    window_bytes=window,
    host_limit=host_limit_bytes,
    nvme_dir=nvme_dir,
    nvme_options=nvme_options,
    check_separable=check_separable,
  )

  def layout_for(treedef) -> layout_lib.StateLayout:
    if treedef not in layouts:
      layouts[treedef] = layout_lib.StateLayout(inner, treedef)
    return layouts[treedef]

  def setup_for_init(treedef, paths, avals, shardings) -> _Setup:
    key = tuple(tuple(a.shape) for a in avals)
    old = setups.get(key)
    dtypes = tuple(jnp.dtype(a.dtype) for a in avals)
    if old is not None and old.usable and old.dtypes == dtypes:
      return old
    setups[key] = make_setup(inner, treedef, paths, avals, shardings, **options)
    layouts.setdefault(treedef, setups[key].layout)
    return setups[key]

  def setup_for_update(paths, avals) -> _Setup:
    key = tuple(tuple(a.shape) for a in avals)
    if key in setups:
      return setups[key]
    if setups:
      (known,) = list(setups.values())[-1:]
      raise ValueError(_mismatch_message(known, paths, avals))
    # No init in this process (e.g. a state restored by other means): plan from the gradients.
    setups[key] = make_setup(
      inner,
      jax.tree.structure(list(avals)),
      paths,
      avals,
      [None] * len(avals),
      **{**options, "nvme_dir": None, "host_limit": None},
    )
    return setups[key]

  def init_fn(params: optax.Params, abstract_only: bool = False) -> OffloadState:
    if layout_lib.is_placeholder(params):  # optax.tree_utils.tree_map_params asks for the layout
      return OffloadState(
        inner.init(params), jnp.asarray(-1, jnp.int32), jnp.asarray(-1, jnp.int32)
      )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [_leaf_path(p) for p, _ in flat]
    values = [v for _, v in flat]
    avals = [jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)) for v in values]
    shardings = [getattr(v, "sharding", None) for v in values]
    if master_dtype is not None:
      master_lib.check_master_dtype(values, paths, master_dtype)
    setup = setup_for_init(treedef, paths, avals, shardings)
    layout = layout_for(treedef)

    def leaves_of(concrete):
      it = iter(concrete)
      return [
        jnp.zeros(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else next(it)
        for v in values
      ]

    generation = -1
    if setup.nvme is not None:
      generation = setup.nvme.store.new_generation()

    def place(*concrete):
      shared, per_leaf = layout.split(inner.init(treedef.unflatten(leaves_of(concrete))))
      per_leaf = [
        _map_arrays(part, tiers, _place_array) for part, tiers in zip(per_leaf, setup.array_tiers)
      ]
      return OffloadState(layout.merge(shared, per_leaf), *setup.handles(generation))

    concrete = [v for v in values if not isinstance(v, jax.ShapeDtypeStruct)]
    if abstract_only:
      state = jax.eval_shape(place, *concrete)
      placed = _state_shardings(setup, layout, state, shardings, named=True)
      return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, placed
      )
    if any(isinstance(v, jax.core.Tracer) for v in concrete):
      if setup.nvme is not None:
        raise ValueError(
          "offload with an NVMe tier must be initialised outside jax.jit (init writes the initial "
          "state to disk)."
        )
      return place(*concrete)
    if setup.nvme is not None:
      _init_nvme(inner, setup, generation, lambda c: treedef.unflatten(leaves_of(c)), concrete)
    out_shardings = _state_shardings(
      setup, layout, jax.eval_shape(place, *concrete), shardings, named=False
    )
    return jax.jit(place, out_shardings=out_shardings)(*concrete)

  def update_fn(
    updates: optax.Updates,
    state: OffloadState,
    params: optax.Params | None = None,
    **extra_args,
  ) -> tuple[optax.Updates, OffloadState]:
    return update(updates, state, params, extra_args, apply=False)

  def update(updates, state, params, extra_args, apply):
    if not isinstance(state, OffloadState):
      raise TypeError(
        f"offload's update expects the OffloadState returned by its init, got {type(state).__name__}."
      )
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    paths = [_leaf_path(p) for p, _ in flat]
    grads = [g for _, g in flat]
    param_leaves = None
    if params is not None:
      param_leaves = _matching_leaves(params, treedef, paths, "params")
    dtypes = [jnp.result_type(p) for p in (param_leaves or grads)]
    avals = [jax.ShapeDtypeStruct(jnp.shape(g), d) for g, d in zip(grads, dtypes)]
    setup = setup_for_update(paths, avals)
    layout = layout_for(treedef)
    shared, per_leaf = _split_checked(setup, layout, state.inner, paths)
    if not grads:
      new_updates, new_inner = inner.update(updates, state.inner, params, **extra_args)
      return (params if apply else new_updates), state._replace(inner=new_inner)
    try:
      new_updates, new_shared, new_per_leaf, new_generation = stream.run(
        inner,
        layout,
        setup.spec,
        grads,
        shared,
        per_leaf,
        param_leaves,
        extra_args,
        placement=update_on,
        nvme=setup.nvme,
        generation=state.nvme_generation,
        store=state.nvme_store,
        apply=apply,
      )
    except ValueError as e:
      if _compat.NO_PARAMS_MSG in str(e) and params is None:
        raise ValueError(
          f"{_compat.NO_PARAMS_MSG} (offload: the inner transformation needs params; call "
          "tx.update(grads, state, params).)"
        ) from e
      raise
    return (
      treedef.unflatten(new_updates),
      state._replace(
        inner=layout.merge(new_shared, new_per_leaf),
        nvme_generation=new_generation,
      ),
    )

  _ABSTRACT[init_fn] = lambda params: init_fn(params, abstract_only=True)
  _APPLYING[update_fn] = lambda grads, state, params, extra_args: update(
    grads, state, params, extra_args, apply=True
  )
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


_APPLYING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ABSTRACT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""`offload` update functions -> the same update returning new params (`update_and_apply`)."""


def abstract_state(tx: optax.GradientTransformation, params: optax.Params) -> OffloadState:
  """The state ``tx.init(params)`` would return, as `jax.ShapeDtypeStruct`s with its placement.

  Every leaf carries a `jax.sharding.NamedSharding` with its memory kind (``pinned_host`` for
  offloaded state), so the usual large-model recipe keeps the state off the device: build the
  state with ``jax.jit(tx.init, out_shardings=...)`` from these shardings, or trace and compile a
  step ahead of time from them (`jax.eval_shape` returns no memory kinds, and in jax 0.10 only a
  NamedSharding carries its memory kind into tracing). One-device params get a one-device mesh:
  give the params NamedShardings too, so that a jitted step's outputs keep its inputs' shardings
  (mixing them with SingleDeviceShardings makes the second step compile again).

  Args:
    tx: a transformation returned by `offload`.
    params: the params, as arrays or `jax.ShapeDtypeStruct`s (with shardings, or on the default
      device).

  Returns:
    An `OffloadState` of `jax.ShapeDtypeStruct`s.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_offload as oo
    >>> tx = oo.offload(optax.adam(1e-3))
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 256), jnp.float32)}
    >>> state = oo.abstract_state(tx, params)
    >>> state.inner[0].mu["w"].sharding.memory_kind
    'pinned_host'
    >>> shardings = jax.tree.map(lambda x: x.sharding, state)
    >>> real = jax.jit(tx.init, out_shardings=shardings)({"w": jnp.zeros((1024, 256))})
    >>> real.inner[0].mu["w"].sharding.memory_kind
    'pinned_host'
  """
  abstract = _ABSTRACT.get(getattr(tx, "init", None))
  if abstract is None:
    raise TypeError("abstract_state needs a transformation returned by oo.offload.")
  return abstract(params)


def update_and_apply(
  tx: optax.GradientTransformation,
  grads: optax.Updates,
  state: OffloadState,
  params: optax.Params,
  **extra_args,
) -> tuple[optax.Params, OffloadState]:
  """``tx.update`` then ``optax.apply_updates``, fused group by group: the updates never exist whole.

  The same values as::

    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

  but each group's new params are written into the params' buffers as soon as the group is
  computed, so the device holds no param-sized updates (with ``master_dtype``, fp32 updates of bf16
  params would take twice the params' size). Donate the params to the jitted step so that the new
  params take their place.

  Args:
    tx: a transformation returned by `offload` (not a chain: apply leaf-mixing transformations such
      as ``optax.clip_by_global_norm`` to the gradients first).
    grads: the gradients.
    state: the `OffloadState`.
    params: the params.
    **extra_args: passed to the inner transformation.

  Returns:
    (new params, new state).

  Raises:
    TypeError: when `tx` is not an `offload` transformation.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"w": jnp.ones((64, 128))}
    >>> tx = oo.offload(optax.sgd(0.5), window_bytes="8KiB")
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda g, s, p: oo.update_and_apply(tx, g, s, p), donate_argnums=(1, 2))
    >>> params, state = step({"w": jnp.ones((64, 128))}, state, params)
    >>> float(params["w"][0, 0])
    0.5
  """
  applying = _APPLYING.get(getattr(tx, "update", None))
  if applying is None:
    raise TypeError(
      "update_and_apply needs a transformation returned by oo.offload (its update applies the "
      "updates group by group). For optax.chain(clip, oo.offload(...)), clip the gradients first: "
      "grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState()); then call "
      "oo.update_and_apply(offloaded, grads, state, params)."
    )
  return applying(grads, state, params, extra_args)


def _named(sharding: Any) -> jax.sharding.NamedSharding:
  """The same placement as a NamedSharding (one-device shardings on a one-device mesh)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  (device,) = sharding.device_set
  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  return jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
  )


def _state_shardings(setup: _Setup, layout, abstract: OffloadState, shardings, named: bool) -> Any:
  """A sharding for every leaf of the state: where `offload` puts each.

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
    default = _named(default)
  shared, per_leaf = layout.split(abstract.inner)
  shared = [jax.tree.map(lambda _: default, s) for s in shared]
  placed = []
  for part, tiers, aval, sharding in zip(
    per_leaf, setup.array_tiers, setup.param_shapes, shardings
  ):
    sharding = default if sharding is None else sharding.with_memory_kind("device")
    if named:
      sharding = _named(sharding)

    def spec(tier, j, x, sharding=sharding, shape=aval):
      if tier is plan_lib.Tier.HOST:
        return _host_sharding(sharding, x.shape, shape)
      if tier is plan_lib.Tier.NVME or tuple(x.shape) != tuple(shape):
        if isinstance(sharding, jax.sharding.NamedSharding):
          return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        return default
      return sharding

    placed.append(_map_arrays(part, tiers, spec))
  return OffloadState(layout.merge(shared, placed), default, default)


def _mismatch_message(known: _Setup, paths: Sequence[str], avals) -> str:
  """Why gradients of these paths and shapes do not fit the state `known` was planned for."""

  def norm(p):  # Flax NNX variables add `.value` to init's paths
    return p.removesuffix(".value")

  if len(paths) != len(known.paths):
    difference = _path_difference(
      [norm(p) for p in known.paths], [norm(p) for p in paths], "tx.init's params", "the gradients"
    )
    return (
      "offload: the gradients' tree structure does not match the tree the optimizer state was "
      f"initialised with ({difference}). Pass gradients with the same structure as the params "
      "given to tx.init."
    )
  for path, aval, want in zip(paths, avals, known.param_shapes):
    if tuple(aval.shape) != want:
      return (
        f"offload: gradient leaf {path} has shape {tuple(aval.shape)}, but the optimizer state was "
        f"initialised for a param of shape {want}. Pass gradients with the same shapes as the "
        "params given to tx.init."
      )
  return "offload: the gradients do not match the params given to tx.init."


def _matching_leaves(tree: Any, treedef: Any, paths: Sequence[str], name: str) -> list[Any]:
  flat, other = jax.tree_util.tree_flatten_with_path(tree)
  if other != treedef:
    other_paths = [_leaf_path(p) for p, _ in flat]
    raise ValueError(
      f"offload: {name} and the gradients have different tree structures ("
      f"{_path_difference(paths, other_paths, 'gradients', name)}). Pass {name} with the same "
      "structure as the gradients."
    )
  return [v for _, v in flat]


def _path_difference(a: Sequence[str], b: Sequence[str], a_name: str, b_name: str) -> str:
  only_a = [p for p in a if p not in set(b)][:5]
  only_b = [p for p in b if p not in set(a)][:5]
  parts = []
  if only_a:
    parts.append(f"only in {a_name}: {', '.join(only_a)}")
  if only_b:
    parts.append(f"only in {b_name}: {', '.join(only_b)}")
  return "; ".join(parts) or "same leaves, different container types"


def _split_checked(setup: _Setup, layout, inner_state, paths):
  """Splits the state, with errors that name the leaf when it does not match the gradients or lost
  its placement."""
  try:
    shared, per_leaf = layout.split(inner_state)
  except (ValueError, TypeError) as e:
    raise ValueError(
      "offload: the gradients' tree structure does not match the tree the optimizer state was "
      f"initialised with ({e}). Pass gradients with the same structure as the params given to "
      "tx.init."
    ) from None
  for path, want_shapes, got, tiers in zip(paths, setup.part_shapes, per_leaf, setup.array_tiers):
    got_arrays = jax.tree.leaves(got)
    got_shapes = [tuple(jnp.shape(x)) for x in got_arrays]
    want_shapes = [(0,) if t is plan_lib.Tier.NVME else w for w, t in zip(want_shapes, tiers)]
    if want_shapes != got_shapes:
      raise ValueError(
        f"offload: gradient leaf {path} does not match the optimizer state: its state has shapes "
        f"{got_shapes} but a gradient of this shape needs {want_shapes}. Pass gradients with the "
        "same shapes as the params given to tx.init."
      )
    for x, tier in zip(got_arrays, tiers):
      if tier is plan_lib.Tier.HOST and _memory_space(x) is not HOST:
        raise ValueError(
          f"offload: the optimizer state of leaf {path} is typed as {_memory_space(x)} memory, but "
          "offload keeps it in pinned host memory: the state lost its placement. jax.eval_shape "
          "returns no memory kinds, and in jax 0.10 a jax.ShapeDtypeStruct carries its memory kind "
          "into tracing only with a NamedSharding (not with the SingleDeviceSharding of a "
          "one-device state). Use the state tx.init returns, oo.abstract_state(tx, params) for "
          "abstract (ahead-of-time) tracing, or params on a jax.sharding.Mesh."
        )
  return shared, per_leaf


def _memory_space(x: Any):
  return getattr(jax.typeof(x), "memory_space", None)


def _init_nvme(inner, setup: _Setup, generation: int, build_params, concrete) -> None:
  """Writes the initial NVMe-tier state group by group, so it never sits whole in memory.

  A row slice's state is the inner ``init`` of the slice's rows of the params (a leaf is sliced
  only when its update is row-separable, which holds for its init: per-element state such as
  moments or master copies), so a huge leaf's state is never built whole either.
  """
  layout, tier = setup.layout, setup.nvme
  for k in tier.groups:
    pieces = [p for p in setup.plan.units[k] if plan_lib.Tier.NVME in setup.array_tiers[p.leaf]]
    group = [p.leaf for p in pieces]

    def group_init(*c, pieces=pieces, group=group):
      leaves = layout.params_treedef.flatten_up_to(build_params(c))
      for p in pieces:
        if not p.whole:
          leaves[p.leaf] = jax.lax.slice_in_dim(leaves[p.leaf], p.start, p.stop)
      parts = layout.unview(inner.init(layout.masked(leaves, group)), group)[1]
      # Only the NVMe arrays are written: the others are left out of the program.
      return {
        i: _map_arrays(
          part,
          setup.array_tiers[i],
          lambda t, j, x: x if t is plan_lib.Tier.NVME else jnp.zeros((0,), x.dtype),
        )
        for i, part in parts.items()
      }

    parts = jax.eval_shape(group_init, *concrete)
    out_shardings = {
      i: _map_arrays(
        part,
        setup.array_tiers[i],
        lambda t, j, x, i=i: tier.sharding((i, j)) if t is plan_lib.Tier.NVME else None,
      )
      for i, part in parts.items()
    }
    tier.write_group(k, generation, jax.jit(group_init, out_shardings=out_shardings)(*concrete))
  tier.commit(generation)


def _place_array(tier: plan_lib.Tier, j: int, x: jax.Array) -> jax.Array:
  """Where a state array rests between steps."""
  del j
  if tier is plan_lib.Tier.HOST:
    return jax.device_put(x, HOST)
  if tier is plan_lib.Tier.NVME:
    return nvme_tier.placeholder(x)
  return x
