"""Inspecting and managing offloaded state from outside `jax.jit`.

Bytes per tier (`footprint`), the tier of every array (`tiers`), the plain inner state
(`to_inner`) and the master weights (`master_params`); waiting for and closing a state's NVMe
store (`sync_nvme`, `close_nvme`). Reads states (`state.OffloadState`) without the transformation
that made them; NVMe-tier data through the tier the state names (`nvme_tier.lookup`).
"""

from __future__ import annotations

from typing import Any

import jax

from optax_offload._src import compress
from optax_offload._src import master as master_lib
from optax_offload._src import memory
from optax_offload._src import nvme_tier
from optax_offload._src.state import OffloadState


def _is_offload_state(x: Any) -> bool:
  return isinstance(x, OffloadState)


def footprint(state: Any) -> dict[str, int]:
  """Bytes of a state per tier, as held by this process.

  Works on an `OffloadState` or any tree containing one (an `optax.chain` state, `MultiSteps`, a Flax
  optimizer's state). Sharded arrays count the shards this process holds; a replicated array counts
  once per local device that holds a copy.

  Args:
    state: a concrete optimizer state.

  Returns:
    ``{"device": bytes, "host": bytes, "nvme": bytes}``.

  Raises:
    TypeError: when called on traced values (inside `jax.jit`).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_offload as oo
    >>> state = oo.offload(optax.sgd(0.1, momentum=0.9)).init({"w": jnp.zeros((100, 100))})
    >>> oo.footprint(state)
    {'device': 8, 'host': 40000, 'nvme': 0}
  """
  totals = {"device": 0, "host": 0, "nvme": 0}
  for leaf in jax.tree.leaves(state):
    if isinstance(leaf, jax.core.Tracer):
      raise TypeError("footprint needs a concrete state; call it outside jax.jit.")
    if not isinstance(leaf, jax.Array):
      continue
    nbytes = sum(shard.data.nbytes for shard in leaf.addressable_shards)
    totals["host" if memory.kind_is_host(leaf.sharding) else "device"] += nbytes
  for s in _offload_states(state):
    if int(s.nvme_store) >= 0:
      totals["nvme"] += nvme_tier.lookup(s.nvme_store, closed_ok=True).bytes()
  return totals


def tiers(state: Any) -> Any:
  """Where each array of a state rests between steps: ``"device"``, ``"host"`` or ``"nvme"``.

  An NVMe-tier array is held in the state as an empty placeholder (its data is in the store), whose
  own ``sharding.memory_kind`` says ``"device"``; this view names its tier. An `OffloadState`'s
  ``nvme_store`` and ``nvme_generation`` (ids, not state) are None in it. Arrays outside
  `OffloadState`s (a clipping state in a chain, `optax.MultiSteps` accumulators) are named by their
  memory kind.

  Args:
    state: a concrete optimizer state: an `OffloadState` or any tree containing some. For Flax NNX,
      pass ``nnx.as_pure(optimizer.opt_state)``.

  Returns:
    A tree of the state's structure with a string in place of each `jax.Array`.

  Raises:
    TypeError: when called on traced values (inside `jax.jit`).

  Examples:
    >>> import tempfile, jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"w": jnp.zeros((256, 64)), "v": jnp.zeros((64, 128)), "b": jnp.zeros(64)}
    >>> tx = oo.offload(optax.adam(1e-3), host_limit="64KiB", nvme_dir=tempfile.mkdtemp())
    >>> state = tx.init(params)
    >>> oo.tiers(state).inner[0].mu
    {'b': 'device', 'v': 'host', 'w': 'nvme'}
    >>> state.inner[0].mu["w"].shape, state.inner[0].mu["w"].sharding.memory_kind
    ((0,), 'device')
    >>> oo.close_nvme(state)
  """

  def of_array(x):
    if isinstance(x, jax.core.Tracer):
      raise TypeError("tiers needs a concrete state; call it outside jax.jit.")
    if not isinstance(x, jax.Array):
      return x
    return "host" if memory.kind_is_host(x.sharding) else "device"

  def of_state(s: OffloadState) -> OffloadState:
    named = jax.tree.map(of_array, s.inner)
    named = s._replace(inner=named, nvme_store=None, nvme_generation=None)  # ids, not tiered state
    if int(s.nvme_store) < 0:
      return named
    tier = nvme_tier.lookup(s.nvme_store, closed_ok=True)
    return named._replace(inner=tier.replace_arrays(named.inner, lambda key, x: "nvme"))

  return jax.tree.map(
    lambda x: of_state(x) if _is_offload_state(x) else of_array(x),
    state,
    is_leaf=_is_offload_state,
  )


def _materialized(state: OffloadState) -> Any:
  if int(state.nvme_store) < 0:
    return state.inner
  return nvme_tier.lookup(state.nvme_store).materialize(state.inner, state.nvme_generation)


def master_params(state: Any) -> Any:
  """The master weights held by an `offload(..., master_dtype=...)` state.

  Returns a params-structured tree with the master copy where the param is narrower than the
  master dtype, and None elsewhere (NVMe-tier masters are read from the store).

  Raises:
    ValueError: when the state holds no master weights.
  """
  states = _offload_states(state)
  if len(states) != 1 or not isinstance(states[0].inner, master_lib.MasterState):
    raise ValueError(
      "master_params needs a state of offload(..., master_dtype=...) (exactly one in the tree)."
    )
  return _materialized(states[0]).master


def _offload_states(tree: Any) -> list[OffloadState]:
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_offload_state) if _is_offload_state(x)]


def to_inner(state: Any, *, memory_kind: str | None = None) -> Any:
  """The plain inner optimizer state of an offloaded state.

  Every `OffloadState` in the tree is replaced by its inner state (without master weights), so the
  state of
  ``optax.chain(clip, offload(adamw))`` becomes a state of ``optax.chain(clip, adamw)``. Moments
  kept 8-bit (``moment_dtype="int8"``) are read back to fp32 (`compress.dequantize`);
  bf16 moments stay bf16.

  Args:
    state: an `OffloadState` or a tree containing some. NVMe-tier parts are read from the store
      (the generation the state names), checksums verified.
    memory_kind: None keeps each array where it is; ``"device"`` moves all to device memory (to
      continue with the plain optimizer), ``"pinned_host"`` all to host memory.

  Returns:
    The plain state.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"w": jnp.ones((100, 100))}
    >>> state = oo.offload(optax.adam(0.1)).init(params)
    >>> plain = oo.to_inner(state, memory_kind="device")
    >>> plain[0].mu["w"].sharding.memory_kind
    'device'
  """

  if memory_kind not in (None, "device", "pinned_host"):
    raise ValueError(
      f"to_inner: memory_kind={memory_kind!r}; pass None (each array where it is), 'device' or "
      "'pinned_host' (host memory)."
    )

  def unwrap(x):
    if not _is_offload_state(x):
      return x
    inner = _materialized(x)
    inner = inner.inner if isinstance(inner, master_lib.MasterState) else inner
    return compress.dequantized(inner)  # moment_dtype="int8": the moments read back

  plain = jax.tree.map(unwrap, state, is_leaf=_is_offload_state)
  if memory_kind is None:
    return plain
  return jax.tree.map(
    lambda x: (
      jax.device_put(x, x.sharding.with_memory_kind(memory_kind)) if isinstance(x, jax.Array) else x
    ),
    plain,
  )


def sync_nvme(state: Any) -> None:
  """Blocks until every NVMe write and commit queued by updates of `state` is durable.

  Background write errors (disk full, I/O errors) are raised here, naming the leaf and the file.
  A no-op for states without an NVMe tier, and for a tier closed in this process (`close_nvme`
  made it durable).
  """
  for s in _offload_states(state):
    if int(s.nvme_store) >= 0:
      tier = nvme_tier.lookup(s.nvme_store, closed_ok=True)
      if not tier.closed:
        tier.sync()


def close_nvme(state: Any) -> None:
  """Waits for pending NVMe writes, stops the store's threads and releases its directory lock.

  The state can no longer be updated afterwards; a new ``tx.init`` opens the directory again.
  Closing again (this state, or another of the same tier) does nothing.
  """
  for s in _offload_states(state):
    if int(s.nvme_store) >= 0:
      nvme_tier.lookup(s.nvme_store, closed_ok=True).close()
