"""A key of a transformation (a tree of callables) by what it is built from, not by its identity.

``optax.adamw(1e-2)`` built twice gives two transformations with the same code and equal values in
their closures: `closure_key` gives both one key, so that what was learned about the first (the
separability check, the split probes: `separable`) holds for the second without tracing it.

Only code of optax, optax_offload, jax, jaxlib and numpy enters (a function by the module of its
globals, which ``functools.wraps`` does not change), as its code object (by identity), its
defaults, its closure's contents and its attributes: their modules' globals are taken not to
change (as ``jax.jit`` takes them). Code of any other module gives no key: what it reads (a global
a sweep sets, an object's attribute) may change between two builds alike. A ``functools.partial``
enters as its function and arguments; a bound method as its function and object; a jitted or
custom-derivative function as the functions it wraps; an instance of those packages' classes
(optax's ``WrappedSchedule``) as its class and attributes; tuples, lists, dicts and named tuples
as their items; scalars, strings, dtypes and arrays (numpy or jax, up to 1 MiB) as their values.
Those packages' classes and modules, builtins of theirs and pure ones of Python's (``abs``, ``math``,
``operator``), numpy ufuncs, loggers and jax arrays over 1 MiB (not read) enter by identity, kept
alive with the key so that their ids are not reused while it is kept. Anything else (an instance of
another class, a named tuple or enum of another module, a set, a larger numpy array, a tracer)
gives no key.

  >>> import optax
  >>> a, _ = closure_key(optax.adamw(1e-2))
  >>> b, _ = closure_key(optax.adamw(1e-2))
  >>> c, _ = closure_key(optax.adamw(1e-3))
  >>> a == b != c
  True
"""

from __future__ import annotations

import abc
import enum
import functools
import hashlib
import logging
import types
from typing import Any

import jax
import numpy as np

_MAX_NODES = 100_000
"""Objects walked at most: a callable built from more gets no key."""
_MAX_VALUE_BYTES = 2**20
"""Arrays, strings and bytes up to this size enter by value."""
_MAX_VALUE_BYTES_IN_ALL = 16 * 2**20
"""Bytes read by value at most in one key (beyond: jax arrays by identity, numpy arrays no key)."""

_TRUSTED = frozenset({"optax", "optax_offload", "jax", "jaxlib", "numpy"})
"""Packages whose code enters a key (their module globals taken not to change)."""
_PURE_MODULES = frozenset({"math", "operator", "_operator"})
"""Modules of builtin functions that read nothing but their arguments."""
_PURE_BUILTINS = frozenset(
  {"abs", "all", "any", "divmod", "len", "max", "min", "pow", "round", "sum"}
)
"""Python's builtins that read nothing but their arguments (not ``getattr``, ``eval``, ...)."""
_JITTED = type(jax.jit(lambda x: x))
"""The type of a ``jax.jit`` function."""
_HEAPTYPE = 1 << 9  # (Py_TPFLAGS_HEAPTYPE: a class made by a class statement)


def _package(module: Any) -> str:
  return str(module).partition(".")[0]


def _trusted(module: Any) -> bool:
  """Whether a module name is of `_TRUSTED`'s packages."""
  return _package(module) in _TRUSTED


def _library_class(kind: type) -> bool:
  """A class of the library's whose instances are plain Python objects: every class of its MRO
  made by a class statement of `_TRUSTED`'s packages, without slots (all its state in its
  ``__dict__``; not an extension type, as jaxlib's shardings or numpy's arrays are)."""
  return all(
    c is object
    or (
      _trusted(c.__module__)
      and type(c) in (type, abc.ABCMeta)
      and c.__flags__ & _HEAPTYPE
      and "__slots__" not in vars(c)
    )
    for c in kind.__mro__
  )


class _NoKey(Exception):
  pass


def closure_key(obj: Any) -> tuple[str | None, list[Any]]:
  """A sha256 of what `obj` is built from, with the objects it names by identity (keep them alive
  as long as the key); None (and no objects) where it has no key."""
  walk = _Walk()
  try:
    walk(obj)
  except Exception:  # _NoKey; or too deep (RecursionError), a repr refused (a huge int)
    return None, []
  return hashlib.sha256(repr(walk.out).encode()).hexdigest(), walk.held


class _Walk:
  """A preorder walk: each node's record says how many children follow (a container's length)."""

  def __init__(self):
    self.out: list[Any] = []
    self.seen: dict[int, int] = {}
    self.alive: list[Any] = []  # every node walked, so that the ids in `seen` stay the walk's
    self.held: list[Any] = []  # the nodes keyed by identity
    self.read = 0  # bytes read by value

  def ident(self, x: Any) -> tuple[str, int]:
    self.held.append(x)
    return ("id", id(x))

  def __call__(self, x: Any) -> None:
    if id(x) in self.seen:  # met before (shared, or a cycle)
      self.out.append(("seen", self.seen[id(x)]))
      return
    if len(self.seen) >= _MAX_NODES:
      raise _NoKey()
    self.seen[id(x)] = len(self.seen)
    self.alive.append(x)
    kind = type(x)
    if isinstance(x, jax.core.Tracer):
      raise _NoKey()
    if x is None or kind in (bool, int, float, complex):
      self.out.append((kind.__name__, repr(x)))
    elif kind in (str, bytes):
      big = len(x) > _MAX_VALUE_BYTES
      self.out.append((kind.__name__, self.ident(x) if big else repr(x)))
    elif isinstance(x, np.dtype):
      self.out.append(("dtype", repr(x)))
    elif kind is np.ndarray or isinstance(x, np.generic):
      if x.dtype.hasobject:  # (pointers)
        raise _NoKey()
      if self.too_big(x):
        raise _NoKey()  # (a numpy array may change in place)
      self.out.append(("numpy", self.value(x)))
    elif isinstance(x, jax.Array):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # (a typed PRNG key)
        raise _NoKey()
      if self.too_big(x):
        self.out.append(("jax", self.ident(x)))  # (not read: it cannot change)
      else:
        self.out.append(("jax", x.weak_type, self.value(x)))
    elif isinstance(x, enum.Enum) and _trusted(kind.__module__):
      self.out.append(("enum", self.ident(kind)))
      self(x.value)
    elif kind in (tuple, list, dict):
      self.out.append((kind.__name__, len(x)))
      for item in x.items() if kind is dict else x:
        self(item)
    elif isinstance(x, tuple) and hasattr(x, "_fields") and _trusted(kind.__module__):
      # (a named tuple of the library's: another's methods are other code)
      self.out.append(("named tuple", self.ident(kind), len(x)))
      for item in x:
        self(item)
    elif kind is functools.partial:
      self.out.append(("partial",))
      for item in (x.func, x.args, x.keywords):
        self(item)
    elif kind is types.MethodType:
      self.out.append(("method",))
      self(x.__func__)
      self(x.__self__)
    elif kind is types.FunctionType and _trusted(x.__globals__.get("__name__")):
      # (the module of its globals: ``functools.wraps`` may set another ``__module__``)
      self.out.append(("function", self.ident(x.__code__)))
      cells = [_cell(c) for c in x.__closure__ or ()]
      for item in (x.__defaults__, x.__kwdefaults__, cells, x.__dict__):
        self(item)
    elif kind is _JITTED:
      self.out.append(("jitted",))
      self(x.__wrapped__)
    elif isinstance(x, jax.custom_jvp):
      self.out.append(("custom_jvp", x.nondiff_argnums))
      self(x.fun)
      self(x.jvp)
    elif isinstance(x, jax.custom_vjp):
      self.out.append(("custom_vjp", x.nondiff_argnums))
      for item in (x.fun, x.fwd, x.bwd):
        self(item)
    elif kind is types.BuiltinFunctionType:
      owner = x.__self__
      if isinstance(owner, types.ModuleType) or owner is None:  # a module's function
        package = _package(x.__module__ or getattr(owner, "__name__", ""))
        if not (
          package in _TRUSTED
          or package in _PURE_MODULES
          or (package == "builtins" and x.__name__ in _PURE_BUILTINS)
        ):
          raise _NoKey()
        self.out.append(("builtin", self.ident(x)))
      else:  # a method of an object: the object's
        self.out.append(("builtin method", x.__name__, self.ident(type(owner))))
        self(owner)
    elif (
      isinstance(x, (np.ufunc, logging.Logger))
      or (isinstance(x, type) and _trusted(x.__module__))
      or (isinstance(x, types.ModuleType) and _trusted(x.__name__))
    ):
      self.out.append(("object", self.ident(x)))
    elif _library_class(kind) and hasattr(x, "__dict__"):  # e.g. optax's WrappedSchedule
      self.out.append(("instance", self.ident(kind)))
      self(vars(x))
    elif x is _EMPTY:
      self.out.append(("empty cell",))
    else:
      raise _NoKey()

  def too_big(self, x: Any) -> bool:
    """Whether an array is over `_MAX_VALUE_BYTES`, or would take the bytes read past
    `_MAX_VALUE_BYTES_IN_ALL`."""
    return x.nbytes > _MAX_VALUE_BYTES or self.read + x.nbytes > _MAX_VALUE_BYTES_IN_ALL

  def value(self, x: Any) -> tuple[str, tuple[int, ...], str]:
    """An array's dtype, shape and the sha256 of its bytes."""
    a = np.asarray(x)  # (a deleted array raises)
    self.read += a.nbytes
    return (repr(a.dtype), a.shape, hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())


_EMPTY = object()


def _cell(cell: Any) -> Any:
  try:
    return cell.cell_contents
  except ValueError:  # an empty cell
    return _EMPTY
