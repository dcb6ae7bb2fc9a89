"""The on-disk format of the NVMe store: TensorStore specs and context, leaf files, manifest, dtypes.

Every TensorStore spec and context of the NVMe tier is built here, by small functions (as orbax's
``tensorstore_utils``), and the checkpoint code reads the store's files through them too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from optax_offload._src.nvme.errors import NvmeCorruptionError

MANIFEST = "MANIFEST.json"
LOCK = "LOCK"
FORMAT = "optax_offload.nvme"
FORMAT_VERSION = 1
_GENERATION_RE = re.compile(r"^gen_(\d+)$")

# No TensorStore cache (the store keeps its own bounded buffers), many concurrent file operations, and no
# fsync per write: durability is paid once per generation, when it is committed.
_TS_CONTEXT = {
  "cache_pool": {"total_bytes_limit": 0},
  "file_io_concurrency": {"limit": 32},
  "file_io_sync": False,
}

# numpy dtype names that TensorStore's zarr3 driver stores natively (checked against tensorstore 0.1.86).
# Any other fixed-size dtype is stored as an unsigned integer of the same width and viewed back on read.
_ZARR3_NATIVE = frozenset(
  {
    "bool",
    "int2",
    "int4",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "bfloat16",
    "float4_e2m1fn",
    "float8_e3m4",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
  }
)
_UINT_OF_SIZE = {
  1: np.dtype(np.uint8),
  2: np.dtype(np.uint16),
  4: np.dtype(np.uint32),
  8: np.dtype(np.uint64),
}


def ts_context() -> ts.Context:
  """The TensorStore context of the store's reads and writes (and of checkpoint reads)."""
  return ts.Context(_TS_CONTEXT)


def zarr3_write_spec(
  path: str, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int]
) -> dict[str, Any]:
  """TensorStore spec that creates one leaf's zarr3 array at `path` (replacing what is there)."""
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path.rstrip("/") + "/"},
    "metadata": {
      "shape": list(shape),
      "data_type": dtype,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
      "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
    },
    # Every chunk is written, even all-zero ones, so that a missing chunk file is an error on read.
    "store_data_equal_to_fill_value": True,
    "create": True,
    "delete_existing": True,
  }


def zarr3_read_spec(path: str) -> dict[str, Any]:
  """TensorStore spec that opens one leaf's zarr3 array for a verified read (no fill for gaps)."""
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path.rstrip("/") + "/"},
    "open": True,
    "fill_missing_data_reads": False,
  }


def storage_dtype(dtype: np.dtype) -> tuple[str, np.dtype]:
  """The zarr3 ``data_type`` of `dtype`, and the numpy dtype its bytes are written as.

  Examples:
    >>> import ml_dtypes
    >>> storage_dtype(np.dtype(ml_dtypes.bfloat16))
    ('bfloat16', dtype(bfloat16))
    >>> storage_dtype(np.dtype(ml_dtypes.float8_e4m3))  # not in zarr3: its bits, as uint8
    ('uint8', dtype('uint8'))
  """
  if dtype.name in _ZARR3_NATIVE and dtype.isnative:
    return dtype.name, dtype
  if dtype.itemsize in _UINT_OF_SIZE and not dtype.fields and not dtype.subdtype:
    storage = _UINT_OF_SIZE[dtype.itemsize]
    return storage.name, storage
  raise ValueError(f"dtype {dtype} cannot be stored in the NVMe tier.")


def chunk_shape(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
  """Chunks of at most about `chunk_bytes`, split along the leading axes (whole array if it is small).

  The split axis is cut into equal parts: zarr pads edge chunks to the full chunk shape on disk, so equal
  parts waste less than one row per chunk instead of up to a whole chunk.

  Examples:
    >>> chunk_shape((50_000,), 4, 64 << 10)  # 4 chunks of 12500 rows, not 3 of 16384 and a padded one
    (12500,)
  """
  shape = tuple(shape)
  for axis in range(len(shape)):
    inner = math.prod(shape[axis + 1 :]) * itemsize
    if inner <= chunk_bytes:
      length = max(shape[axis], 1)
      parts = -(-length // max(1, chunk_bytes // max(inner, 1)))
      rows = -(-length // parts)
      return (1,) * axis + (rows,) + tuple(max(d, 1) for d in shape[axis + 1 :])
  return tuple(max(d, 1) for d in shape)


def leaf_dirname(name: str) -> str:
  """The directory of a leaf in a generation: its name with unsafe characters replaced by ``_``."""
  safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
  if not safe or safe.startswith("."):
    safe = "_" + safe
  return safe


def generation_dirname(generation: int) -> str:
  """The directory of a generation in the store, e.g. ``gen_00000042``."""
  return f"gen_{int(generation):08d}"


def generation_of(dirname: str) -> int | None:
  """The generation a store entry holds, or None when it is not a generation directory."""
  match = _GENERATION_RE.match(dirname)
  return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """Name, shape and dtype of one stored leaf.

  Attributes:
    name: unique name of the leaf, e.g. ``"g003_l017"``; characters other than letters, digits, ``_``,
      ``.`` and ``-`` are replaced by ``_`` in the file name.
    shape: shape of the array.
    dtype: numpy dtype, including ``ml_dtypes`` ones such as ``bfloat16``.
  """

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  @property
  def nbytes(self) -> int:
    """Bytes of the array in memory."""
    return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
  """A leaf spec plus where and how it is stored."""

  spec: LeafSpec
  dirname: str
  zarr_dtype: str
  storage_dtype: np.dtype
  chunk_shape: tuple[int, ...]


def stored_leaves(groups: Sequence[Sequence[LeafSpec]], chunk_bytes: int) -> list[list[StoredLeaf]]:
  """How each leaf of `groups` is stored; raises ValueError for duplicate or clashing names."""
  names, dirnames, leaves = set(), {}, []
  for group in groups:
    out = []
    for spec in group:
      if not isinstance(spec, LeafSpec):
        raise ValueError(f"groups must hold LeafSpec, got {spec!r}.")
      if spec.name in names:
        raise ValueError(f"duplicate leaf name {spec.name!r}.")
      names.add(spec.name)
      dirname = leaf_dirname(spec.name)
      if dirname in dirnames:
        raise ValueError(
          f"leaf names {dirnames[dirname]!r} and {spec.name!r} map to the same file name {dirname!r}."
        )
      dirnames[dirname] = spec.name
      zarr_dtype, storage = storage_dtype(spec.dtype)
      chunks = chunk_shape(spec.shape, storage.itemsize, chunk_bytes)
      out.append(StoredLeaf(spec, dirname, zarr_dtype, storage, chunks))
    leaves.append(out)
  return leaves


# -- the manifest -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What ``MANIFEST.json`` records: the committed generation, the kept ones, pins and leaf specs.

  On disk it also holds ``format``, ``version``, ``writer_pid`` and ``written_at``.
  """

  committed: int
  previous: int
  generations: tuple[int, ...]
  pinned: tuple[int, ...]
  groups: list[list[dict[str, Any]]]  # per leaf: {"name", "shape", "dtype"}


def groups_json(groups: Sequence[Sequence[LeafSpec]]) -> list[list[dict[str, Any]]]:
  """The manifest's record of the leaf specs."""
  return [
    [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in group]
    for group in groups
  ]


def manifest_json(manifest: Manifest, writer_pid: int, written_at: float) -> dict[str, Any]:
  """The JSON document of a manifest."""
  return {
    "format": FORMAT,
    "version": FORMAT_VERSION,
    "committed_generation": manifest.committed,
    "previous_generation": manifest.previous,
    "generations": list(manifest.generations),
    "pinned": sorted(manifest.pinned),
    "groups": manifest.groups,
    "writer_pid": writer_pid,
    "written_at": written_at,
  }


def read_manifest(directory: pathlib.Path) -> Manifest | None:
  """The store's manifest, or None when the store has none.

  Raises:
    NvmeCorruptionError: the manifest cannot be read.
  """
  path = directory / MANIFEST
  if not path.exists():
    return None
  try:
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
      raise ValueError(f"format {doc.get('format')!r} is not {FORMAT!r}")
    return Manifest(
      committed=int(doc["committed_generation"]),
      previous=int(doc.get("previous_generation", -1)),
      generations=tuple(sorted(int(g) for g in doc["generations"])),
      pinned=tuple(sorted(int(g) for g in doc.get("pinned", []))),
      groups=doc["groups"],
    )
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise NvmeCorruptionError(
      f"NVMe store manifest {path} cannot be read ({e}); restore it from a checkpoint or delete "
      f"{directory} to start over."
    ) from e


def describe_spec_diff(
  old: list[list[dict[str, Any]]], new: list[list[dict[str, Any]]]
) -> list[str]:
  """How the leaf specs `new` differ from the stored `old` (both as `groups_json` records)."""
  diffs = []
  if len(old) != len(new):
    diffs.append(f"{len(old)} groups stored, {len(new)} given")
  for g, (old_group, new_group) in enumerate(zip(old, new, strict=False)):
    if len(old_group) != len(new_group):
      diffs.append(f"group {g}: {len(old_group)} leaves stored, {len(new_group)} given")
    for i, (a, b) in enumerate(zip(old_group, new_group, strict=False)):
      for field in ("name", "shape", "dtype"):
        if a.get(field) != b[field]:
          diffs.append(f"group {g} leaf {i}: {field} {a.get(field)!r} stored, {b[field]!r} given")
  return diffs


def stored_groups(directory: str | os.PathLike) -> list[list[LeafSpec]]:
  """The leaf specs recorded in a store's manifest, to reopen it without knowing them.

  Raises:
    FileNotFoundError: the directory holds no committed store.
  """
  path = pathlib.Path(os.path.abspath(os.fspath(directory))) / MANIFEST
  if not path.exists():
    raise FileNotFoundError(f"{path.parent} holds no committed NVMe store (no {MANIFEST}).")
  manifest = json.loads(path.read_text())
  return [
    [LeafSpec(s["name"], tuple(s["shape"]), np.dtype(s["dtype"])) for s in group]
    for group in manifest["groups"]
  ]
