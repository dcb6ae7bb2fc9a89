"""Gradients born in host memory: each large gradient leaves the device inside the backward pass.

With ``update_on="host"`` the optimizer runs next to its state on the host, so the gradients of
offloaded leaves are only needed there. `value_and_grad_to_host` moves each one to pinned host
memory right after the backward pass computes it, so they never all sit on the device at once.

How: every large param goes through an identity ``custom_vjp`` that also takes a host-memory
*sink* of the param's shape. Its backward rule sends the param's cotangent to the sink (moving it
to the host) and none to the param. The gradient with respect to the sinks is the host-memory
gradient; the sinks' values are never read, so XLA drops them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from optax_offload._src.memory import HOST


@jax.custom_vjp
def _tap(param: jax.Array, sink: jax.Array) -> jax.Array:
  del sink
  return param


def _tap_fwd(param, sink):
  del sink
  return param, None


def _tap_bwd(_, cotangent):
  return None, jax.device_put(cotangent, HOST)


_tap.defvjp(_tap_fwd, _tap_bwd)


def value_and_grad_to_host(
  fun: Callable[..., Any], *, has_aux: bool = False, min_size: int = 4096
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad(fun)``, with large gradients moved to host inside the backward pass.

  Differentiates with respect to the first argument (a pytree of params). Gradients of leaves with
  at least `min_size` elements come out in pinned host memory (``jax.memory.Space.Host``), each
  moved right after it is computed; smaller ones stay on the device. Use it with
  ``offload(..., update_on="host")``, whose update takes host gradients as they are.

  Args:
    fun: ``fun(params, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with `has_aux`).
    has_aux: as in `jax.value_and_grad`.
    min_size: match `offload`'s `min_size`.

  Returns:
    A function with `fun`'s arguments returning ``(value, grads)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
    >>> loss = lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2)
    >>> value, grads = jax.jit(value_and_grad_to_host(loss))(params, jnp.ones((2, 64)))
    >>> grads["w"].sharding.memory_kind, grads["b"].sharding.memory_kind
    ('pinned_host', 'device')
  """

  def wrapped(params, *args, **kwargs):
    leaves, treedef = jax.tree.flatten(params)
    big = [jnp.size(p) >= min_size for p in leaves]
    # Never read: XLA removes them. Their type (host memory) is what the gradient takes.
    sinks = [jax.device_put(jnp.zeros_like(p), HOST) if b else None for p, b in zip(leaves, big)]

    def f(sinks, leaves):
      tapped = [_tap(p, s) if b else p for p, s, b in zip(leaves, sinks, big)]
      return fun(treedef.unflatten(tapped), *args, **kwargs)

    value, (host_grads, device_grads) = jax.value_and_grad(f, argnums=(0, 1), has_aux=has_aux)(
      sinks, leaves
    )
    grads = [h if b else d for h, d, b in zip(host_grads, device_grads, big)]
    return value, treedef.unflatten(grads)

  return wrapped
