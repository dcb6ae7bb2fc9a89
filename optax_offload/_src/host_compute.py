"""Running a function on the host, next to host-memory arrays: ``compute_on("device_host")``.

JAX types every array with a memory space and refuses an op whose operands sit in different
spaces. Inside a host computation that bites on constants: ``jnp.ones_like(x)`` or ``jnp.where``
on a host array builds a *device*-typed constant (optax's adafactor, adagrad, lamb, lars, sm3 all
do). `run_on_host` therefore traces the function on device-typed stand-ins (where every op is well
typed), then replays the jaxpr equation by equation on the host arrays inside
``compute_on("device_host")`` (`_compat.compute_on_host`: the context manager or the decorator
form, by jax version), moving any device-typed operand (a constant built inside) to host memory
before the op that mixes it in (and a numpy constant, e.g. `compress`'s lookup tables). The
arithmetic is the function's own; only placement changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_offload._src import _compat
from optax_offload._src.memory import HOST
from optax_offload._src.memory import space_of


def _is_numpy_const(x: Any) -> bool:
  """A numpy array captured as a constant (e.g. a lookup table): bound as a device array."""
  return isinstance(x, np.ndarray) and x.ndim > 0


def _replay(closed: _compat.ClosedJaxpr, *args: Any) -> list[Any]:
  jaxpr = closed.jaxpr
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, _compat.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, closed.consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    body = None
    if eqn.primitive.name in _compat.CALL_PRIMITIVES:
      body = next((p for p in eqn.params.values() if isinstance(p, _compat.ClosedJaxpr)), None)
    if body is not None:
      outvals = _replay(body, *invals)
    else:
      spaces = {space_of(x) for x in invals} - {None}
      if HOST in spaces and (len(spaces) > 1 or any(_is_numpy_const(x) for x in invals)):
        invals = [
          jax.device_put(x, HOST) if space_of(x) not in (None, HOST) or _is_numpy_const(x) else x
          for x in invals
        ]
      params = eqn.primitive.get_bind_params(eqn.params)
      outvals = eqn.primitive.bind(*invals, **params)
      if not eqn.primitive.multiple_results:
        outvals = [outvals]
    for v, val in zip(eqn.outvars, outvals):
      env[v] = val
  return [read(v) for v in jaxpr.outvars]


def run_on_host(fn: Callable[..., Any], *args: Any) -> Any:
  """Runs ``fn(*args)`` as a host computation, for arguments in host memory.

  Args:
    fn: a JAX-traceable function of pytrees of arrays.
    *args: its arguments, every array already in host memory (``jax.memory.Space.Host``).

  Returns:
    ``fn(*args)``; arrays computed from host inputs are host-typed.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.device_put(jnp.arange(4.0), jax.memory.Space.Host)
    >>> y = jax.jit(lambda x: run_on_host(lambda x: jnp.where(x > 1, jnp.ones_like(x), x), x))(x)
    >>> y.tolist(), y.sharding.memory_kind
    ([0.0, 1.0, 1.0, 1.0], 'pinned_host')
  """
  flat, treedef = jax.tree.flatten(args)
  stand_ins = [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in flat]
  closed, out_shape = jax.make_jaxpr(lambda *f: fn(*treedef.unflatten(f)), return_shape=True)(
    *stand_ins
  )
  out = _compat.compute_on_host(lambda *f: _replay(closed, *f))(*flat)
  return jax.tree.unflatten(jax.tree.structure(out_shape), out)
