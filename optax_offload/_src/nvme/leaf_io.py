"""Reading and writing one generation's leaves (the store's data path), and boxes of stored leaves.

A group's chunk files are all handed to `chunk_io.ChunkIO` at once, so they are read or written
concurrently; each leaf's ``zarr.json`` is written after its chunks, with their checksums. Leaves of
format 1 (a ``crc32c`` codec in every chunk, see `format`) are read through TensorStore. Failures
name the leaf and the file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from optax_offload._src.nvme import buffers
from optax_offload._src.nvme import chunk_io
from optax_offload._src.nvme import format as format_lib
from optax_offload._src.nvme.errors import NvmeCorruptionError
from optax_offload._src.nvme.errors import NvmeWriteError

_BYTES_CODECS = (
  [{"name": "bytes", "configuration": {"endian": "little"}}],
  [{"name": "bytes"}],  # what TensorStore writes for 1-byte types
)


def _wait_all(
  futures: Iterable[tuple[Any, ts.Future]],
) -> tuple[list[Any], tuple[Any, Exception] | None]:
  """Waits for every future; returns the results and the first failure as ``(tag, exception)``."""
  results, failure = [], None
  for tag, future in futures:
    try:
      results.append(future.result())
    except Exception as e:  # TensorStore raises ValueError for every I/O status.
      results.append(None)
      if failure is None:
        failure = (tag, e)
  return results, failure


# -- metadata ------------------------------------------------------------------------------------


def read_metadata(path: pathlib.Path) -> dict[str, Any]:
  """The ``zarr.json`` of the leaf directory `path`.

  Raises:
    ValueError: it is missing or is not a zarr3 array's metadata.
  """
  try:
    with open(path / format_lib.ZARR_JSON, "rb") as f:
      meta = json.loads(f.read())
  except FileNotFoundError:
    raise ValueError(f"{path / format_lib.ZARR_JSON} is missing") from None
  except (OSError, ValueError) as e:
    raise ValueError(f"{path / format_lib.ZARR_JSON} cannot be read: {e}") from e
  if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
    raise ValueError(f"{path / format_lib.ZARR_JSON} is not the metadata of a zarr3 array")
  return meta


def _shape_dtype(meta: dict[str, Any]) -> tuple[tuple[int, ...], str]:
  return tuple(int(d) for d in meta.get("shape", ())), str(meta.get("data_type"))


def checksums_of(meta: dict[str, Any]) -> list[str] | None:
  """The chunk checksums of a leaf written by this store (format 2); None for format 1 leaves.

  Raises:
    ValueError: the leaf has neither (its chunks cannot be verified) or unknown codecs.
  """
  codecs = meta.get("codecs")
  if isinstance(codecs, list) and any(c.get("name") == "crc32c" for c in codecs):
    return None
  attributes = meta.get("attributes", {}).get(format_lib.ATTRIBUTE, {})
  if codecs not in _BYTES_CODECS:
    raise ValueError(f"its codecs {codecs} are not those of the NVMe store")
  if attributes.get("checksum") != format_lib.CHECKSUM or not isinstance(
    attributes.get("chunks"), list
  ):
    raise ValueError(f"its zarr.json holds no {format_lib.CHECKSUM} checksums of its chunks")
  encoding = meta.get("chunk_key_encoding", {})
  if (
    encoding.get("name") != "default"
    or encoding.get("configuration", {}).get("separator", "/") != "/"
  ):
    raise ValueError(f"its chunk key encoding {encoding} is not zarr3's default")
  return [str(c) for c in attributes["chunks"]]


def _chunk_grid(meta: dict[str, Any]) -> tuple[int, ...]:
  grid = meta.get("chunk_grid", {})
  if grid.get("name") != "regular":
    raise ValueError(f"its chunk grid {grid} is not regular")
  return tuple(int(c) for c in grid.get("configuration", {}).get("chunk_shape", ()))


# -- a group of leaves ---------------------------------------------------------------------------


def _corruption(
  leaf: format_lib.StoredLeaf, path: Any, generation_dir: pathlib.Path, e
) -> Exception:
  generation = format_lib.generation_of(generation_dir.name)
  return NvmeCorruptionError(
    f"NVMe store: leaf {leaf.spec.name!r} of generation {generation} at {path} failed "
    f"verification: {e}"
  )


def read_leaves(
  io: chunk_io.ChunkIO,
  context: ts.Context,
  generation_dir: pathlib.Path,
  leaves: Sequence[format_lib.StoredLeaf],
  take: Callable[[int], np.ndarray] | None = None,
) -> list[np.ndarray]:
  """Reads and verifies `leaves` of one generation.

  Args:
    io: the chunk reader.
    context: the TensorStore context (for format 1 leaves).
    generation_dir: the generation's directory.
    leaves: the leaves to read.
    take: gives the page-aligned uint8 buffer of a number of bytes to read a leaf into (e.g.
      `buffers.ReadBuffers.take`); None reads into fresh buffers.

  Returns:
    The arrays, in the leaves' own dtypes (views of the buffers).

  Raises:
    NvmeCorruptionError: a leaf is missing, truncated, of another shape, or fails its checksums.
  """
  take = take or buffers.aligned_empty
  arrays: list[np.ndarray | None] = [None] * len(leaves)
  jobs, old = [], []
  for i, leaf in enumerate(leaves):
    path = generation_dir / leaf.dirname
    try:
      meta = read_metadata(path)
      shape, dtype = _shape_dtype(meta)
      if shape != leaf.spec.shape or dtype != leaf.zarr_dtype:
        raise ValueError(
          f"stored as {dtype}{list(shape)}, expected {leaf.zarr_dtype}{list(leaf.spec.shape)}"
        )
      checksums = checksums_of(meta)
      if checksums is None:
        old.append(i)
        continue
      layout = format_lib.slab_layout(shape, leaf.storage_dtype.itemsize, _chunk_grid(meta))
      if layout is None:
        raise ValueError(f"its chunks {_chunk_grid(meta)} are not slabs of the array")
      if len(checksums) != len(layout.chunks):
        raise ValueError(f"{len(checksums)} checksums for {len(layout.chunks)} chunks")
    except ValueError as e:
      raise _corruption(leaf, path, generation_dir, e) from e
    buffer = take(layout.buffer_nbytes)
    for chunk in layout.chunks:
      job = chunk_io.ReadJob(
        str(path / chunk.key), layout.file_nbytes, checksums[chunk.index], tag=leaf
      )
      if layout.in_place(chunk):
        job.buffer = buffer[chunk.offset : chunk.offset + format_lib.round_up(layout.file_nbytes)]
      else:
        job.target = buffer[chunk.offset : chunk.offset + chunk.nbytes]
      jobs.append(job)
    arrays[i] = buffer[: layout.nbytes].view(leaf.storage_dtype).reshape(leaf.spec.shape)
  try:
    io.read(jobs)
  except chunk_io.ChunkError as e:
    raise _corruption(e.tag, e.path, generation_dir, e.reason) from e
  for i, array in zip(
    old, _read_with_tensorstore(context, generation_dir, [leaves[i] for i in old], take)
  ):
    arrays[i] = array
  return [
    array.view(leaf.spec.dtype) if leaf.storage_dtype != leaf.spec.dtype else array
    for leaf, array in zip(leaves, arrays, strict=True)
  ]


def _read_with_tensorstore(
  context: ts.Context,
  generation_dir: pathlib.Path,
  leaves: Sequence[format_lib.StoredLeaf],
  take: Callable[[int], np.ndarray],
) -> list[np.ndarray]:
  """Reads format 1 leaves, whose chunks TensorStore's ``crc32c`` codec verifies."""
  if not leaves:
    return []
  tags = [(leaf, generation_dir / leaf.dirname) for leaf in leaves]
  opens = [(tag, ts.open(format_lib.zarr3_read_spec(str(tag[1])), context=context)) for tag in tags]
  stores, failure = _wait_all(opens)
  arrays = [
    take(leaf.spec.nbytes)[: leaf.spec.nbytes].view(leaf.storage_dtype).reshape(leaf.spec.shape)
    for leaf in leaves
  ]
  if failure is None:
    # A list, not a generator: every read is issued before `_wait_all` waits for the first.
    reads = [
      (tag, ts.array(array, copy=False, write=True).write(store))
      for tag, store, array in zip(tags, stores, arrays, strict=True)
    ]
    _, failure = _wait_all(reads)
  if failure is not None:
    (leaf, path), e = failure
    raise _corruption(leaf, path, generation_dir, e) from e
  return arrays


def write_leaves(
  io: chunk_io.ChunkIO,
  generation_dir: pathlib.Path,
  leaves: Sequence[format_lib.StoredLeaf],
  arrays: Sequence[np.ndarray],
  generation_bytes: int,
  reuse: Callable[[str, pathlib.Path], bool] | None = None,
) -> None:
  """Writes `arrays` as `leaves` of one generation (not yet durable: the commit fsyncs them).

  Args:
    io: the chunk writer.
    generation_dir: the generation's directory.
    leaves: the leaves to write.
    arrays: their arrays.
    generation_bytes: one generation's size (for the message of a full disk).
    reuse: moves an old directory of a leaf to the given path, whose chunk files are then written
      over in place (`files.Spares.take`); returns False when it has none.

  Raises:
    NvmeWriteError: a write failed; a full disk says how much room the store needs (`generation_bytes`
      is one generation's size).
  """
  jobs, paths = [], []
  for leaf, array in zip(leaves, arrays, strict=True):
    path = generation_dir / leaf.dirname
    paths.append(path)
    data = np.ascontiguousarray(array)
    if leaf.storage_dtype != leaf.spec.dtype:
      data = data.view(leaf.storage_dtype)
    flat = data.reshape(-1).view(np.uint8)
    layout = leaf.layout
    try:
      if reuse is not None and not path.exists():
        os.makedirs(generation_dir, exist_ok=True)
        reuse(leaf.dirname, path)
      for parent in sorted({os.path.dirname(chunk.key) for chunk in layout.chunks} | {""}):
        os.makedirs(path / parent, exist_ok=True)
    except OSError as e:
      raise _write_error(leaf, path, generation_dir, e, generation_bytes) from e
    for chunk in layout.chunks:
      source = flat[chunk.offset : chunk.offset + chunk.nbytes]
      jobs.append(chunk_io.WriteJob(str(path / chunk.key), source, layout.file_nbytes, tag=leaf))
  try:
    io.write(jobs)
  except chunk_io.ChunkError as e:
    raise _write_error(e.tag, e.path, generation_dir, e.reason, generation_bytes) from e
  by_leaf: dict[int, list[str]] = {}
  for job in jobs:
    by_leaf.setdefault(id(job.tag), []).append(job.checksum)
  for leaf, path in zip(leaves, paths):
    doc = format_lib.zarr3_metadata(
      leaf.spec.shape, leaf.zarr_dtype, leaf.chunk_shape, by_leaf.get(id(leaf), [])
    )
    try:
      # A new file, renamed over the old one: a reused leaf's zarr.json may be a checkpoint's too.
      tmp = path / (format_lib.ZARR_JSON + ".tmp")
      with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
      os.replace(tmp, path / format_lib.ZARR_JSON)
    except OSError as e:
      raise _write_error(leaf, path, generation_dir, e, generation_bytes) from e


def _write_error(leaf, path, generation_dir, e, generation_bytes) -> NvmeWriteError:
  hint = ""
  if getattr(e, "errno", None) == errno.ENOSPC or "space" in str(e).lower():
    hint = (
      f" The disk looks full: the store needs room for 3 to 4 generations of {generation_bytes} "
      "bytes (two committed ones and those being written), plus pinned ones."
    )
  generation = format_lib.generation_of(generation_dir.name)
  return NvmeWriteError(
    f"NVMe store: writing leaf {leaf.spec.name!r} of generation {generation} to {path} failed: "
    f"{e}.{hint}"
  )


# -- a box of one stored leaf (checkpoints) ------------------------------------------------------


def read_region(
  path: str | os.PathLike,
  shape: Sequence[int],
  box: Sequence[tuple[int, int]],
  context: ts.Context | None = None,
) -> np.ndarray:
  """Reads and verifies a box of a leaf the store (of any format) wrote, e.g. into a checkpoint.

  Only the chunks that overlap the box are read.

  Args:
    path: the leaf's zarr3 directory.
    shape: the shape the leaf must have.
    box: ``(start, stop)`` per axis.
    context: the TensorStore context for format 1 leaves (None: the store's).

  Returns:
    The box, in the stored zarr3 dtype (dtypes zarr3 lacks are stored as unsigned integers).

  Raises:
    ValueError: the leaf is missing, of another shape, or fails its checksums (the message names
      the file).
  """
  path = pathlib.Path(path)
  meta = read_metadata(path)
  stored, dtype_name = _shape_dtype(meta)
  if list(stored) != list(shape):
    raise ValueError(f"its shape is {list(stored)}, expected {list(shape)}")
  checksums = checksums_of(meta)
  box = [(int(a), int(b)) for a, b in box]
  if checksums is None:
    store = ts.open(
      format_lib.zarr3_read_spec(str(path)), read=True, context=context or format_lib.ts_context()
    ).result()
    return store[tuple(slice(a, b) for a, b in box)].read().result()
  dtype = ts.dtype(dtype_name).numpy_dtype
  chunks = _chunk_grid(meta)
  grid = [-(-d // c) for d, c in zip(stored, chunks)]
  if len(chunks) != len(stored) or math.prod(grid) != len(checksums):
    raise ValueError(f"{len(checksums)} checksums for a chunk grid of {grid}")
  out = np.empty([b - a for a, b in box], dtype)
  if out.size == 0:
    return out
  file_nbytes = math.prod(chunks) * dtype.itemsize
  ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
  for position in np.ndindex(*[len(r) for r in ranges]):
    index = tuple(r[p] for r, p in zip(ranges, position))
    key = "/".join(["c", *map(str, index)])
    flat = int(np.ravel_multi_index(index, grid)) if index else 0
    job = chunk_io.ReadJob(str(path / key), file_nbytes, checksums[flat])
    try:
      data = chunk_io.read_file(job, direct=False)
    except chunk_io.ChunkError as e:
      raise ValueError(str(e)) from e
    chunk = data[:file_nbytes].view(dtype).reshape(chunks)
    lo = [i * c for i, c in zip(index, chunks)]
    inter = [(max(a, s), min(b, s + c)) for (a, b), s, c in zip(box, lo, chunks)]
    out[tuple(slice(x - a, y - a) for (x, y), (a, _) in zip(inter, box))] = chunk[
      tuple(slice(x - s, y - s) for (x, y), s in zip(inter, lo))
    ]
  return out
