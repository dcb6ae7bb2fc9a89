"""The state types of `offload`: what a training loop, a checkpoint and an inspection hold.

Low in the package on purpose: checkpoints (`checkpoint`) and inspection (`inspection`) read
states without importing the transformation that makes them (`offload`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax


class OffloadState(NamedTuple):
  """State of `offload`: the inner state, with large per-parameter parts in host memory."""

  inner: optax.OptState  # NVMe-tier parts are empty placeholders: their data is in the store
  nvme_store: jax.Array  # int32 scalar: id of the NVMe store holding NVMe-tier parts; -1: none
  nvme_generation: jax.Array  # int32 scalar: the store generation this state names; -1: none
