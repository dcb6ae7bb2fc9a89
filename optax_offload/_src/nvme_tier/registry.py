"""The open NVMe tiers of this process, by the id a state carries (``OffloadState.nvme_store``).

A state names its tier by an int32 id, not by a reference (state leaves are arrays). A tier
registers itself when it opens its store and stays registered (its store open, its directory
locked) until it is closed (`oo.close_nvme`), even when the `offload` transformation that made it
is gone: the states that name it stay usable. Updates, `footprint`, `to_inner` and checkpoints all
find a tier here. At interpreter exit each open tier waits for the updates in flight, then closes
(its store writes and commits what is queued).
"""

from __future__ import annotations

import atexit
import itertools
import logging
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

# Imported before `atexit.register` below: the store registers its own exit hook at import, and
# atexit runs hooks in reverse order, so `_close_open_tiers` runs before the stores' hook (and
# before JAX's, imported earlier still).
from optax_offload._src import nvme

if TYPE_CHECKING:
  from optax_offload._src.nvme_tier.tier import NvmeTier

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)
_OPEN: dict[int, NvmeTier] = {}
_CLOSED: dict[int, NvmeTier] = {}
"""Closed tiers, kept for inspection only (`footprint` and `tiers` of a state after `close_nvme`:
its files stay on disk)."""

EXIT_WAIT_S = 60.0
"""At exit, how long a tier waits for updates in flight (begun, not yet committed) before closing."""


def register(tier: NvmeTier) -> int:
  """Registers an open tier; returns its id (what states carry)."""
  tier_id = next(_IDS)
  _OPEN[tier_id] = tier
  return tier_id


def unregister(tier_id: int) -> None:
  tier = _OPEN.pop(tier_id, None)
  if tier is not None:
    _CLOSED[tier_id] = tier


def get(tier_id: int) -> NvmeTier | None:
  """The open tier with this id, or None."""
  return _OPEN.get(tier_id)


def lookup(store_id: Any, *, closed_ok: bool = False) -> NvmeTier:
  """The open tier a state names by its ``nvme_store`` id (with `closed_ok`, a closed one too, for
  what its layout and size say: its store reads and writes nothing more).

  Raises:
    RuntimeError: no open tier has that id (closed, or made in another process).
  """
  key = int(np.asarray(store_id))
  tier = _OPEN.get(key) or (_CLOSED.get(key) if closed_ok else None)
  if tier is None:
    raise RuntimeError(
      f"The NVMe store {key} named by this state is closed or belongs to another process. "
      "Create the state with tx.init(params) of the offload transformation that owns the nvme_dir "
      "(restore checkpoints into such a state)."
    )
  return tier


@atexit.register
def _close_open_tiers() -> None:
  """Closes the tiers still open at interpreter exit, each once its updates in flight are committed.

  An update whose program is still running at exit gets its commit queued, and the store then
  writes and commits everything queued.
  """
  for tier in sorted(_OPEN.values(), key=lambda t: t.id, reverse=True):
    if not tier.rendezvous.wait_for_updates(EXIT_WAIT_S):
      logger.warning(
        "NVMe store %s: updates still running %.0f s after exit began; closing at the last commit.",
        tier.directory,
        EXIT_WAIT_S,
      )
    try:
      tier.close()
    except nvme.NvmeError as e:
      logger.error("NVMe store %s: error while closing at exit: %s", tier.directory, e)
