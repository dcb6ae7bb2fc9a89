"""Joining the NVMe callbacks of one process's devices into one store operation each."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

from optax_offload._src import nvme


class Rendezvous:
  """Joins the callbacks of this process's devices into one store operation each.

  Every device of the mesh runs each callback of the update with its own shards. The first device
  to fetch a group reads it (from the prefetch pool) for all; the last device to put a group hands
  the group to the store; the last to commit commits; the generation an update writes is allocated
  once per update. A device that runs ahead waits for the others' puts before it reads what they
  put. A failure in one device's callback is re-raised in the others'.
  """

  def __init__(self, store: nvme.NvmeStore, devices: int):
    self.store, self.devices = store, devices
    self._cond = threading.Condition()
    self._begins: collections.Counter[int] = collections.Counter()  # device -> updates begun
    self._children: dict[int, list[Any]] = {}  # update number -> [generation, devices left]
    self._fetch_counts: collections.Counter[tuple[int, int]] = collections.Counter()
    self._fetched: dict[
      tuple[int, int], list[Any]
    ] = {}  # (group, n) -> [arrays by name, devices left]
    self._puts: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    self._putting: set[tuple[int, int]] = set()
    self._commits: collections.Counter[int] = collections.Counter()
    self._in_flight: set[int] = set()  # generations begun and not yet committed
    self._error: BaseException | None = None

  def _check(self) -> None:
    if self._error is not None:
      raise RuntimeError(f"NVMe tier: another device's callback failed: {self._error}")

  def _fail(self, error: BaseException) -> None:
    with self._cond:
      self._error = self._error or error
      self._cond.notify_all()

  def begin(self, device: int, parent: int) -> int:
    with self._cond:
      self._check()
      n = self._begins[device]
      if n not in self._children:
        # Raises for a stale parent before anything is counted: every device refuses alike, and
        # the next update starts afresh.
        self._children[n] = [self.store.new_generation(parent=parent), self.devices]
        self._in_flight.add(self._children[n][0])
      self._begins[device] += 1
      entry = self._children[n]
      entry[1] -= 1
      if entry[1] == 0:
        del self._children[n]
      return entry[0]

  def fetch(
    self, device: int, group: int, generation: int, names: Sequence[str], then=None
  ) -> dict[str, Any]:
    """The group's arrays by name (one store fetch for all devices); `then`: `NvmeStore.fetch`'s."""
    key = (group, generation)
    with self._cond:
      # The n-th fetch of a group by each device is one store fetch (an update fetches each once).
      n = self._fetch_counts[(device, group)]
      self._fetch_counts[(device, group)] += 1
      while True:
        self._check()
        entry = self._fetched.get((group, n))
        if entry is not None:
          reader = False
          break
        if key not in self._puts and key not in self._putting:  # wait for what others still put
          entry = self._fetched[(group, n)] = [None, self.devices]
          reader = True
          break
        self._cond.wait()
      while not reader and entry[0] is None:
        self._cond.wait()
        self._check()
    if reader:
      try:
        arrays = self.store.fetch(group, generation, then)
      except BaseException as e:
        self._fail(e)
        raise
      with self._cond:
        entry[0] = dict(zip(names, arrays))
        self._cond.notify_all()
    with self._cond:
      entry[1] -= 1
      if entry[1] == 0:
        del self._fetched[(group, n)]
      return entry[0]

  def put(self, device: int, group: int, generation: int, arrays: dict[str, Any], names) -> None:
    key = (group, generation)
    with self._cond:
      self._check()
      puts = self._puts.setdefault(key, {})
      puts[device] = arrays
      if len(puts) < self.devices:
        return
      del self._puts[key]
      self._putting.add(key)
    merged: dict[str, Any] = {}
    for arrays_of_device in puts.values():
      for name, array in arrays_of_device.items():
        merged.setdefault(name, array)
    try:
      self.store.put(group, generation, [merged[name] for name in names])
    except BaseException as e:
      self._fail(e)
      raise
    finally:
      with self._cond:
        self._putting.discard(key)
        self._cond.notify_all()

  def commit(self, device: int, generation: int, parent: int) -> None:
    with self._cond:
      self._check()
      self._commits[generation] += 1
      if self._commits[generation] < self.devices:
        return
      del self._commits[generation]
    try:
      self.store.commit(generation, parent=parent)
    except BaseException as e:
      self._fail(e)
      raise
    finally:
      with self._cond:
        # (with the older ones a failed step began: a newer commit means they never will be)
        self._in_flight = {g for g in self._in_flight if g > generation}
        self._cond.notify_all()

  def wait_for_updates(self, timeout: float) -> bool:
    """Waits until every update begun has queued its commit (or one failed); False on timeout."""
    deadline = time.monotonic() + timeout
    with self._cond:
      while self._in_flight and self._error is None:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
    return True
