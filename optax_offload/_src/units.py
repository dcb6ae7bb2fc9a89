"""Units a user types: parameter counts (``"7B"``), dtypes (``"bf16"``) and byte sizes (``"64GiB"``).

Pure parsing and naming, no JAX execution; also the checks of the options `offload` and `estimate`
share.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ("dtype_name", "format_bytes", "parse_bytes", "parse_count", "parse_dtype")

_UNITS = {
  "": 1,
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "TB": 10**12,
  "KIB": 2**10,
  "MIB": 2**20,
  "GIB": 2**30,
  "TIB": 2**40,
  "K": 2**10,
  "M": 2**20,
  "G": 2**30,
  "T": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

_DTYPES = {
  "fp32": "float32",
  "f32": "float32",
  "float32": "float32",
  "bf16": "bfloat16",
  "bfloat16": "bfloat16",
  "fp16": "float16",
  "f16": "float16",
  "float16": "float16",
  "fp64": "float64",
  "f64": "float64",
  "float64": "float64",
  "fp8": "float8_e4m3fn",
}
_SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def parse_count(value: int | float | str, name: str = "params") -> int:
  """Parses a parameter count such as ``7e9``, ``"7B"``, ``"1.3b"`` or ``"350M"``.

  Suffixes are decimal: K (thousand), M (million), B or G (billion), T (trillion). ``B`` means
  billions of parameters here, not bytes.

  Args:
    value: an int, a float or a string.
    name: the argument's name, for error messages.

  Returns:
    The count, at least 1.

  Raises:
    ValueError: for an unparseable or non-positive count.

  Examples:
    >>> parse_count("7B"), parse_count("350M"), parse_count(1.3e9), parse_count("7_000")
    (7000000000, 350000000, 1300000000, 7000)
  """
  if isinstance(value, bool) or not isinstance(value, int | float | str):
    raise ValueError(f"{name} must be a parameter count like 7e9 or '7B', got {value!r}.")
  if isinstance(value, str):
    match = _COUNT_RE.match(value.replace("_", "").replace(",", ""))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _COUNT_UNITS:
      raise ValueError(
        f"Could not parse {name}={value!r}: use a parameter count such as 7e9, 7B, 1.3B or 350M "
        "(K, M, B/G, T are thousands, millions, billions, trillions of parameters)."
      )
    value = float(match.group(1)) * _COUNT_UNITS[unit]
  count = round(value)
  if not math.isfinite(value) or count < 1:
    raise ValueError(f"{name} must be a positive parameter count, got {value!r}.")
  return count


def parse_master_dtype(value: Any) -> np.dtype | None:
  """The dtype of a master copy (`offload`'s and `estimate`'s ``master_dtype``): None, or a
  floating dtype as `parse_dtype` takes it; float64 only where JAX computes in it (x64).

  Examples:
    >>> parse_master_dtype("fp32"), parse_master_dtype(None)
    (dtype('float32'), None)
  """
  if value is None:
    return None
  master = parse_dtype(value, "master_dtype")
  if not jnp.issubdtype(master, jnp.floating):
    raise ValueError(f"master_dtype must be a floating dtype such as jnp.float32, got {master}.")
  if master.itemsize > 4 and not jax.config.jax_enable_x64:
    raise ValueError(
      f"master_dtype {master} needs jax_enable_x64: without it JAX computes in float32, and the "
      "copy would be a float32 one taking more memory. Use jnp.float32."
    )
  return master


def parse_dtype(value: Any, name: str = "param_dtype") -> np.dtype:
  """Parses a dtype given as ``"bf16"``, ``"fp32"``, ``jnp.bfloat16``, ... .

  Args:
    value: a short name (``"bf16"``, ``"fp32"``, ``"fp8"``, ...), a numpy dtype name, or a dtype.
    name: the argument's name, for error messages.

  Returns:
    The dtype.

  Raises:
    ValueError: for an unknown dtype.

  Examples:
    >>> parse_dtype("bf16"), parse_dtype(jnp.float32)
    (dtype(bfloat16), dtype('float32'))
  """
  if isinstance(value, str):
    value = _DTYPES.get(value.lower(), value)
  try:
    return jnp.dtype(value)
  except TypeError:
    raise ValueError(
      f"Unknown {name} {value!r}: use one of {', '.join(sorted(set(_DTYPES)))} or a numpy dtype name."
    ) from None


def check_accumulate(accumulate: Any) -> None:
  """ValueError unless `accumulate` (micro-batches per step) is an int >= 1."""
  if not (isinstance(accumulate, int) and accumulate >= 1):
    raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}.")


def parse_accumulator_dtype(value: Any) -> np.dtype:
  """Parses the dtype of gradient accumulators (``"fp32"``, ``"bf16"``, ``jnp.float32``, ...): a
  floating dtype.

  Raises:
    ValueError: for an unknown or a non-floating dtype.

  Examples:
    >>> parse_accumulator_dtype("bf16")
    dtype(bfloat16)
  """
  dtype = parse_dtype(value, "accumulator_dtype")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"accumulator_dtype must be a floating dtype (fp32 or bf16), got {dtype_name(dtype)}."
    )
  return dtype


def dtype_name(dtype: np.dtype) -> str:
  """The short name of `dtype` in reports: ``"bf16"``, ``"fp32"``, ..., else numpy's name.

  Examples:
    >>> dtype_name(jnp.dtype(jnp.bfloat16)), dtype_name(jnp.dtype(jnp.int8))
    ('bf16', 'int8')
  """
  return _SHORT_DTYPE.get(dtype.name, dtype.name)


def parse_bytes(value: int | str | None, name: str) -> int | None:
  """Parses a byte count given as an int or a string such as ``"64GiB"`` or ``"1.5 GB"``.

  Args:
    value: an int, a string with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; the
      bare K, M, G, T are binary like KiB, MiB, GiB, TiB, as in ``free -g``), or None.
    name: the argument's name, for error messages.

  Returns:
    The number of bytes, or None when `value` is None.

  Raises:
    ValueError: for a negative or unparseable value, a string without a unit under 1 MiB (a
      unit forgotten: ``"64"`` for 64 GiB), or a unit of bits (``"1Gb"``, ``"64mb"``).
    TypeError: for a value that is neither int, str nor None.

  Examples:
    >>> parse_bytes("64GiB", "host_limit")
    68719476736
    >>> parse_bytes("1.5 MB", "window_bytes")
    1500000
    >>> parse_bytes(4096, "window_bytes")
    4096
    >>> parse_bytes("64G", "host_limit") == parse_bytes("64GiB", "host_limit")
    True
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | str):
    raise TypeError(
      f"{name} must be an int number of bytes or a string like '64GiB', got {type(value).__name__}"
      f" ({value!r})."
    )
  if isinstance(value, int):
    if value < 0:
      raise ValueError(f"{name} must be >= 0 bytes, got {value}.")
    return value
  match = _SIZE_RE.match(value)
  unit = match.group(2).upper() if match else None
  if match and match.group(2).endswith("b") and unit in _UNITS:
    n = match.group(1)  # "1Gb" is a gigabit: taken as 1 GB, a size 8 times what was meant
    fix = f"'{n}B'" if unit == "B" else f"'{n}{unit[0]}B' or '{n}{unit[0]}iB'"
    raise ValueError(f"{name}={value!r}: a lowercase 'b' is bits; give bytes, e.g. {fix}.")
  if match is None or unit not in _UNITS:
    raise ValueError(
      f"Could not parse {name}={value!r}: use an int or a number with a unit, e.g. '64GiB', "
      f"'500MB' (units: {', '.join(u for u in _UNITS if u)})."
    )
  if unit == "" and 0 < float(match.group(1)) < 2**20:  # as `plan` refuses it: a unit forgotten
    n = match.group(1)
    raise ValueError(
      f"{name}={value!r}: a string without a unit is bytes; give a unit, e.g. '{n}GiB' (2**30 "
      f"bytes) or '{n}GB' (10**9), or pass an int for bytes."
    )
  return int(float(match.group(1)) * _UNITS[unit])


def expanded_path(path: str | os.PathLike, name: str) -> str:
  """`path` with a leading ``~`` expanded; ValueError for a ``$VAR`` in it, which Python does not
  expand either (taken as it is, it names a directory ``$HOME`` in the current one).

  Examples:
    >>> import os
    >>> expanded_path("~/run1", "nvme_dir") == os.path.join(os.path.expanduser("~"), "run1")
    True
    >>> expanded_path("$HOME/run1", "nvme_dir")
    Traceback (most recent call last):
    ...
    ValueError: nvme_dir='$HOME/run1' holds a variable Python does not expand: pass os.path.expandvars(...) of it, or the path itself.
  """
  path = os.path.expanduser(os.fspath(path))
  if re.search(r"\$(\w|\{)", path):
    raise ValueError(
      f"{name}={path!r} holds a variable Python does not expand: pass os.path.expandvars(...) of "
      "it, or the path itself."
    )
  return path


def format_bytes_up(n: int) -> str:
  """`format_bytes`, rounded up at the digits it shows: a size given back as shown is at least `n`
  (for advice such as "at least 18.28 GiB").

  Examples:
    >>> format_bytes_up(3 * 2**30 + 1), format_bytes(3 * 2**30 + 1)
    ('3.01 GiB', '3.00 GiB')
  """
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{math.ceil(n * 100 / size) / 100:.2f} {unit}"
  return f"{n} B"


def format_bytes(n: int) -> str:
  """Formats a byte count with a binary unit.

  Examples:
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(512)
    '512 B'
  """
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


UPDATE_ON = ("device", "host")


def check_options(update_on: str, min_size: Any, window_bytes: Any) -> int | None:
  """Checks the options `offload` and `estimate` share; returns the window in bytes (None: default).

  Raises:
    ValueError: for a bad value, naming it.
  """
  if update_on not in UPDATE_ON:
    raise ValueError(f"update_on must be one of {UPDATE_ON}, got {update_on!r}.")
  if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
    raise ValueError(f"min_size must be an int >= 0 (number of elements), got {min_size!r}.")
  window = parse_bytes(window_bytes, "window_bytes")
  if window == 0:
    raise ValueError("window_bytes must be > 0; pass None for the default.")
  return window
