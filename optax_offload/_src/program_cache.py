"""What `compile_for_gpu` read from a compiled GPU program, kept in JAX's compilation cache dir.

A compile-only client's executable does not go through JAX's persistent cache: `compile_for_gpu`
calls the client itself (`_compat.compile_for_topology`). Where JAX's cache is on (a local
``jax_compilation_cache_dir``, e.g. ``JAX_COMPILATION_CACHE_DIR``), this keeps what it read from
each program (the buffer assignment's bytes, the scheduled HLO text and XLA's compile time) in that
directory, one file per program, ``optax_offload_gpu-<sha256>-program``, gzipped JSON. The key is
what the compile reads, less the callers' Python frames: the lowered module with the names XLA
gives its operations (`module_key_text`), the target config's text, the serialized
compile options (with the XLA options given), ``XLA_FLAGS`` as this process first read it (XLA
reads it once, at start-up), and the versions of jax, jaxlib, the CUDA plugin and optax_offload.
An entry that cannot be read is a miss and is written again; entries are written to a temporary
file and renamed into place (one a killed writer left is removed an hour later). JAX's own size
bound (``jax_compilation_cache_max_size``) and minimum compile time do not apply to these files
(the test suite's cache tidying does); a remote cache directory (``gs://...``) is not used for
them.

Examples:
  >>> import tempfile
  >>> key = entry_key("module {}", "gpu_device_info {}", b"options")
  >>> with tempfile.TemporaryDirectory() as directory:
  ...   missed = load(directory, key)
  ...   store(directory, key, {"hlo": "HloModule m", "compile_seconds": 1.5})
  ...   missed, load(directory, key)
  (None, {'hlo': 'HloModule m', 'compile_seconds': 1.5})
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import tempfile
import time
import zlib
from typing import Any

import jax

FORMAT = "optax_offload gpu program 4"
"""Part of every key: a new one when `compile_for_gpu` changes how it compiles or what it keeps."""
SUFFIX = "-program"
"""Not JAX's ``-cache``: JAX's own eviction and tools leave these files alone."""


def directory() -> str | None:
  """JAX's persistent compilation cache directory, or None where the cache is off or remote."""
  path = jax.config.jax_compilation_cache_dir
  if not path or not jax.config.jax_enable_compilation_cache or "://" in str(path):
    return None
  return os.fspath(path)


@functools.cache
def _versions() -> str:
  names = sorted(  # a set: one distribution is found once per path that holds its metadata
    {
      f"{d.metadata['Name']}=={d.version}"
      for d in importlib.metadata.distributions()
      if (name := (d.metadata["Name"] or "").lower().replace("-", "_")).startswith("jax")
      or name == "optax_offload"
    }
  )
  return ";".join(names)


@functools.cache
def _xla_flags() -> str:
  """``XLA_FLAGS`` when this process first made a key: XLA reads it once, when it starts, and a
  later change does not reach the compiler (JAX's own cache key has the same limit)."""
  return os.environ.get("XLA_FLAGS", "")


_LOC_DEF = re.compile(r"^#(loc\d*) = loc\((.*)\)$")
_LOC_USE = re.compile(  # a string (left as it is), or a location of a form JAX writes in a line
  r'"(?:[^"\\]|\\.)*"'
  r'|loc\((#loc\d*|unknown|callsite\(#loc\d* at #loc\d*\)|"(?:[^"\\]|\\.)*"(?:\(#loc\d*\))?)\)'
)
_CALLSITE = re.compile(r"callsite\((#loc\d*) at #loc\d*\)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"(.*)$', re.S)


def module_key_text(debug_text: str) -> str:
  r"""The lowered module's text (``as_text(debug_info=True)``) with each location reduced to what
  XLA makes the operation's metadata of (``location_exporter.cc``): a name location is its name
  alone (XLA does not look below a name for ``op_name``; what is below, the Python traceback,
  reaches the compiled HLO only as its tables of source frames and ``stack_frame_id``s, which
  `GpuProgram.hlo` leaves out), a bare traceback (``callsite(...)``) its innermost frame's
  function name (XLA names the operation by it), an op type's name (ending in ``:`` before any
  ``@``, e.g. ``"scatter-add:"``: XLA's ``op_type``) is kept with what is below it, and an
  operation's own ``"file":line:col`` (which XLA writes as its ``source_file`` and
  ``source_line``) is kept. So the callers' frames leave the key (pytest and pytest-xdist call a
  test through other frames), and so do the frames JAX keeps in a jaxpr it traced once and
  reuses (a function's name there is that of whichever caller traced it first in the process).
  Strings (attributes, a Pallas kernel's serialized IR) are left as they are. Where a location
  has a form this does not know (``fused[...]``, an op type below a name, which XLA reads as the
  operation's type), the whole text is returned as it is: then a program compiled from
  elsewhere is a miss, never a false hit.

  Examples:
    >>> text = '%0 = stablehlo.sine %arg0 loc(#loc4)\n#loc1 = loc("/a.py":1:2)\n' + (
    ...   '#loc2 = loc("f"(#loc1))\n#loc3 = loc(callsite(#loc2 at #loc2))\n'
    ...   '#loc4 = loc("jit(f)/sin"(#loc3))')
    >>> module_key_text(text)
    '%0 = stablehlo.sine %arg0 loc("jit(f)/sin")'
    >>> module_key_text(text.replace("loc(#loc4)", "loc(#loc3)"))  # a bare traceback
    '%0 = stablehlo.sine %arg0 loc("f")'
  """
  defs, lines = {}, []
  for line in debug_text.splitlines():
    m = _LOC_DEF.match(line)
    if m:
      defs["#" + m.group(1)] = m.group(2)
    else:
      lines.append(line)
  names: dict[str, tuple[str, bool] | None] = {}

  def name(expr: str) -> tuple[str, bool] | None:
    """`expr` reduced, and whether it holds an op type; None: a form not known."""
    if expr.startswith("#loc"):
      if expr not in names:
        names[expr] = None  # (a cycle, which MLIR does not write, stays unknown)
        names[expr] = name(defs[expr]) if expr in defs else None
      return names[expr]
    if expr == "unknown":
      return "", False
    callsite = _CALLSITE.match(expr)
    if callsite:  # a traceback: its innermost frame, as XLA names an operation by the callee
      return name(callsite.group(1))
    m = _QUOTED.match(expr)
    if m is None:
      return None
    label, rest = m.groups()
    if rest.startswith(":"):  # the operation's own "file":line:col (its source_file and line)
      return expr, False
    if not rest:
      inner = ("", False)
    elif rest.startswith("(") and rest.endswith(")"):
      inner = name(rest[1:-1])
    else:
      return None
    if inner is None:
      return None
    if label.split("@", 1)[0].endswith(":"):  # an op type: XLA names the operation from below
      return (f'"{label}"({inner[0]})' if rest else f'"{label}"'), True
    # What is below a name does not name the operation; an op type there would type it.
    return None if inner[1] else (f'"{label}"', False)

  def reduced(m: re.Match) -> str:
    n = None if m.group(1) is None else name(m.group(1))
    return m.group(0) if n is None else f"loc({n[0]})"

  text = "\n".join(_LOC_USE.sub(reduced, line) for line in lines)
  return debug_text if "#loc" in text else text  # a location left unreduced: all of it


def entry_key(module_text: str, target_config: str, compile_options: bytes) -> str:
  """The key of a compile: a sha256 of all it depends on (see the module's docstring);
  `module_text` as `module_key_text` gives it, `compile_options` serialized."""
  h = hashlib.sha256()
  for part in (
    FORMAT.encode(),
    _versions().encode(),
    _xla_flags().encode(),
    compile_options,
    target_config.encode(),
    module_text.encode(),
  ):
    h.update(len(part).to_bytes(8, "little"))
    h.update(part)
  return h.hexdigest()


def _umask() -> int:
  """This process's umask, read without setting it (Linux); 0o077 (private) where unknown."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  return 0o077


def _path(cache_dir: str, key: str) -> str:
  return os.path.join(cache_dir, f"optax_offload_gpu-{key}{SUFFIX}")


def load(cache_dir: str, key: str) -> dict[str, Any] | None:
  """The entry stored under `key`, or None (none, or one that cannot be read)."""
  try:
    with gzip.open(_path(cache_dir, key), "rt", encoding="utf-8") as f:
      entry = json.load(f)
  except (OSError, EOFError, ValueError, zlib.error):  # gzip's errors, JSON's, a bad UTF-8
    return None
  return entry if isinstance(entry, dict) else None


_TMP_PREFIX = ".optax_offload_gpu-"
STALE_TMP_S = 3600
"""A temporary file of `store` older than this is a killed writer's: the next store removes it."""


def _remove_stale_temporaries(cache_dir: str) -> None:
  """Removes the temporary files that writers killed mid-write left (older than `STALE_TMP_S`)."""
  try:
    with os.scandir(cache_dir) as entries:
      stale = [e for e in entries if e.name.startswith(_TMP_PREFIX) and e.name.endswith(".tmp")]
  except OSError:  # the directory cannot be read
    return
  for entry in stale:
    try:
      if time.time() - entry.stat().st_mtime > STALE_TMP_S:
        os.remove(entry.path)
    except OSError:  # another process removed it first
      pass


def store(cache_dir: str, key: str, entry: dict[str, Any]) -> None:
  """Writes `entry` (JSON-able) under `key`: whole or not at all, with the permissions the
  process's umask gives new files (as JAX's entries). A cache that cannot be written is
  skipped, as JAX skips its own."""
  try:
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=_TMP_PREFIX, suffix=".tmp")
  except OSError:
    return
  _remove_stale_temporaries(cache_dir)
  try:
    with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) as f:
      f.write(json.dumps(entry).encode())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, _path(cache_dir, key))
  except OSError:
    try:
      os.remove(tmp)
    except OSError:
      pass
