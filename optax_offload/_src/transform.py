"""`offload`: an optax transformation whose inner state lives off the device, updated in a window."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src.base import NO_PARAMS_MSG

from optax_offload._src import host_compute
from optax_offload._src import layout as layout_lib
from optax_offload._src import master as master_lib
from optax_offload._src import nvme_tier
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable

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
  """Everything `offload` derives from one parameter tree (cached per structure and shapes)."""

  layout: layout_lib.StateLayout
  paths: tuple[str, ...]
  leaves: tuple[plan_lib.LeafInfo, ...]
  plan: plan_lib.Plan
  part_shapes: tuple[list[tuple[int, ...]], ...]  # shapes of each leaf's state arrays
  array_tiers: tuple[tuple[plan_lib.Tier, ...], ...]  # tier of each leaf's state arrays
  nvme: nvme_tier.NvmeTier | None

  def handles(self, generation: int) -> tuple[jax.Array, jax.Array]:
    store = -1 if self.nvme is None else self.nvme.id
    return jnp.asarray(store, jnp.int32), jnp.asarray(generation, jnp.int32)


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
  """Sharding of an offloaded state part: the param's, in pinned host memory."""
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
  setups: dict[Any, _Setup] = {}

  def get_setup(treedef, paths, avals, shardings) -> _Setup:
    key = (treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in avals))
    if key in setups and not (setups[key].nvme is not None and setups[key].nvme.closed):
      return setups[key]
    layout = layout_lib.StateLayout(inner, treedef)
    abstract_state = jax.eval_shape(inner.init, treedef.unflatten(list(avals)))
    _, per_leaf = layout.split(abstract_state)
    leaves = tuple(
      plan_lib.LeafInfo(
        p,
        math.prod(a.shape),
        _state_bytes(part, a.shape, s),
        _state_bytes(part, a.shape, s) * _local_device_count(s),
      )
      for p, a, part, s in zip(paths, avals, per_leaf, shardings)
    )
    the_plan = plan_lib.make_plan(
      leaves,
      min_size=min_size,
      window_bytes=window if window is not None else _default_window_bytes(),
      host_limit=host_limit_bytes,
      nvme=nvme_dir is not None,
    )
    if check_separable:
      separable.check_separable(inner, layout, paths, avals)
    part_shapes = tuple([tuple(x.shape) for x in jax.tree.leaves(part)] for part in per_leaf)
    array_tiers = tuple(
      _array_tiers(part, t, min_size) for part, t in zip(per_leaf, the_plan.tiers)
    )
    tier = None
    if any(plan_lib.Tier.NVME in ts for ts in array_tiers):
      tier = nvme_tier.NvmeTier(
        nvme_tier.process_directory(nvme_dir),
        the_plan.groups,
        array_tiers,
        per_leaf,
        [tuple(a.shape) for a in avals],
        shardings,
        **nvme_options,
      )
      tier.layout = layout
    setups[key] = _Setup(layout, tuple(paths), leaves, the_plan, part_shapes, array_tiers, tier)
    logger.info("offload plan:\n%s", plan_lib.describe(the_plan, leaves))
    return setups[key]

  def init_fn(params: optax.Params) -> OffloadState:
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
    setup = get_setup(treedef, paths, avals, shardings)

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
      shared, per_leaf = setup.layout.split(inner.init(treedef.unflatten(leaves_of(concrete))))
      per_leaf = [
        _map_arrays(part, tiers, _place_array) for part, tiers in zip(per_leaf, setup.array_tiers)
      ]
      return OffloadState(setup.layout.merge(shared, per_leaf), *setup.handles(generation))

    concrete = [v for v in values if not isinstance(v, jax.ShapeDtypeStruct)]
    if any(isinstance(v, jax.core.Tracer) for v in concrete):
      if setup.nvme is not None:
        raise ValueError(
          "offload with an NVMe tier must be initialised outside jax.jit (init writes the initial "
          "state to disk)."
        )
      return place(*concrete)
    if setup.nvme is not None:
      _init_nvme(inner, setup, generation, lambda c: treedef.unflatten(leaves_of(c)), concrete)
    out_shardings = _init_out_shardings(setup, jax.eval_shape(place, *concrete), avals, shardings)
    return jax.jit(place, out_shardings=out_shardings)(*concrete)

  def update_fn(
    updates: optax.Updates,
    state: OffloadState,
    params: optax.Params | None = None,
    **extra_args,
  ) -> tuple[optax.Updates, OffloadState]:
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
    setup = get_setup(treedef, paths, avals, [None] * len(grads))
    shared, per_leaf = _split_checked(setup, state.inner, paths)
    if not grads:
      new_updates, new_inner = inner.update(updates, state.inner, params, **extra_args)
      return new_updates, state._replace(inner=new_inner)
    try:
      new_updates, new_shared, new_per_leaf, new_generation = _windowed_update(
        inner,
        setup,
        grads,
        shared,
        per_leaf,
        param_leaves,
        extra_args,
        state.nvme_generation,
        on_host=update_on == "host",
      )
    except ValueError as e:
      if NO_PARAMS_MSG in str(e) and params is None:
        raise ValueError(
          f"{NO_PARAMS_MSG} (offload: the inner transformation needs params; call "
          "tx.update(grads, state, params).)"
        ) from e
      raise
    return (
      treedef.unflatten(new_updates),
      state._replace(
        inner=setup.layout.merge(new_shared, new_per_leaf),
        nvme_generation=new_generation,
      ),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init_out_shardings(setup: _Setup, abstract: OffloadState, avals, shardings) -> Any:
  """out_shardings for init: offloaded parts take their param's sharding in pinned host memory."""
  shared, per_leaf = setup.layout.split(abstract.inner)
  shared = [jax.tree.map(lambda _: None, s) for s in shared]
  placed = []
  for part, tiers, aval, sharding in zip(per_leaf, setup.array_tiers, avals, shardings):

    def spec(tier, j, x, sharding=sharding, aval=aval):
      if tier is plan_lib.Tier.HOST and sharding is not None:
        return _host_sharding(sharding, x.shape, aval.shape)
      return None

    placed.append(_map_arrays(part, tiers, spec))
  return OffloadState(setup.layout.merge(shared, placed), None, None)


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


def _split_checked(setup: _Setup, inner_state, paths):
  """Splits the state, with errors that name the leaf when it does not match the gradients."""
  try:
    shared, per_leaf = setup.layout.split(inner_state)
  except (ValueError, TypeError) as e:
    raise ValueError(
      "offload: the gradients' tree structure does not match the tree the optimizer state was "
      f"initialised with ({e}). Pass gradients with the same structure as the params given to "
      "tx.init."
    ) from None
  for path, want_shapes, got, tiers in zip(paths, setup.part_shapes, per_leaf, setup.array_tiers):
    got_shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(got)]
    want_shapes = [(0,) if t is plan_lib.Tier.NVME else w for w, t in zip(want_shapes, tiers)]
    if want_shapes != got_shapes:
      raise ValueError(
        f"offload: gradient leaf {path} does not match the optimizer state: its state has shapes "
        f"{got_shapes} but a gradient of this shape needs {want_shapes}. Pass gradients with the "
        "same shapes as the params given to tx.init."
      )
  return shared, per_leaf


def _init_nvme(inner, setup: _Setup, generation: int, build_params, concrete) -> None:
  """Writes the initial NVMe-tier state group by group, so it never sits whole in memory."""
  layout, tier = setup.layout, setup.nvme
  for k in tier.groups:
    group = [i for i in setup.plan.groups[k] if plan_lib.Tier.NVME in setup.array_tiers[i]]

    def group_init(*c, group=group):
      params_tree = build_params(c)
      masked = layout.masked(layout.params_treedef.flatten_up_to(params_tree), group)
      return layout.unview(inner.init(masked), group)[1]

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
    return _to_space(x, HOST)
  if tier is plan_lib.Tier.NVME:
    return nvme_tier.placeholder(x)
  return x


def _to_space(tree: Any, space: jax.memory.Space) -> Any:
  """Moves every array not already in `space` (inside jit, an annotation; a no-op when equal)."""

  def move(x):
    if getattr(jax.typeof(x), "memory_space", None) == space:
      return x
    return jax.device_put(x, space)

  return jax.tree.map(move, tree)


def _windowed_update(
  inner, setup: _Setup, grads, shared, per_leaf, params, extra_args, generation, on_host
):
  """Runs the inner update group by group.

  With ``on_host=False`` each group's offloaded state goes through the device window: group k+1 is
  brought in (prefetch) while group k computes, but only after group k-1's new state has gone back
  to the host; an optimization barrier ties the two, so XLA cannot hoist every transfer to the
  start of the program. At most two groups' offloaded state is on the device at once.

  With ``on_host=True`` each group's update runs on the host (``compute_on("device_host")``) next to
  its state: the group's gradients and params go to the host, its updates come back, the state
  never crosses the link.

  NVMe-tier arrays come in and go out through one callback each per group; the store prefetches
  and writes behind on its own threads.
  """
  layout, groups, tiers, tier = setup.layout, setup.plan.groups, setup.array_tiers, setup.nvme
  compute_space = HOST if on_host else DEVICE
  # Threads the NVMe callbacks in program order: [generation read, generation written].
  token = tier.begin_traced(generation) if tier is not None else generation
  has_host = [plan_lib.Tier.HOST in t for t in tiers]

  def bring_in(k, parts, token):
    fetched = {}
    if tier is not None and k in tier.groups:
      fetched, token = tier.fetch(k, token)

    def load(t, j, x, i):
      x = fetched[(i, j)] if t is plan_lib.Tier.NVME else x
      return _to_space(x, compute_space)

    out = {
      i: _map_arrays(parts[i], tiers[i], lambda t, j, x, i=i: load(t, j, x, i)) for i in groups[k]
    }
    return out, token

  def send_out(k, parts, token):
    if tier is not None and k in tier.groups:
      token = tier.put(k, token, parts)

    def place(t, j, x):
      return _place_array(t, j, x) if t is not plan_lib.Tier.DEVICE else _to_space(x, DEVICE)

    return {i: _map_arrays(p, tiers[i], place) for i, p in parts.items()}, token

  def group_update(group, grads_, state_, params_):
    return inner.update(
      layout.masked(grads_, group),
      state_,
      None if params_ is None else layout.masked(params_, group),
      **extra_args,
    )

  shared_in = _to_space(shared, compute_space)
  new_shared, new_per_leaf, new_updates = None, {}, [None] * layout.num_leaves
  current, token = bring_in(0, per_leaf, token)
  sent_back: dict[int, Any] = {}  # previous group's new host parts
  for k, group in enumerate(groups):
    upcoming = None
    if k + 1 < len(groups):
      nxt = {i: per_leaf[i] for i in groups[k + 1]}
      if sent_back and not on_host:
        (nxt, token), sent_back = jax.lax.optimization_barrier(((nxt, token), sent_back))
        new_per_leaf.update(sent_back)
      upcoming, token = bring_in(k + 1, nxt, token)
    members = set(group)
    group_grads = [
      _to_space(g, compute_space) if i in members else None for i, g in enumerate(grads)
    ]
    group_params = None
    if params is not None:
      group_params = [
        _to_space(p, compute_space) if i in members else None for i, p in enumerate(params)
      ]
    state_view = layout.view(shared_in, current, group)
    if on_host:
      update = functools.partial(group_update, group)
      u, s = host_compute.run_on_host(update, group_grads, state_view, group_params)
      u = _to_space(u, DEVICE)
    else:
      u, s = group_update(group, group_grads, state_view, group_params)
    group_shared, group_parts = layout.unview(s, group)
    new_shared = _to_space(group_shared, DEVICE) if new_shared is None else new_shared
    for i, leaf in zip(group, layout.group_leaves(u, group)):
      new_updates[i] = leaf
    group_parts, token = send_out(k, group_parts, token)
    sent_back = {i: part for i, part in group_parts.items() if has_host[i]}
    new_per_leaf.update(group_parts)
    current = upcoming
  new_generation = tier.commit_traced(token) if tier is not None else generation
  new_per_leaf = [new_per_leaf[i] for i in range(layout.num_leaves)]
  return new_updates, new_shared, new_per_leaf, new_generation
