"""`offload(host_memory=...)`: the run's pinned host memory in all, planned at init.

`HostMemory.plan` asks `estimate` what the params (their shapes and shardings) need beside the
state (the stack's weights, its whole gradients or accumulators, the NVMe tier's buffers) and
gives the state the rest, less what other live arrays and other planned offloads already take.
The `check_*` functions refuse, where the step is traced, what the plan did not count.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_offload._src import measure
from optax_offload._src import memory
from optax_offload._src import nvme_stack
from optax_offload._src import units
from optax_offload._src.nvme_tier import shards

logger = logging.getLogger(__name__)

_PLANNED: weakref.WeakSet = weakref.WeakSet()
"""The live `HostMemory` plans of this process (their reservations that are not arrays yet)."""


@dataclasses.dataclass(eq=False)
class HostMemory:
  """The budget and the step one `offload(host_memory=...)` plans for; `planned` once init ran.

  Attributes:
    budget: the run's pinned host memory in all, in bytes.
    accumulate: ``value_and_update``'s micro-batches per step.
    accumulator_dtype: their accumulators' dtype.
    plan_options: `estimate`'s arguments from offload's (optimizer, dtypes, update_on, ...).
    planned: `estimate`'s plan made at init (None before).
    reserved: bytes the plan holds beyond the arrays that exist at init (the stack's whole
      gradients, accumulators, NVMe buffers): other offloads planned later leave them out.
    whole_gradients_need: where the plan updates the stack in the backward pass without
      accumulating, a function giving the least host memory (bytes) a step with its whole
      gradients needs (for the refusals' advice; planned only when a refusal names it).
  """

  budget: int
  accumulate: int = 1
  accumulator_dtype: Any = jnp.float32
  plan_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  planned: Any = None
  reserved: int = 0
  whole_gradients_need: Callable[[], int] | None = None

  def plan(self, params, abstract: Any, window_bytes: int, nvme_dir):
    """`estimate`'s plan for `abstract` (the params' shapes and shardings; `params` the arrays
    given to init, or the same abstract values) within `budget`, less what other arrays in
    pinned host memory and other planned offloads hold. ValueError with the plan's advice where
    the host or the disk is short (the device is not checked: offload does not know the
    activations); NotImplementedError for what it cannot plan."""
    from optax_offload._src import estimate  # estimate imports offload, which imports this
    from optax_offload._src import nvme_tier

    plan_options = dict(self.plan_options, window_bytes=window_bytes)
    proc_dir = None if nvme_dir is None else nvme_tier.process_directory(nvme_dir)

    leaves = jax.tree.leaves(abstract)
    # A layer stack on NVMe (`write_nvme_stack`'s leaves in `params`) is planned there: its
    # weights hold no pinned host memory between steps.
    disk = [nvme_stack.is_leaf(x) for x in jax.tree.leaves(params, is_leaf=nvme_stack.is_leaf)]
    if any(disk):
      plan_options["weights_on"] = "nvme"
    on_host = [x for x, d in zip(leaves, disk) if estimate._in_pinned_host(x) and not d]
    held = sum(memory.held_bytes(x) for x in on_host)
    if any(map(_replicated_here, on_host)):
      raise NotImplementedError(
        "offload(host_memory=...): a leaf of the params in pinned host memory is replicated on "
        "several of this process's devices, which the plan does not count; shard the layer "
        "stack (or keep one device per process), or pass "
        "host_limit=oo.estimate(...).host_bytes and leave room for the copies."
      )
    # Live arrays beside the params: another offload's state, a copy of the params. Abstract
    # params (`abstract_state`) may describe live arrays: those of their shapes count out once.
    concrete = any(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    described = [] if concrete else _live_described(on_host)
    other = memory.pinned_host_bytes(exclude=[params, described])
    other += sum(p.reserved for p in _PLANNED if p is not self)
    # Accumulators of a device stack: on the device; of a stack on NVMe: in pinned host memory.
    accumulate = self.accumulate if on_host or any(disk) else 1
    room = max(self.budget - other, 0)
    taken = (
      f" ({units.format_bytes(other)} of it already held by other arrays in pinned host memory "
      "or reserved by other offloads)"
      if other
      else ""
    )
    beside = f"; its figures are for what is left: add {units.format_bytes(other)} to them"
    shared = ""
    if jax.process_count() > 1:
      share, shared = _disk_share(nvme_dir)
      if share is not None:
        plan_options["nvme_size"] = share
        logger.info("offload: host_memory: NVMe tier%s", shared)

    def plan_with(note: str = "", **limits):
      """`estimate`'s plan, and the refusal of its shortfalls (None where it fits), after
      `note`."""
      e = estimate.estimate(
        abstract,
        accumulate=accumulate,
        accumulator_dtype=self.accumulator_dtype,
        nvme_dir=nvme_dir,
        **limits,
        **plan_options,
      )
      short = [f for f in e.shortfalls if f.tier == "host" or _short_of_disk(f, proc_dir)]
      if not short:
        return e, None
      return e, (
        f"offload: {note}host_memory {units.format_bytes(self.budget)}{taken} does not fit this "
        f"model's plan (in the plan command's flags: --host-memory is host_memory"
        f"{beside if other else ''}): "
        + " ".join(f"{f.tier}{shared if f.tier == 'nvme' else ''}: {f.advice}" for f in short)
      )

    if jax.process_count() == 1:
      e, refusal = plan_with(host_memory=room)
    else:
      e, refusal = _plan_alike(plan_with, room)
    if refusal is not None:
      raise ValueError(refusal)
    self.whole_gradients_need = None
    if e.weights_on == "host" and e.update_in_backward and self.accumulate == 1:
      # What a step holding the stack's gradients whole would need: the least host memory of
      # that plan (all the state on NVMe), for the refusals' advice.
      self.whole_gradients_need = lambda: (
        other
        + estimate.estimate(
          abstract, host_limit=0, update_in_backward=False, nvme_dir=nvme_dir, **plan_options
        ).host_total_bytes
      )
    self.planned, self.reserved = e, max(e.host_total_bytes - e.host_bytes - held, 0)
    _PLANNED.add(self)
    logger.info(
      "offload: host_memory %s%s: %s of offloaded state in host memory, the rest (%s) on NVMe",
      units.format_bytes(self.budget),
      taken,
      units.format_bytes(e.host_bytes),
      units.format_bytes(e.nvme_bytes),
    )
    return e

  def stack_planned(self) -> bool:
    """Whether init planned a layer stack in pinned host memory (what the checks are about)."""
    return self.planned is not None and self.planned.weights_on == "host"

  def check_whole_gradients(self, what: str) -> None:
    """ValueError where the plan updates the stack in the backward pass (its gradients never
    whole) and `what` holds them whole, with what to give offload instead."""
    if not (self.stack_planned() and self.planned.update_in_backward):
      return
    if self.whole_gradients_need is None:  # accumulation: the backward pass accumulates them
      fix = "Train with oo.value_and_update without it."
    else:
      need = self.whole_gradients_need()
      fix = (
        "Train with oo.value_and_update without it, or give offload a host_memory of at least "
        f"{units.format_bytes(need)} ({need} bytes: "
        "the stack's weights and whole gradients and the NVMe buffers beside what other arrays "
        "hold, the state on NVMe)."
      )
    raise ValueError(
      "offload(host_memory=...) planned the layer stack's update inside the backward pass "
      "(oo.value_and_update), whose gradients are never whole, and gave their host memory to "
      f"the state; {what} holds the stack's gradients whole. {fix}"
    )

  def check_step(self, accumulate: int, accumulator_dtype) -> None:
    """ValueError unless `value_and_update`'s accumulators are those planned (their bytes do
    not depend on how many micro-batches: only whether there are any, and their dtype)."""
    if not self.stack_planned():
      return
    if (accumulate > 1) == (self.accumulate > 1) and (
      accumulate == 1 or jnp.dtype(accumulator_dtype) == jnp.dtype(self.accumulator_dtype)
    ):
      return
    planned = (
      f"accumulators in {jnp.dtype(self.accumulator_dtype)}"
      if self.accumulate > 1
      else "one micro-batch a step"
    )
    raise ValueError(
      f"value_and_update: offload(host_memory=...) planned {planned}, not accumulate="
      f"{accumulate}, accumulator_dtype={jnp.dtype(accumulator_dtype)}: the accumulators take "
      "host memory. Give offload the accumulate and accumulator_dtype of value_and_update."
    )


def _plan_alike(plan_with, room: int):
  """`plan_with`'s plan and refusal on every process of a multi-process run: each plans, then
  all plan with the least host bytes of offloaded state any of them found and check that their
  plans are the same; where one cannot, none goes on (`_agreed`)."""
  e, refusal = _planned_or_refused(plan_with, host_memory=room)
  least = int(_agreed([0 if e is None else e.host_bytes], refusal)[:, 0].min())
  if least < e.host_bytes:  # another process has less room: the same plan everywhere
    logger.info(
      "offload: host_memory: another process has room for %s of offloaded state in host "
      "memory, this one for %s; every process plans with the least",
      units.format_bytes(least),
      units.format_bytes(e.host_bytes),
    )
    note = (
      f"another process has room for only {units.format_bytes(least)} of offloaded state in "
      f"host memory, and every process plans the same: this one planned with host_limit={least}, "
      "and "
    )
    e, refusal = _planned_or_refused(plan_with, note, host_memory=room, host_limit=least)
  every = _agreed([0, 0] if e is None else [e.host_bytes, _fingerprint(e.plan)], refusal)
  if (every != every[0]).any():
    raise ValueError(
      "offload: host_memory: the processes plan different groups or tiers of offloaded "
      "state, and their update programs must be the same: give every process the same "
      "shards of the params (as many local devices each) and the same window_bytes."
    )
  return e, refusal


def set_up_alike(make: Callable[[], Any], close: Callable[[Any], None]) -> Any:
  """`make()` (the tree's setup: its NVMe store opened) on every process of a multi-process run,
  once they agreed on the plan: where it fails on one (its store directory locked, say), every
  process raises at once rather than waiting for that one in the next collective, those that
  made theirs `close` it. A collective where there are several processes."""
  if jax.process_count() == 1:
    return make()
  made, error = None, None
  try:
    made = make()
  except Exception as e:  # raised again by _agreed, on this process, as it is
    error = e
  try:
    _agreed([], error, failed="could not open its NVMe store (see its error)")
  except Exception:
    if made is not None:
      close(made)
    raise
  return made


def _disk_share(nvme_dir) -> tuple[int | None, str]:
  """This process's share of the free space of its `nvme_dir`'s file system, and a note saying
  so, where other processes of this run on this machine keep their NVMe tier there too (None
  and "" where none does, or without `nvme_dir`). A collective: every process of a
  multi-process run calls it once, with or without a `nvme_dir`; an error reading the file
  system stops every process (`_agreed`)."""
  mine, free, error = 0, 0, None
  if nvme_dir is not None:
    try:  # a name of the file system; 0 is "none"
      mine = zlib.crc32(measure.file_system_id(nvme_dir).encode()) + 1
      free = measure.free_disk(nvme_dir)
    except Exception as e:  # raised again by _agreed, on this process, as it is
      error = e
  every = _agreed([mine], error)[:, 0]
  sharers = int((every == mine).sum()) if mine else 1
  if sharers == 1:
    return None, ""
  share = free // sharers
  return share, (
    f" ({sharers} processes of this run keep their NVMe tier on this machine's file system of "
    f"nvme_dir, with {units.format_bytes(free)} free: each plans with 1/{sharers} of it, "
    f"{units.format_bytes(share)}; the plan command with --nvme-size {share}B counts the same)"
  )


def _planned_or_refused(plan_with, *args, **limits):
  """`plan_with(**limits)`, any error it raises (an NVMe directory that cannot be created) kept
  as the refusal that `_agreed` raises, after the other processes learn of it."""
  try:
    return plan_with(*args, **limits)
  except Exception as e:  # raised again by _agreed, on this process, as it is
    return None, e


def _agreed(
  values: list[int],
  refusal: str | Exception | None,
  failed: str = "refused the host_memory plan (host memory or disk: see its error)",
) -> np.ndarray:
  """Every process's `values` (process, value): each process then plans with the least host
  bytes of offloaded state, and checks that the plans are the same, since the update is one
  program on every process and live arrays may leave one process less room than another. Every
  process raises where one is refused (the others saying that it `failed`), so that none waits
  in a collective for it. A collective: every process calls it, as often, with as many values."""
  from jax.experimental import multihost_utils

  mine = np.array([*values, refusal is not None], np.int64).view(np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size)
  every = every.view(np.int64)
  if isinstance(refusal, Exception):
    raise refusal
  if refusal is not None:
    raise ValueError(refusal)
  refused = [str(i) for i in np.flatnonzero(every[:, -1])]
  if refused:
    raise ValueError(
      f"offload: process{'es' if len(refused) > 1 else ''} {', '.join(refused)} {failed}; "
      "every process stops, so that none waits for it."
    )
  return every[:, :-1]


def _fingerprint(plan) -> int:
  """A checksum of a plan's tiers and groups, to compare across processes."""
  if plan is None:
    return 0
  return zlib.crc32(repr((plan.tiers, plan.units, plan.window_bytes)).encode())


def _replicated_here(x) -> bool:
  """Whether two of this process's devices hold the same shard of `x` (a replicated axis)."""
  number = shards.shard_regions(x.sharding, x.shape)[1]
  here = [number[d.id] for d in x.sharding.addressable_devices]
  return len(set(here)) < len(here)


def _live_described(abstract: list) -> list:
  """Live arrays in pinned host memory of the shapes and dtypes of `abstract` (one per leaf)."""
  wanted: dict[tuple, int] = {}
  for x in abstract:
    key = (tuple(x.shape), jnp.dtype(x.dtype))
    wanted[key] = wanted.get(key, 0) + 1
  found = []
  for a in jax.live_arrays():
    key = (tuple(a.shape), jnp.dtype(a.dtype))
    if wanted.get(key) and not a.is_deleted() and memory.is_pinned_host(a.sharding):
      wanted[key] -= 1
      found.append(a)
  return found


def _short_of_disk(shortfall, proc_dir) -> bool:
  """Whether an NVMe shortfall stands once the files a resumed store keeps (`proc_dir`, the
  store's directory) are counted as room: the store writes its next generations over them."""
  if shortfall.tier != "nvme":
    return False
  kept = 0
  for root, _, files in os.walk(proc_dir) if proc_dir is not None else ():
    for name in files:
      try:
        kept += os.lstat(os.path.join(root, name)).st_blocks * 512
      except OSError:
        pass
  return shortfall.needed > shortfall.available + kept
