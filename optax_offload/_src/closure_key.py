"""A key of a Python callable (or a tree of them) by what it is built from, not by its identity.

``optax.adamw(1e-2)`` built twice gives two transformations with the same code and equal values in
their closures: `closure_key` gives both one key, so that what was learned about the first (the
separability check, the split probes: `separable`) holds for the second without tracing it. A
function is its code object and globals (by identity), its defaults, its closure's contents and its
attributes; a ``functools.partial`` its function and arguments; tuples, lists and dicts their
items; scalars, strings, dtypes and arrays (numpy or jax, up to 1 MiB) their values. Any other
object (a larger array, a class, a builtin, a jitted function, an instance) enters by identity,
kept alive by the key's holder so that its id is not reused while the key is kept.

As with a transformation kept by identity, or a function that ``jax.jit`` caches, what the code
reads from mutable objects (module globals, an instance's attributes) is assumed not to change
between the calls one key serves.

  >>> import optax
  >>> a, _ = closure_key(optax.adamw(1e-2))
  >>> b, _ = closure_key(optax.adamw(1e-2))
  >>> c, _ = closure_key(optax.adamw(1e-3))
  >>> a == b != c
  True
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from typing import Any

import jax
import numpy as np

_MAX_NODES = 100_000
"""Objects walked at most: a callable closing over more gets no key."""
_MAX_VALUE_BYTES = 2**20
"""Arrays up to this size enter by value, larger ones by identity (not read: a jax array on the
device is not copied)."""


class _NoKey(Exception):
  pass


def closure_key(obj: Any) -> tuple[str | None, list[Any]]:
  """A sha256 of what `obj` is built from (None where it cannot be read: a tracer, an array numpy
  cannot read), with the objects it names by identity: keep them alive as long as the key."""
  held: list[Any] = []
  parts: list[Any] = []
  try:
    _walk(obj, parts, {}, held)
  except _NoKey:
    return None, []
  return hashlib.sha256(repr(parts).encode()).hexdigest(), held


def _ident(x: Any, held: list[Any]) -> tuple[str, int]:
  held.append(x)
  return ("id", id(x))


def _walk(x: Any, out: list[Any], seen: dict[int, int], held: list[Any]) -> None:
  if id(x) in seen:  # met before (shared, or a cycle)
    out.append(("seen", seen[id(x)]))
    return
  if len(seen) >= _MAX_NODES:
    raise _NoKey()
  seen[id(x)] = len(seen)
  held.append(x)  # (so that the ids in `seen` stay this walk's)
  kind = type(x)
  if x is None or kind in (bool, int, float, complex, str, bytes):
    out.append((kind.__name__, repr(x)))
  elif isinstance(x, np.dtype):
    out.append(("dtype", x.str, x.name))
  elif isinstance(x, (np.ndarray, np.generic, jax.Array)):
    if x.nbytes > _MAX_VALUE_BYTES:  # (not read: by identity)
      out.append(("large array", _ident(x, held)))
    else:
      out.append(("array", _value(x)))
  elif isinstance(x, enum.Enum):
    out.append(("enum", _ident(kind, held), x.name))
  elif kind in (tuple, list, dict) or (isinstance(x, tuple) and hasattr(x, "_fields")):
    out.append((kind.__name__, _ident(kind, held), len(x)))
    for item in x.items() if isinstance(x, dict) else x:
      _walk(item, out, seen, held)
  elif isinstance(x, functools.partial):
    out.append(("partial",))
    for item in (x.func, x.args, x.keywords):
      _walk(item, out, seen, held)
  elif isinstance(x, types.MethodType):
    out.append(("method",))
    _walk(x.__func__, out, seen, held)
    _walk(x.__self__, out, seen, held)
  elif isinstance(x, types.FunctionType):
    out.append(("function", _ident(x.__code__, held), _ident(x.__globals__, held)))
    cells = []
    for cell in x.__closure__ or ():
      try:
        cells.append(cell.cell_contents)
      except ValueError:  # an empty cell
        cells.append(_EMPTY)
    for item in (x.__defaults__, x.__kwdefaults__, cells, x.__dict__):
      _walk(item, out, seen, held)
  else:
    out.append(("object", _ident(x, held)))


_EMPTY = object()


def _value(x: Any) -> tuple[str, tuple[int, ...], str]:
  """An array's dtype, shape and the sha256 of its bytes."""
  if isinstance(x, jax.core.Tracer) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    raise _NoKey()
  try:
    a = np.asarray(x)
  except Exception as e:  # a deleted (donated) array
    raise _NoKey() from e
  return (a.dtype.str, a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
