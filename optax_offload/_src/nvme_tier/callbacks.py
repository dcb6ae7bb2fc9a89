"""The update's side of an NVMe tier: the callbacks a jitted update runs to move NVMe-tier arrays.

`stream.run` calls them in program order: `TracedTier.begin` (allocate the generation the update
writes), then per plan group with NVMe arrays `fetch` (its arrays of the parent generation, from the
prefetch pool) and `put` (its new arrays, to the write-behind thread), and last `commit`.

Each callback runs on every device of the mesh (`jax.shard_map`) and takes and returns a token,
``[parent, child, store]``: the generation the state names, the one this update writes, and the id
of the tier whose store holds them, so that the callbacks run in program order through data
dependencies. (Ordered io_callbacks would do the same, but JAX 0.10 fails to lower them in a jit
whose outputs carry memory kinds.) The child is a fresh generation number, not ``parent + 1``: an
update may start again from the same state (`optax.MultiSteps` computes every mini-step from the
state of the last real step). A `rendezvous.Rendezvous` joins the calls of one process's devices
into one store operation each, so in a jitted update each group with NVMe leaves costs one store
fetch (served from the prefetch pool) and one store put (written behind), and each update one
allocation and one commit of a generation.

How a callback moves the bytes depends on the platform the program is lowered for
(`_compat.per_platform_callback`). On a CPU it is a ``buffer_callback``: a fetch copies the store's
arrays straight into XLA's output buffers, and a put reads XLA's buffers in place and copies them
once into page-aligned buffers of the tier (reused step after step) that the store writes with
direct I/O without a staging copy. An ``io_callback`` instead copies every operand into a new
array (fresh pages, faulted in each step) and every result out of one (what that cost, measured:
``_src/nvme/README.md``, "The tier's callbacks on a CPU"). On a GPU a
``buffer_callback`` would hand the callback device buffers, so the program keeps ``io_callback``
there, unchanged.

A program keeps the tier it was traced with, but runs on the tier the state names (by its id in
the token): a state made by ``tx.init`` after `oo.close_nvme` names a new tier of the same layout,
and the same program serves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback
from jax.sharding import PartitionSpec as P

from optax_offload._src import _compat
from optax_offload._src import nvme
from optax_offload._src.nvme_tier import registry
from optax_offload._src.nvme_tier import shards as shards_lib
from optax_offload._src.nvme_tier import tier as tier_lib
from optax_offload._src.nvme_tier.tier import NvmeTier

_TOKEN = jax.ShapeDtypeStruct((3,), jnp.int32)
FETCH_SCOPE, PUT_SCOPE = "nvme_group_fetch", "nvme_group_put"
"""`jax.named_scope`s of a plan group's fetch and put (in their HLO ``op_name``): `oo.timeline`'s
``disk`` argument charges disk bytes to callbacks by name."""


class TracedTier:
  """The callbacks of the update, for a program traced with `tier`.

  Args:
    tier: the tier the update is traced with (its layout: groups, arrays, mesh).
  """

  def __init__(self, tier: NvmeTier):
    self.tier = tier

  @property
  def groups(self) -> dict[int, int]:
    """The plan groups that hold NVMe arrays (mapped to their store groups)."""
    return self.tier.groups

  def resolve(self, store_id: int) -> NvmeTier:
    """The tier a state names by its store id, for a program traced with this one.

    A jitted update keeps the tier it was traced with; a state made by ``tx.init`` after
    `close_nvme` names a new tier of the same layout, which the program then uses instead.
    """
    tier = registry.get(store_id)
    if tier is None and store_id == self.tier.id:
      return self.tier  # closed: `check_updatable` says so
    if tier is None:
      raise RuntimeError(
        f"offload: the NVMe store {store_id} named by this optimizer state is closed "
        "(oo.close_nvme) or belongs to another process, so the state can no longer be updated. "
        "Create a new state with tx.init(params), or restore a checkpoint into one "
        "(oo.OffloadRestore)." + tier_lib.DONATED
      )
    if tier is not self.tier and tier.signature() != self.tier.signature():
      raise ValueError(
        f"offload: this optimizer state's NVMe store {tier.store.directory} holds another layout "
        f"than the store {self.tier.store.directory} this update was traced with: the state was made "
        "by another offload transformation or for other params. Update it with the "
        "transformation whose tx.init made it."
      )
    return tier

  def _device(self, position: Any) -> int:
    return self.tier.mesh.devices[tuple(int(v) for v in np.asarray(position))].id

  def _shard_local(self, callback, result_shapes, out_specs, *args, in_specs, keeps=False):
    """Runs ``callback(device_id, *local_args)`` on every device of the mesh; returns its results.

    In a program lowered for a CPU the call is a `buffer_callback`: the callback reads numpy views
    of XLA's own buffers, and its results are copied straight into XLA's output buffers (one copy
    each way fewer than ``io_callback``, which copies its operands into new arrays and its results
    from them, and no fresh pages faulted for those copies). Elsewhere (a GPU) it stays an
    ``io_callback``, the program unchanged. `keeps`: the callback keeps its array arguments after
    the first (the token) past the call (a put, written behind); views of XLA's buffers are then
    copied into page-aligned buffers of the tier (`NvmeTier.host_copies`), which the store writes
    with direct I/O as they are. Such a callback is called as ``callback(device_id, tier, token,
    *local_args)`` with the tier the token names, looked up once for the copies and the callback.
    """
    mesh = self.tier.mesh
    single = not isinstance(result_shapes, (list, tuple))
    shapes = [result_shapes] if single else list(result_shapes)

    def call(device, xs, borrowed):
      if keeps:  # the tier the state names (the token): the put's, and the pool of its copies
        tier = self.resolve(int(np.asarray(xs[0])[2]))
        if borrowed:
          xs = [xs[0], *tier.host_copies(xs[1:])]
        out = callback(device, tier, *xs)
      else:
        out = callback(device, *xs)
      return [out] if single else out

    def on_cpu(device_of, *operands):
      def fill(ctx, outs, *buffers):
        del ctx
        xs = [_readonly(np.asarray(b)) for b in buffers]
        device, xs = device_of(xs)
        for i, (o, r) in enumerate(zip(outs, call(device, xs, True), strict=True)):
          o = np.asarray(o)
          r = np.asarray(r)
          if r.shape != o.shape or r.dtype != o.dtype:
            raise RuntimeError(
              f"NVMe tier callback: result {i} is {r.dtype}{list(r.shape)}, expected "
              f"{o.dtype}{list(o.shape)}."
            )
          np.copyto(o, r)

      return buffer_callback(fill, shapes, has_side_effect=True)(*operands)

    def elsewhere(device_of, *operands):
      def run(*xs):
        device, xs = device_of([np.asarray(x) for x in xs])
        return call(device, xs, False)

      return io_callback(run, shapes, *operands)

    def dispatch(device_of, *operands):
      out = _compat.per_platform_callback(
        lambda *o: on_cpu(device_of, *o), lambda *o: elsewhere(device_of, *o), shapes, *operands
      )
      return out[0] if single else out

    if mesh.size == 1:
      # No shard_map over a mesh of one device: values computed from its outputs would carry the
      # mesh in their types (``f32[..]({Auto: ('nvme_device',)})``), so each step's outputs would
      # differ in type from its inputs and a jitted step would compile again, twice.
      (device,) = mesh.devices.flat
      return dispatch(lambda xs: (device.id, xs), *args)

    def body(*local):
      position = jnp.stack([jax.lax.axis_index(a) for a in mesh.axis_names]).astype(jnp.int32)
      # numpy views, not jax.Arrays: indexing a jax.Array here would dispatch a computation to the
      # device that is running this callback, and deadlock.
      return dispatch(lambda xs: (self._device(xs[0]), xs[1:]), position, *local)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
      *args
    )

  def begin(self, generation: jax.Array, store: jax.Array | None = None) -> jax.Array:
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
      store = jnp.asarray(self.tier.id, jnp.int32)

    def _begin(device, parent, store):
      tier = self.resolve(int(store))
      tier.check_updatable(int(parent))
      try:
        child = tier.rendezvous.begin(device, int(parent))
      except nvme.StaleGenerationError as e:
        raise ValueError(
          f"offload: this optimizer state is stale: it names NVMe generation {int(parent)}, but "
          f"updates have moved on from it ({e}). Update the state the latest update returned (it "
          "is unaffected by this error), or restore a checkpoint into it with oo.OffloadRestore. "
          "An update may start only from the latest state or the one it was made from (as "
          "optax.MultiSteps does)." + tier_lib.DONATED
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
    sg = self.tier.groups[plan_group]
    members = [(self.tier.arrays[key], rows) for key, rows in self.tier.members[sg]]
    shapes = [jax.ShapeDtypeStruct(a.shard_shape(rows), a.dtype) for a, rows in members]

    def _fetch(device, token):
      tier = self.resolve(int(token[2]))
      arrays = tier.rendezvous.fetch(device, sg, int(token[0]), self.tier.names[sg])
      return [
        np.asarray(token),
        *[np.asarray(arrays[a.name(a.number[device], rows)]) for a, rows in members],
      ]

    out_specs = [P(), *[a.spec for a, _ in members]]
    with jax.named_scope(FETCH_SCOPE):  # the step-time model finds the disk reads by this name
      token, *flat = self._shard_local(_fetch, [_TOKEN, *shapes], out_specs, token, in_specs=(P(),))
    return dict(zip([key for key, _ in self.tier.members[sg]], flat)), token

  def put(self, plan_group: int, token: jax.Array, parts: Mapping[int, Any]) -> jax.Array:
    """Hands the group's new arrays (of the child generation) to the writer thread.

    `parts` holds, by leaf index, the state parts of the group's leaves, shaped as `fetch` returns
    them: a row slice's rows, or a whole leaf's arrays.
    """
    sg = self.tier.groups[plan_group]
    members = [(self.tier.arrays[key], rows) for key, rows in self.tier.members[sg]]

    def _put(device, tier, token, *shards):
      arrays = {a.name(a.number[device], rows): x for (a, rows), x in zip(members, shards)}
      tier.rendezvous.put(device, sg, int(token[1]), arrays, self.tier.names[sg])
      return np.asarray(token)

    flat = shards_lib.select(parts, [key for key, _ in self.tier.members[sg]])
    for (a, rows), x in zip(members, flat):
      want = a.shape if rows is None else (rows[1] - rows[0], *a.shape[1:])
      if tuple(jnp.shape(x)) != want:
        raise ValueError(
          f"NVMe tier put: NVMe array {a.key} of plan group {plan_group} has shape "
          f"{tuple(jnp.shape(x))}, expected {want} (rows {rows})."
        )
    with jax.named_scope(PUT_SCOPE):
      return self._shard_local(
        _put,
        _TOKEN,
        P(),
        token,
        *flat,
        in_specs=(P(), *[a.spec for a, _ in members]),
        keeps=True,
      )

  def commit(self, token: jax.Array) -> jax.Array:
    """Commits the child generation (once every device put its shards); returns its number."""

    def _commit(device, token):
      self.resolve(int(token[2])).rendezvous.commit(device, int(token[1]), int(token[0]))
      return np.asarray(token[1], np.int32)

    return self._shard_local(
      _commit, jax.ShapeDtypeStruct((), jnp.int32), P(), token, in_specs=(P(),)
    )


def _readonly(x: np.ndarray) -> np.ndarray:
  x.flags.writeable = False
  return x
