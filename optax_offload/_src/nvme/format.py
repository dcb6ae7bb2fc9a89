"""The on-disk format of the NVMe store: zarr3 metadata, chunk layout, TensorStore specs, manifest, dtypes.

Every leaf is a zarr3 array (raw little-endian ``bytes`` codec, regular chunk grid, default chunk
keys) that TensorStore, Orbax and any zarr3 reader open as is. Format 2 keeps each chunk file's
checksum in the array's own ``zarr.json`` (``attributes.optax_offload``) instead of a ``crc32c``
codec inside the chunk, so that a chunk file is exactly its bytes and the store's hot loop can
read and write it with direct I/O (`chunk_io`); format 1 stores (``crc32c`` codec) are still read,
through TensorStore. Every TensorStore spec and context of the NVMe tier is built here, by small
functions (as orbax's ``tensorstore_utils``).
"""

from __future__ import annotations

import dataclasses
import functools
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
from optax_offload._src.nvme.errors import NvmeError

MANIFEST = "MANIFEST.json"
LOCK = "LOCK"
SPARE_PREFIX = "spare_"
"""A dropped generation's directory kept for its files (``spare_gen_00000042``): not a generation,
never read; the next writes overwrite its chunk files in place (`files.Spares`)."""
FORMAT = "optax_offload.nvme"
FORMAT_VERSION = 2
"""1: a ``crc32c`` codec in every chunk (read through TensorStore). 2: checksums in ``zarr.json``."""
_GENERATION_RE = re.compile(r"^gen_(\d+)$")

ZARR_JSON = "zarr.json"
ATTRIBUTE = "optax_offload"
"""The key of the store's attributes in a leaf's ``zarr.json``: ``{"checksum": CHECKSUM, "chunks":
[one 16-digit hex checksum per chunk file, in C order of the chunk grid]}``."""
CHECKSUM = "xxh3_64"
"""XXH3 (64 bits) of each whole chunk file, padding included (python-xxhash)."""
ALIGN = 4096
"""Offsets, lengths and buffer addresses of direct I/O are multiples of this (a page; every
logical block size Linux supports divides it)."""

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
  path: str, shape: Sequence[int], dtype: str, chunk_shape: Sequence[int], crc32c: bool = False
) -> dict[str, Any]:
  """TensorStore spec that creates one leaf's zarr3 array at `path` (replacing what is there).

  The store writes its chunks itself (`chunk_io`); this spec gives the metadata it writes
  (`zarr3_metadata`), and with `crc32c` the format 1 layout (a checksum codec in every chunk).
  """
  codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
  return {
    "driver": "zarr3",
    "kvstore": {"driver": "file", "path": path.rstrip("/") + "/"},
    "metadata": {
      "shape": list(shape),
      "data_type": dtype,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
      "codecs": codecs + ([{"name": "crc32c"}] if crc32c else []),
    },
    # Every chunk is written, even all-zero ones, so that a missing chunk file is an error on read.
    "store_data_equal_to_fill_value": True,
    "create": True,
    "delete_existing": True,
  }


@functools.lru_cache(maxsize=1024)
def _zarr3_metadata_text(shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...]) -> str:
  spec = zarr3_write_spec("", shape, dtype, chunks)
  spec["kvstore"] = {"driver": "memory", "path": "leaf/"}
  del spec["delete_existing"]
  store = ts.open(spec, context=ts.Context()).result()
  return store.kvstore.read(ZARR_JSON).result().value.decode()


def zarr3_metadata(
  shape: Sequence[int], dtype: str, chunk_shape: Sequence[int], checksums: Sequence[str]
) -> dict[str, Any]:
  """The ``zarr.json`` document of a leaf with the given chunk checksums.

  TensorStore writes the document (into memory; cached per shape, dtype and chunks), so that it
  is exactly what TensorStore itself would write for the array; the checksums go in its
  ``attributes``, which zarr3 readers keep and otherwise ignore.

  Examples:
    >>> doc = zarr3_metadata((40, 50), "float32", (20, 50), ["00" * 8, "ff" * 8])
    >>> doc["codecs"], doc["chunk_key_encoding"], doc["attributes"]["optax_offload"]["checksum"]
    ([{'configuration': {'endian': 'little'}, 'name': 'bytes'}], {'name': 'default'}, 'xxh3_64')
  """
  doc = json.loads(_zarr3_metadata_text(tuple(shape), dtype, tuple(chunk_shape)))
  doc["attributes"] = {ATTRIBUTE: {"checksum": CHECKSUM, "chunks": list(checksums)}}
  return doc


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

  Each chunk is then one contiguous range of the array's bytes (a *slab*, see `slab_layout`). The
  split axis is cut into about equal parts: zarr pads edge chunks to the full chunk shape on disk,
  so equal parts waste little instead of up to a whole chunk. The rows of a part are rounded up
  to make its bytes a multiple of `ALIGN` when that keeps the number of parts, so that every
  chunk starts at an aligned offset of the array and is read in place with direct I/O.

  Examples:
    >>> chunk_shape((50_000,), 4, 64 << 10)  # 4 chunks of 13312 rows (52 KiB), not 3 of 16384 and a padded one
    (13312,)
    >>> chunk_shape((40, 50), 4, 4096)  # aligned parts would be one 8000-byte chunk: unaligned
    (20, 50)
  """
  shape = tuple(shape)
  for axis in range(len(shape)):
    inner = math.prod(shape[axis + 1 :]) * itemsize
    if inner <= chunk_bytes:
      length = max(shape[axis], 1)
      parts = -(-length // max(1, chunk_bytes // max(inner, 1)))
      rows = -(-length // parts)
      if parts > 1 and inner > 0:
        step = ALIGN // math.gcd(ALIGN, inner)
        aligned = -(-rows // step) * step
        if -(-length // aligned) == parts:
          rows = aligned
      return (1,) * axis + (rows,) + tuple(max(d, 1) for d in shape[axis + 1 :])
  return tuple(max(d, 1) for d in shape)


def round_up(n: int, to: int = ALIGN) -> int:
  """`n` rounded up to a multiple of `to`."""
  return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk file of a leaf whose chunks are slabs: its key and where its bytes are in the array.

  Attributes:
    key: the chunk's key under the leaf directory, e.g. ``"c/3/0"``.
    index: its position in C order of the chunk grid (the order of the checksums).
    offset: byte offset of its first element in the C-order array.
    nbytes: bytes of the array it holds (contiguous); less than the file for an edge chunk.
  """

  key: str
  index: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class SlabLayout:
  """The chunk files of a leaf whose every chunk is one contiguous range of its bytes.

  Attributes:
    chunks: the chunks, in C order of the chunk grid.
    file_nbytes: bytes of every chunk file (the full chunk shape; zarr pads edge chunks).
    nbytes: bytes of the array.
    buffer_nbytes: bytes of a page-aligned buffer the array is read into: the array, plus room to
      read the last chunk's padding in place, rounded up to `ALIGN`.
  """

  chunks: tuple[Chunk, ...]
  file_nbytes: int
  nbytes: int
  buffer_nbytes: int

  def in_place(self, chunk: Chunk) -> bool:
    """Whether `chunk`'s whole file is read straight into the buffer at its offset (direct I/O).

    The others, rare (edge chunks followed by more data, unaligned offsets or sizes), are read into
    a buffer of their own and copied.
    """
    # A direct read of a file whose size is not a multiple of ALIGN may write past the file's end
    # in the buffer (the device moves whole blocks): only the last chunk has room for that.
    last = chunk.offset + chunk.nbytes == self.nbytes
    whole = chunk.nbytes == self.file_nbytes and self.file_nbytes % ALIGN == 0
    return chunk.offset % ALIGN == 0 and (last or whole)


@functools.lru_cache(maxsize=4096)
def slab_layout(
  shape: tuple[int, ...], itemsize: int, chunks: tuple[int, ...]
) -> SlabLayout | None:
  """The chunk files of an array of `shape` with chunk shape `chunks`; None unless they are slabs.

  The chunks are slabs when, for some axis ``a``, the chunk shape is 1 before ``a`` and the whole
  extent after it (what `chunk_shape` makes).

  Examples:
    >>> layout = slab_layout((10, 4), 4, (4, 4))
    >>> [(c.key, c.offset, c.nbytes) for c in layout.chunks], layout.file_nbytes
    ([('c/0/0', 0, 64), ('c/1/0', 64, 64), ('c/2/0', 128, 32)], 64)
    >>> slab_layout((10, 4), 4, (4, 2)) is None
    True
  """
  rank = len(shape)
  if len(chunks) != rank or any(c < 1 for c in chunks):
    return None
  nbytes = math.prod(shape) * itemsize
  file_nbytes = math.prod(chunks) * itemsize
  if nbytes == 0:
    return SlabLayout((), file_nbytes, 0, 0)
  axis = rank - 1
  while axis > 0 and chunks[axis] == shape[axis]:
    axis -= 1
  if any(c != 1 for c in chunks[:axis]):
    return None
  if rank == 0:
    chunk = Chunk("c", 0, 0, itemsize)
    return SlabLayout((chunk,), file_nbytes, nbytes, round_up(itemsize))
  grid = [-(-d // c) for d, c in zip(shape, chunks)]
  strides = [math.prod(shape[i + 1 :]) * itemsize for i in range(rank)]
  out, end = [], round_up(nbytes)
  for index, position in enumerate(_c_order(grid)):
    offset = sum(p * c * s for p, c, s in zip(position, chunks, strides))
    rows = min(chunks[axis], shape[axis] - position[axis] * chunks[axis])
    out.append(Chunk("c/" + "/".join(map(str, position)), index, offset, rows * strides[axis]))
  layout = SlabLayout(tuple(out), file_nbytes, nbytes, end)
  for chunk in layout.chunks:
    if layout.in_place(chunk):
      end = max(end, chunk.offset + round_up(file_nbytes))
  return dataclasses.replace(layout, buffer_nbytes=end)


def _c_order(grid: Sequence[int]):
  if not grid:
    yield ()
    return
  for i in range(grid[0]):
    for rest in _c_order(grid[1:]):
      yield (i, *rest)


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
  """A leaf spec plus where and how it is stored (the layout of the files the store writes)."""

  spec: LeafSpec
  dirname: str
  zarr_dtype: str
  storage_dtype: np.dtype
  chunk_shape: tuple[int, ...]

  @property
  def layout(self) -> SlabLayout:
    """The chunk files this store writes for the leaf."""
    layout = slab_layout(self.spec.shape, self.storage_dtype.itemsize, self.chunk_shape)
    assert layout is not None, self  # `chunk_shape` makes slabs
    return layout


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

  Stores of format 1 (a ``crc32c`` codec in every chunk) open as they are: their leaves are read
  through TensorStore, and the generations written from then on are of the current format.

  Raises:
    NvmeCorruptionError: the manifest cannot be read.
    NvmeError: the store was written by a newer version of optax_offload.
  """
  path = directory / MANIFEST
  if not path.exists():
    return None
  try:
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
      raise ValueError(f"format {doc.get('format')!r} is not {FORMAT!r}")
    version = int(doc.get("version", 1))
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise NvmeCorruptionError(
      f"NVMe store manifest {path} cannot be read ({e}); restore it from a checkpoint or delete "
      f"{directory} to start over."
    ) from e
  if version > FORMAT_VERSION:
    raise NvmeError(
      f"NVMe store {directory} has format version {version}, newer than this optax_offload reads "
      f"({FORMAT_VERSION}): upgrade optax_offload, or use another nvme_dir."
    )
  try:
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
