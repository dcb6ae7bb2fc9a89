"""Optimizers known by name to `estimate` and ``python -m optax_offload plan``.

For a bare parameter count (no shapes), the bytes of an optimizer's state come from this table:
how many parameter-shaped state arrays it keeps per parameter. With shapes, `estimate` builds the
optimizer's state abstractly instead and the table only names the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax


@dataclasses.dataclass(frozen=True)
class NamedOptimizer:
  """An optimizer known by name: how to build it, and its per-parameter state for a bare count."""

  factory: Callable[[], optax.GradientTransformation]
  slots: int  # parameter-shaped state arrays per parameter leaf
  state: str  # what the slots are, for the report


OPTIMIZERS: dict[str, NamedOptimizer] = {
  "sgd": NamedOptimizer(lambda: optax.sgd(1e-3), 0, "no state"),
  "sgd-momentum": NamedOptimizer(lambda: optax.sgd(1e-3, momentum=0.9), 1, "momentum"),
  "adam": NamedOptimizer(lambda: optax.adam(1e-3), 2, "mu, nu"),
  "adamw": NamedOptimizer(lambda: optax.adamw(1e-3), 2, "mu, nu"),
  "nadam": NamedOptimizer(lambda: optax.nadam(1e-3), 2, "mu, nu"),
  "nadamw": NamedOptimizer(lambda: optax.nadamw(1e-3), 2, "mu, nu"),
  "adamax": NamedOptimizer(lambda: optax.adamax(1e-3), 2, "mu, nu"),
  "amsgrad": NamedOptimizer(lambda: optax.amsgrad(1e-3), 3, "mu, nu, nu_max"),
  "adabelief": NamedOptimizer(lambda: optax.adabelief(1e-3), 2, "mu, nu"),
  "lamb": NamedOptimizer(lambda: optax.lamb(1e-3), 2, "mu, nu"),
  "lion": NamedOptimizer(lambda: optax.lion(1e-3), 1, "mu"),
  "rmsprop": NamedOptimizer(lambda: optax.rmsprop(1e-3), 1, "nu"),
  "adagrad": NamedOptimizer(lambda: optax.adagrad(1e-3), 1, "sum of squares"),
  "lars": NamedOptimizer(lambda: optax.lars(1e-3), 1, "momentum"),
  # Factored second moments: a row and a column vector per matrix. Counted as no per-parameter
  # state for a bare count; pass shapes for the exact bytes.
  "adafactor": NamedOptimizer(lambda: optax.adafactor(1e-3), 0, "factored second moments"),
}
"""Optimizers known by name: optax's alias and its parameter-shaped state arrays per parameter."""


def lookup(optimizer: Any) -> tuple[str, NamedOptimizer | None]:
  """The optimizer's name and table entry; None for a custom optax transformation."""
  if isinstance(optimizer, str):
    key = optimizer.lower().replace("_", "-")
    key = {"momentum": "sgd-momentum"}.get(key, key)
    if key not in OPTIMIZERS:
      raise ValueError(f"Unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}.")
    return key, OPTIMIZERS[key]
  if isinstance(optimizer, optax.GradientTransformation):
    return "custom", None
  raise ValueError(
    f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or an optax transformation, got "
    f"{type(optimizer).__name__}."
  )
