"""Flax Linen with offloaded optimizer state: ``oo.linen.TrainState``, a drop-in for Flax's."""

from optax_offload._src.flax_linen import TrainState

__all__ = ("TrainState",)
