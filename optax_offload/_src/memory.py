"""Memory spaces: whether an array lives in device memory or in pinned host memory.

JAX says it twice. A concrete array's sharding has a *memory kind* (``"device"``,
``"pinned_host"``); every array, traced or concrete, has a *memory space* in its type
(``jax.typeof(x).memory_space``: `DEVICE` or `HOST`), which is what tracing sees and what an op
checks when it mixes operands (jax 0.10). The two can disagree: Orbax restores arrays with a
``pinned_host`` sharding and a device-typed type, and a `jax.ShapeDtypeStruct` with a
SingleDeviceSharding in pinned host memory traces as device memory. So traced code asks the type
(`space_of`, `in_host`) and placement code asks the sharding (`is_pinned_host`, `kind_is_host`).
"""

from __future__ import annotations

import math
from typing import Any

import jax

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device

HOST_KINDS = ("pinned_host", "unpinned_host")
"""Memory kinds of host memory (the GPU client offers only ``pinned_host``; the CPU client both)."""


def space_of(x: Any) -> jax.memory.Space | None:
  """The memory space in the type of a JAX array, traced or concrete; None for anything else.

  Examples:
    >>> import jax.numpy as jnp
    >>> space_of(jnp.ones(2)), space_of(jax.device_put(jnp.ones(2), HOST)), space_of(1.0)
    (MemorySpace.Device, MemorySpace.Host, None)
  """
  if not isinstance(x, jax.Array):  # tracers are jax.Arrays too
    return None
  return getattr(jax.typeof(x), "memory_space", None)


def in_host(x: Any) -> bool:
  """Whether a (traced or concrete) array's type says it lives in host memory."""
  return space_of(x) == HOST


def is_pinned_host(sharding: Any) -> bool:
  """Whether an array placed with `sharding` lives in pinned host memory (None: no sharding)."""
  return getattr(sharding, "memory_kind", None) == "pinned_host"


def kind_is_host(sharding: Any) -> bool:
  """Whether a concrete array's sharding puts it in host memory, pinned or not."""
  return getattr(sharding, "memory_kind", None) in HOST_KINDS


def on_explicit_axes(sharding: Any) -> bool:
  """Whether `sharding` is a NamedSharding over Explicit mesh axes (`jax.make_mesh`'s default),
  where an array's type carries its sharding."""
  mesh = getattr(sharding, "mesh", None)
  return jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())


def reshard_as(x: jax.Array, sharding: Any) -> jax.Array:
  """`x` resharded to `sharding` (a type's sharding) where that is on Explicit mesh axes and `x`'s
  type says otherwise: jax refuses an update, a loop carry or a result sharded otherwise there (a
  replicated array may even come without the mesh in its type). Elsewhere `x` as it is."""
  given = jax.typeof(x).sharding
  if on_explicit_axes(sharding) and (not on_explicit_axes(given) or given.spec != sharding.spec):
    x = jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, sharding.spec))
  return x


def replicated(
  sharding: jax.sharding.NamedSharding, memory_kind: str | None = None
) -> jax.sharding.NamedSharding:
  """A whole copy on each device of `sharding`'s mesh (an empty PartitionSpec), in `memory_kind`
  (None: the default memory kind)."""
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind
  )


def to_space(tree: Any, space: jax.memory.Space) -> Any:
  """Every array of `tree` moved to `space` (inside `jax.jit`: a copy between memories)."""
  return jax.tree.map(lambda a: jax.device_put(a, space), tree)


def to_pinned_host(tree: Any) -> Any:
  """Places every leaf of `tree` in pinned host memory, keeping its sharding otherwise.

  Arrays go to ``x.sharding.with_memory_kind("pinned_host")``; inside `jax.jit`, leaves are moved
  with ``jax.device_put(x, jax.memory.Space.Host)``.

  Examples:
    >>> import jax.numpy as jnp, optax_offload as oo
    >>> stack = oo.to_pinned_host({"w": jnp.ones((4, 8, 8))})
    >>> stack["w"].sharding.memory_kind
    'pinned_host'
  """

  def put(x):
    # jax.core.Tracer is public (see _compat's table); this module imports nothing of ours.
    if isinstance(x, jax.core.Tracer) or not hasattr(x, "sharding"):
      return jax.device_put(x, HOST)
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))

  return jax.tree.map(put, tree)


def held_bytes(x: Any) -> int:
  """Bytes an array (or `jax.ShapeDtypeStruct`) takes in this process: one buffer of its shard
  on each of its addressable devices (its whole size without a sharding)."""
  sharding = getattr(x, "sharding", None)
  itemsize = x.dtype.itemsize
  if sharding is None:
    return itemsize * int(math.prod(x.shape))
  shard = sharding.shard_shape(x.shape)
  return len(sharding.addressable_devices) * itemsize * int(math.prod(shard))


def pinned_host_bytes(exclude: Any = ()) -> int:
  """Bytes of this process's live arrays in pinned host memory (`held_bytes`), less those of the
  arrays in `exclude` (a tree).

  Examples:
    >>> import jax.numpy as jnp
    >>> x = to_pinned_host(jnp.ones(1024))
    >>> pinned_host_bytes() - pinned_host_bytes(exclude=[x])
    4096
  """
  skip = {id(a) for a in jax.tree.leaves(exclude)}
  return sum(
    held_bytes(a)
    for a in jax.live_arrays()
    if id(a) not in skip and not a.is_deleted() and is_pinned_host(a.sharding)
  )
