"""Units a user types: parameter counts (``"7B"``), dtypes (``"bf16"``) and byte sizes (``"64GiB"``).

Pure parsing and naming, no JAX execution. `parse_bytes` and `format_bytes` still live in `plan` and
are re-exported here, so that callers can import every unit from one place until they move.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from optax_offload._src.plan import format_bytes
from optax_offload._src.plan import parse_bytes

__all__ = ("dtype_name", "format_bytes", "parse_bytes", "parse_count", "parse_dtype")

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


def dtype_name(dtype: np.dtype) -> str:
  """The short name of `dtype` in reports: ``"bf16"``, ``"fp32"``, ..., else numpy's name.

  Examples:
    >>> dtype_name(jnp.dtype(jnp.bfloat16)), dtype_name(jnp.dtype(jnp.int8))
    ('bf16', 'int8')
  """
  return _SHORT_DTYPE.get(dtype.name, dtype.name)
