"""The implementation of `optax_offload`; see README.md here for which module does what."""
