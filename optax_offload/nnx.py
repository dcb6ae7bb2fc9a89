"""Flax NNX with offloaded optimizer state: ``oo.nnx.Optimizer``, a drop-in for ``nnx.Optimizer``."""

from optax_offload._src.flax_nnx import Optimizer

__all__ = ("Optimizer",)
