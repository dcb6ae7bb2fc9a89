"""Tests for the NVMe store (`optax_offload/_src/nvme/`): protocol, files on disk, locks and crashes."""

import errno
import gc
import json
import os
import pathlib
import queue
import random
import signal
import subprocess
import threading
import time

import ml_dtypes
import numpy as np
import nvme_child as child
import pytest
import tensorstore as ts
import xxhash
from helpers import child_env
from helpers import read_only
from helpers import small_disk
from helpers import start_child

from optax_offload._src import nvme
from optax_offload._src.nvme import LeafSpec
from optax_offload._src.nvme import NvmeCorruptionError
from optax_offload._src.nvme import NvmeStore
from optax_offload._src.nvme import NvmeWriteError
from optax_offload._src.nvme import chunk_io
from optax_offload._src.nvme import files as nvme_files
from optax_offload._src.nvme import format as nvme_format

# Small chunks so that the bigger leaves span several chunk files.
_CHUNK = 4096
_GROUPS = [
  [LeafSpec("w/f32", (40, 50), np.float32), LeafSpec("bias", (7,), np.float32)],  # 8000 B: 2 chunks
  [LeafSpec("mu_bf16", (3000,), ml_dtypes.bfloat16)],  # 6000 B: 2 chunks
  [
    LeafSpec("count_i32", (5, 3), np.int32),
    LeafSpec("big", (6000,), np.float32),
  ],  # 24000 B: 6 chunks
]


def _values(groups, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  out = {}
  for group in groups:
    for spec in group:
      if spec.dtype.kind in "iu":
        out[spec.name] = rng.integers(-1000, 1000, spec.shape).astype(spec.dtype)
      elif spec.dtype.itemsize >= 2:
        out[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
      else:  # Narrow ml_dtypes and bool: small integers are exact in all of them.
        out[spec.name] = rng.integers(0, 8, spec.shape).astype(spec.dtype)
  return out


def _assert_bit_equal(actual: dict, want: dict) -> None:
  assert sorted(actual) == sorted(want)
  for name in want:
    assert actual[name].dtype == want[name].dtype, name
    assert actual[name].shape == want[name].shape, name
    assert actual[name].tobytes() == want[name].tobytes(), name


def _gen_dirs(directory) -> list[str]:
  return sorted(p.name for p in pathlib.Path(directory).iterdir() if p.name.startswith("gen_"))


def _chunk_files(store: NvmeStore, generation: int, name: str) -> list[pathlib.Path]:
  leaf_dir = store.leaf_path(generation, name)
  return sorted(p for p in (leaf_dir / "c").rglob("*") if p.is_file())


def _step(name: str, x: np.ndarray, generation: int) -> np.ndarray:
  """A deterministic update that depends on the generation."""
  if x.dtype.kind in "iu":
    return x + np.asarray(generation, x.dtype)
  return (x * np.asarray(0.5, x.dtype) + np.asarray(generation, x.dtype)).astype(x.dtype)


def _run_protocol(store: NvmeStore, groups, reference: dict, start: int, steps: int) -> dict:
  for generation in range(start, start + steps):
    for g, group in enumerate(groups):
      arrays = store.fetch(g, generation)
      assert len(arrays) == len(group)
      new = []
      for spec, x in zip(group, arrays, strict=True):
        assert x.tobytes() == reference[spec.name].tobytes(), (spec.name, generation)
        new.append(_step(spec.name, x, generation))
        reference[spec.name] = _step(spec.name, reference[spec.name], generation)
      store.put(g, generation + 1, new)
    store.commit(generation + 1)
  return reference


# ------------------------------------------------------------------------------------------------------
# Round trips and layout.


def test_chunk_shape_splits_leading_axes():
  assert nvme_format.chunk_shape((100, 10), 4, 400) == (10, 10)
  assert nvme_format.chunk_shape((100, 10), 4, 1 << 20) == (100, 10)
  assert nvme_format.chunk_shape((4, 1000), 4, 400) == (1, 100)
  assert nvme_format.chunk_shape((), 4, 400) == ()
  assert nvme_format.chunk_shape((0, 3), 4, 400) == (1, 3)
  # About equal parts: 4 chunks rather than 3 of 16384 rows and a padded one, each rounded up to
  # 4 KiB (13312 rows) so that every chunk starts at an aligned offset of the array.
  assert nvme_format.chunk_shape((50_000,), 4, 64 << 10) == (13_312,)
  # Unless that takes more parts: 3 chunks of 1024 rows would be one 4 KiB chunk too many.
  assert nvme_format.chunk_shape((3000,), 2, 4096) == (2048,)
  assert nvme_format.chunk_shape((40, 50), 4, 4096) == (20, 50)
  assert nvme_format.chunk_shape((10,), 4, 12) == (3,)


def test_slab_layout_places_chunks_in_the_array():
  layout = nvme_format.slab_layout((50_000,), 4, (13_312,))
  assert [c.offset for c in layout.chunks] == [0, 53_248, 106_496, 159_744]
  assert [c.nbytes for c in layout.chunks] == [53_248] * 3 + [200_000 - 159_744]
  assert all(layout.in_place(c) for c in layout.chunks)
  # The last chunk's padding is read in place too: the buffer has room for its whole file.
  assert layout.buffer_nbytes == 4 * 53_248
  # Leading axes of chunk size 1: a row's edge chunk is followed by the next row's data.
  layout = nvme_format.slab_layout((4, 1000), 4, (1, 300))
  assert [c.key for c in layout.chunks[:5]] == ["c/0/0", "c/0/1", "c/0/2", "c/0/3", "c/1/0"]
  # Read apart: files of 1200 bytes (a direct read moves whole blocks, past the file's end).
  assert not any(layout.in_place(c) for c in layout.chunks[:-1])
  assert layout.in_place(layout.chunks[-1]) is False  # at offset 3900 * 4
  layout = nvme_format.slab_layout((4, 2048), 4, (1, 1024))
  assert all(layout.in_place(c) for c in layout.chunks)
  assert nvme_format.slab_layout((4, 1000), 4, (2, 300)) is None
  assert [c.key for c in nvme_format.slab_layout((), 8, ()).chunks] == ["c"]
  assert nvme_format.slab_layout((0, 3), 4, (1, 3)).chunks == ()


_MORE_GROUPS = _GROUPS + [
  [LeafSpec("scalar", (), np.float64), LeafSpec("flags", (9,), np.bool_)],
  [LeafSpec("u4", (11,), ml_dtypes.uint4), LeafSpec("f8", (2, 3), ml_dtypes.float8_e4m3fn)],
  # With 4 KiB chunks: (1, 1024) chunks, each row's last one an edge chunk followed by the next
  # row, and rows at unaligned offsets: read apart, not in place.
  [LeafSpec("rows", (4, 3000), np.float32), LeafSpec("empty", (0, 3), np.float32)],
]


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "page_cache"])
@pytest.mark.parametrize("chunk_bytes", [_CHUNK, 1 << 20])
def test_round_trip_dtypes_and_shapes(tmp_path, chunk_bytes, direct_io):
  groups = _MORE_GROUPS
  values = _values(groups, 0)
  with NvmeStore(tmp_path, groups, chunk_bytes=chunk_bytes, direct_io=direct_io) as store:
    store.write_initial(0, values)
    assert store.committed_generation == 0
    _assert_bit_equal(store.read_generation(), values)
    assert store.bytes_on_disk() == sum(v.nbytes for v in values.values())
    n_chunks = len(_chunk_files(store, 0, "big"))
    assert n_chunks == (6 if chunk_bytes == _CHUNK else 1)
    for g, group in enumerate(groups):
      for spec, x in zip(group, store.fetch(g, 0), strict=True):
        assert x.tobytes() == values[spec.name].tobytes()
    assert store._pipeline.io.direct == direct_io  # no fallback to the page cache happened
  with NvmeStore(tmp_path, groups, chunk_bytes=chunk_bytes, create=False) as store:
    assert store.committed_generation == 0
    _assert_bit_equal(store.read_generation(0), values)


def test_tensorstore_reads_the_files_and_zarr_json_keeps_the_checksums(tmp_path):
  values = _values(_MORE_GROUPS, 1)
  with NvmeStore(tmp_path, _MORE_GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    context = nvme.ts_context()
    for group in _MORE_GROUPS:
      for spec in group:
        path = store.leaf_path(0, spec.name)
        array = ts.open(nvme.zarr3_read_spec(str(path)), context=context).result().read().result()
        assert array.tobytes() == values[spec.name].tobytes(), spec.name
        meta = json.loads((path / "zarr.json").read_text())
        assert [c["name"] for c in meta["codecs"]] == ["bytes"]  # no checksum inside the chunks
        sums = meta["attributes"]["optax_offload"]
        files = sorted(
          (p for p in (path / "c").rglob("*") if p.is_file()) if spec.shape else [path / "c"],
          key=lambda p: [int(x) for x in p.relative_to(path / "c").parts],
        )
        assert sums["checksum"] == "xxh3_64" and len(sums["chunks"]) == len(files)
        for f, digest in zip(files, sums["chunks"]):
          assert xxhash.xxh3_64_hexdigest(f.read_bytes()) == digest
    # The chunk files of "big" are whole 4 KiB blocks (the last one padded): direct I/O engages.
    assert {f.stat().st_size for f in _chunk_files(store, 0, "big")} == {4096}


def test_aligned_arrays_are_written_without_a_staging_copy(tmp_path):
  groups = [[LeafSpec("a", (64, 1024), np.float32)], [LeafSpec("b", (3, 1024), np.float32)]]
  with NvmeStore(tmp_path, groups, chunk_bytes=64 << 10) as store:
    probe = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    alignment = chunk_io.dio_memory_alignment(probe)
    os.close(probe)
    if not alignment:
      pytest.skip(f"the file system of {tmp_path} does not say which memory direct I/O takes")
    values = _values(groups, 5)
    # "a" from page-aligned memory: its 4 chunk files (64 KiB each) go straight to disk; "b" is
    # 12 KiB of a 64 KiB file (padding) and from misaligned memory: staged.
    aligned = nvme.buffers.aligned_empty(values["a"].nbytes).view(np.float32).reshape(64, 1024)
    aligned[...] = values["a"]
    misaligned = np.empty(values["b"].size + 1, np.float32)[1:].reshape(3, 1024)
    misaligned[...] = values["b"]
    store.write_initial(0, {"a": aligned, "b": misaligned})
    assert store.stats["bytes_written_zero_copy"] == values["a"].nbytes
    _assert_bit_equal(store.read_generation(), values)
    context = nvme.ts_context()
    for name in values:
      path = str(store.leaf_path(0, name))
      array = ts.open(nvme.zarr3_read_spec(path), context=context).result().read().result()
      assert array.tobytes() == values[name].tobytes()


def _rewrite_as_format_1(store_dir: pathlib.Path, generation: int, groups) -> None:
  """Rewrites a committed generation the way format 1 stored it: crc32c codec inside each chunk."""
  context = nvme.ts_context()
  for group in groups:
    for leaf in nvme_format.stored_leaves([group], _CHUNK)[0]:
      path = store_dir / nvme_format.generation_dirname(generation) / leaf.dirname
      data = ts.open(nvme.zarr3_read_spec(str(path)), context=context).result().read().result()
      spec = nvme_format.zarr3_write_spec(
        str(path), leaf.spec.shape, leaf.zarr_dtype, leaf.chunk_shape, crc32c=True
      )
      ts.open(spec, context=context).result().write(data).result()
  manifest = json.loads((store_dir / "MANIFEST.json").read_text())
  manifest["version"] = 1
  (store_dir / "MANIFEST.json").write_text(json.dumps(manifest))


def test_format_1_stores_are_read_and_continued(tmp_path):
  values = _values(_GROUPS, 3)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
  _rewrite_as_format_1(tmp_path, 0, _GROUPS)
  meta = json.loads((tmp_path / "gen_00000000" / "big" / "zarr.json").read_text())
  assert [c["name"] for c in meta["codecs"]] == ["bytes", "crc32c"]
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    _assert_bit_equal(store.read_generation(), values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=2)
    store.sync()
    _assert_bit_equal(store.read_generation(), reference)
  manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
  assert manifest["version"] == nvme_format.FORMAT_VERSION == 2
  # Corruption of a format 1 chunk is still found (by TensorStore's crc32c codec) and named.
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(5, values)
  _rewrite_as_format_1(tmp_path, 5, _GROUPS)
  chunk = sorted((tmp_path / "gen_00000005" / "big" / "c").rglob("*"))[-1]
  data = bytearray(chunk.read_bytes())
  data[10] ^= 1
  chunk.write_bytes(bytes(data))
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    with pytest.raises(
      NvmeCorruptionError, match="leaf 'big' of generation 5 .*failed verification"
    ):
      store.fetch(2, 5)


@pytest.mark.parametrize("fmt", [1, 2])
def test_read_region_reads_and_verifies_boxes_of_either_format(tmp_path, fmt):
  groups = [[LeafSpec("x", (40, 50), np.float32)]]
  values = _values(groups, 6)
  with NvmeStore(tmp_path, groups, chunk_bytes=_CHUNK) as store:  # chunks of 20 rows
    store.write_initial(0, values)
    path = store.leaf_path(0, "x")
  if fmt == 1:
    _rewrite_as_format_1(tmp_path, 0, groups)
  box = [(15, 33), (7, 50)]  # rows of both chunks
  got = nvme.read_region(path, (40, 50), box)
  np.testing.assert_array_equal(got, values["x"][15:33, 7:50])
  with pytest.raises(ValueError, match=r"shape is \[40, 50\], expected \[40, 51\]"):
    nvme.read_region(path, (40, 51), box)
  chunk = sorted((path / "c").rglob("*"))[-1]  # c/1/0: rows 20-39
  data = bytearray(chunk.read_bytes())
  data[8] ^= 0x04
  chunk.write_bytes(bytes(data))
  np.testing.assert_array_equal(
    nvme.read_region(path, (40, 50), [(0, 20), (0, 50)]), values["x"][:20]
  )
  with pytest.raises(ValueError, match="x/c/1/0"):  # the file, named (a checksum mismatch)
    nvme.read_region(path, (40, 50), box)


def test_a_newer_format_is_refused(tmp_path):
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, _values(_GROUPS, 0))
  manifest = json.loads((tmp_path / "MANIFEST.json").read_text())
  manifest["version"] = 3
  (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
  with pytest.raises(nvme.NvmeError, match="format version 3, newer .*upgrade optax_offload"):
    NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK)


def test_direct_io_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog):
  real_open = os.open

  def no_direct(path, flags, *args, **kwargs):
    if flags & getattr(os, "O_DIRECT", 0):
      raise OSError(errno.EINVAL, "Invalid argument")
    return real_open(path, flags, *args, **kwargs)

  monkeypatch.setattr(os, "open", no_direct)
  values = _values(_GROUPS, 4)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=2)
    _assert_bit_equal(store.read_generation(), reference)
    assert not store._pipeline.io.direct
  assert "direct I/O refused" in caplog.text


def test_put_rejects_bad_arrays_and_committed_generations(tmp_path):
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    values = _values(_GROUPS, 0)
    store.write_initial(3, values)
    good = [values[s.name] for s in _GROUPS[1]]
    with pytest.raises(ValueError, match="mu_bf16"):
      store.put(1, 4, [good[0].astype(np.float32)])
    with pytest.raises(ValueError, match="immutable"):
      store.put(1, 3, good)
    with pytest.raises(ValueError, match=r"groups \[0, 2\]"):
      store.put(1, 4, good)
      store.commit(4)
    with pytest.raises(ValueError, match="neither committed"):
      store.fetch(0, 7)
    with pytest.raises(ValueError, match="missing leaves"):
      store.write_initial(5, {})


def test_put_accepts_jax_arrays(tmp_path):
  import jax.numpy as jnp

  groups = [[LeafSpec("p", (64, 3), jnp.bfloat16), LeafSpec("q", (5,), jnp.float32)]]
  arrays = [jnp.arange(192, dtype=jnp.bfloat16).reshape(64, 3), jnp.ones(5, jnp.float32)]
  with NvmeStore(tmp_path, groups) as store:
    store.put(0, 0, arrays)
    store.commit(0)
    out = store.read_generation()
  _assert_bit_equal(out, {"p": np.asarray(arrays[0]), "q": np.asarray(arrays[1])})


# ------------------------------------------------------------------------------------------------------
# The cyclic protocol, prefetch and write-behind.


@pytest.mark.parametrize(
  "prefetch_depth, write_depth", [(0, 1), (1, 1), (2, 2), (4, 1), (1, 3)], ids=str
)
def test_cyclic_protocol_matches_numpy(tmp_path, prefetch_depth, write_depth):
  values = _values(_GROUPS, 1)
  store = NvmeStore(
    tmp_path,
    _GROUPS,
    prefetch_depth=prefetch_depth,
    write_depth=write_depth,
    chunk_bytes=_CHUNK,
  )
  start = time.perf_counter_ns()
  store.write_initial(0, values)
  reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=5)
  store.sync()
  stats = store.stats
  elapsed = time.perf_counter_ns() - start  # (after the stats: a prefetch may still be reading)
  assert store.committed_generation == 5
  _assert_bit_equal(store.read_generation(), reference)
  assert stats["fetches"] == 5 * len(_GROUPS)
  assert stats["prefetch_hits"] + stats["buffer_hits"] + stats["misses"] == stats["fetches"]
  if prefetch_depth:
    assert stats["prefetch_hits"] + stats["buffer_hits"] > 0, stats
  else:
    assert stats["prefetch_hits"] == 0
  assert 0 < stats["peak_buffer_bytes"] <= store.host_buffer_bound
  # The disk's busy time holds every write (one writer thread, its writes timed inside it), and
  # no more than the whole run.
  assert stats["write_ns"] <= stats["disk_busy_ns"] <= elapsed, stats
  max_group = max(sum(s.nbytes for s in g) for g in _GROUPS)
  # Read buffers hold a leaf plus room for its last chunk's padding, page-rounded; writes go
  # through one staging buffer per I/O thread, as large as the largest chunk file (page-rounded).
  leaves = nvme_format.stored_leaves(_GROUPS, _CHUNK)
  max_read = max(sum(leaf.layout.buffer_nbytes for leaf in g) for g in leaves)
  # Group 2: "big", 6 chunk files of 4 KiB (the last holds 880 of 1024 rows), "count_i32" a page.
  assert max_read == 4096 * 6 + 4096
  staging = 4 * 4096
  assert store.host_buffer_bound == (
    (prefetch_depth + 1) * max_read + write_depth * max_group + staging
  )
  store.close()
  store.close()  # Idempotent.
  with pytest.raises(RuntimeError, match="closed"):
    store.fetch(0, 5)

  # Reopen: the committed generation is there, bit-equal, and old generations are gone.
  assert _gen_dirs(tmp_path) == ["gen_00000004", "gen_00000005"]
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK, create=False) as store:
    assert store.committed_generation == 5
    assert store.generations_on_disk == [4, 5]
    _assert_bit_equal(store.read_generation(), reference)
    reference = _run_protocol(store, _GROUPS, reference, start=5, steps=1)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    _assert_bit_equal(store.read_generation(6), reference)
  assert _gen_dirs(tmp_path) == ["gen_00000005", "gen_00000006"]


def _data_address(array: np.ndarray) -> int:
  return array.__array_interface__["data"][0]


def test_reads_reuse_buffers_that_nothing_refers_to(tmp_path):
  """Group reads go into buffers an earlier read touched, but never into one whose views are still held."""
  values = _values(_GROUPS, 7)
  # prefetch_depth=1: the store keeps buffers for 2 groups (the prefetched one and the caller's).
  with NvmeStore(tmp_path, _GROUPS, prefetch_depth=1, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    held = store.fetch(2, 0)  # kept: its buffers must stay as they are
    address = _data_address(held[1])
    store.sync()
    kept = store._pipeline.read_buffers
    addresses = []
    for _ in range(3):
      again = store.fetch(2, 0)
      assert _data_address(again[1]) != address  # `held` still refers to the first buffers
      assert _data_address(again[1]) in kept.addresses()  # a buffer the store keeps
      addresses.append(_data_address(again[1]))
      np.testing.assert_array_equal(again[1], values["big"])
      del again  # let go: the next read may reuse its buffers
    assert addresses[0] == addresses[1] == addresses[2]  # every later read went into one buffer
    np.testing.assert_array_equal(held[1], values["big"])
    assert not held[1].flags.writeable
    # Past the capacity ((prefetch_depth + 1) groups), reads still work, into fresh arrays.
    many = [store.fetch(g, 0) for g in range(len(_GROUPS)) for _ in range(3)]
    for arrays, g in zip(many, [g for g in range(len(_GROUPS)) for _ in range(3)]):
      for spec, array in zip(_GROUPS[g], arrays):
        np.testing.assert_array_equal(array, values[spec.name])


def _slow_writer(store: NvmeStore, gate: threading.Event) -> None:
  """Makes the store's writer wait for `gate` before each group write."""
  write = store._pipeline.write_group

  def gated(op):
    assert gate.wait(10)
    write(op)

  store._pipeline.write_group = gated


def test_put_blocks_when_write_depth_writes_are_pending(tmp_path):
  values = _values(_GROUPS, 2)
  with NvmeStore(tmp_path, _GROUPS, write_depth=2, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    gate = threading.Event()
    _slow_writer(store, gate)
    arrays = [[values[s.name] for s in group] for group in _GROUPS]
    start = time.monotonic()
    store.put(0, 1, arrays[0])
    store.put(1, 1, arrays[1])
    assert time.monotonic() - start < 1.0
    third = threading.Thread(target=store.put, args=(2, 1, arrays[2]))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "put must block while write_depth writes are pending"
    assert store.stats["buffer_bytes"] <= store.host_buffer_bound
    gate.set()
    third.join(10)
    assert not third.is_alive()
    store.commit(1)
    store.sync()
    _assert_bit_equal(store.read_generation(1), values)


def test_prefetch_of_next_generation_waits_for_its_write(tmp_path):
  """Group 0 of generation g + 1 is prefetched while its write is still pending: served from the buffer."""
  values = _values(_GROUPS, 3)
  with NvmeStore(tmp_path, _GROUPS, prefetch_depth=1, write_depth=3, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    gate = threading.Event()
    _slow_writer(store, gate)
    reference = dict(values)
    for g, group in enumerate(_GROUPS):
      arrays = store.fetch(g, 0)
      new = [_step(s.name, x, 0) for s, x in zip(group, arrays, strict=True)]
      reference.update({s.name: n for s, n in zip(group, new, strict=True)})
      if g < len(_GROUPS) - 1:
        store.put(g, 1, new)
      else:
        last = new
    # The last fetch scheduled group 0 of generation 1, whose write is still held at the gate.
    misses = store.stats["misses"]
    first = store.fetch(0, 1)
    assert store.stats["misses"] == misses
    for spec, x in zip(_GROUPS[0], first, strict=True):
      assert x.tobytes() == reference[spec.name].tobytes()
      assert not x.flags.writeable
    gate.set()
    store.put(len(_GROUPS) - 1, 1, last)
    store.commit(1)
    store.sync()
    _assert_bit_equal(store.read_generation(), reference)


def test_a_dropped_store_commits_its_queue_and_releases_the_lock(tmp_path):
  values = _values(_GROUPS, 8)
  store = NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK)
  store.write_initial(0, values)
  reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=2)  # queued, not synced
  del store  # its finalizer closes it: the queued writes and commits are done first
  gc.collect()
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK, create=False) as store:  # the lock is free
    assert store.committed_generation == 2
    _assert_bit_equal(store.read_generation(), reference)


def test_a_commit_makes_its_data_durable_before_it_publishes_the_manifest(tmp_path, monkeypatch):
  # What crash safety rests on, and a SIGKILL cannot see (the page cache survives it, a power cut
  # does not): the generation's files and directories, and the store directory that names the
  # generation's directory, are fsynced before MANIFEST.json is replaced; the new manifest is
  # fsynced before it replaces the old one; the store directory is fsynced after the replace.
  events = []
  real_fsync, real_replace = os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    real_fsync(fd)

  def replace(src, dst, *args, **kwargs):
    real_replace(src, dst, *args, **kwargs)
    events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))

  directory = pathlib.Path(os.path.realpath(tmp_path))
  values = _values(_GROUPS, 11)
  with NvmeStore(directory, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.sync()
    monkeypatch.undo()
  manifest = str(directory / "MANIFEST.json")
  (publish,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == manifest]
  before = {e[1] for e in events[:publish] if e[0] == "fsync"}
  after = {e[1] for e in events[publish + 1 :] if e[0] == "fsync"}
  generation = directory / "gen_00000001"
  data = {str(p) for p in generation.rglob("*") if p.is_file()}
  assert len(data) >= 10 and data <= before  # chunk files and zarr.json of every leaf
  assert {str(generation)} | {str(p) for p in generation.rglob("*") if p.is_dir()} <= before
  assert {str(directory), manifest + ".tmp"} <= before
  assert str(directory) in after


def test_pin_keeps_a_generation(tmp_path):
  values = _values(_GROUPS, 4)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.pin(1)
    store.pin(1)  # pins are counted: e.g. two checkpoints saving it at once
    _run_protocol(store, _GROUPS, reference, start=1, steps=3)
    store.sync()
    assert store.generations_on_disk == [1, 3, 4]
    store.unpin(1)
    assert "gen_00000001" in _gen_dirs(tmp_path)
    assert json.loads((tmp_path / "MANIFEST.json").read_text())["pinned"] == [1]
    store.unpin(1)
    assert _gen_dirs(tmp_path) == ["gen_00000003", "gen_00000004"]
    with pytest.raises(ValueError, match="not a committed generation"):
      store.pin(1)


def _spare_dirs(directory) -> list[str]:
  return sorted(p.name for p in pathlib.Path(directory).iterdir() if p.name.startswith("spare_"))


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "page_cache"])
def test_dropped_generations_are_written_over_in_place(tmp_path, direct_io):
  values = _values(_GROUPS, 11)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK, direct_io=direct_io) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.sync()
    inodes = {p.stat().st_ino for p in _chunk_files(store, 0, "big")}
    for generation in range(1, 5):
      # A step at a time, each durable before the next: then each dropped generation is the spare
      # when the next one's writes begin (unsynced, the writes may start first and find none, and
      # the spare is deleted at the next drop: CI saw generation 0's files gone once).
      reference = _run_protocol(store, _GROUPS, reference, start=generation, steps=1)
      store.sync()
    # Generation 0's chunk files hold a later generation's data now: same inodes, new contents.
    now = {p.stat().st_ino for p in tmp_path.rglob("*") if p.is_file() and "/c/" in str(p)}
    assert inodes <= now
    # Writing generation g waits for g - 2's commit, which dropped g - 4: generations 4 and 5
    # take every leaf from a spare (earlier ones may, depending on the threads' timing).
    assert store.stats["leaves_reused"] >= 2 * 5
    assert _gen_dirs(tmp_path) == ["gen_00000004", "gen_00000005"]
    assert len(_spare_dirs(tmp_path)) <= 1
    _assert_bit_equal(store.read_generation(), reference)
    for group in _GROUPS:  # TensorStore reads the files written over in place
      for spec in group:
        path = str(store.leaf_path(5, spec.name))
        array = ts.open(nvme.zarr3_read_spec(path), context=nvme.ts_context()).result()
        assert array.read().result().tobytes() == reference[spec.name].tobytes(), spec.name
  assert _spare_dirs(tmp_path) == []  # deleted at close
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK, direct_io=direct_io) as store:
    _assert_bit_equal(store.read_generation(), reference)
    _run_protocol(store, _GROUPS, reference, start=5, steps=1)


def test_a_spare_is_kept_only_within_the_bound_of_generations_on_disk(tmp_path):
  for g in range(5):
    (tmp_path / nvme_format.generation_dirname(g) / "leaf").mkdir(parents=True)
  spares = nvme_files.Spares(tmp_path, limit=4)
  spares.retire(tmp_path / nvme_format.generation_dirname(0))  # 4 left: deleted, not kept
  assert _spare_dirs(tmp_path) == [] and len(_gen_dirs(tmp_path)) == 4
  spares.retire(tmp_path / nvme_format.generation_dirname(1))  # 3 left + the spare
  assert _spare_dirs(tmp_path) == ["spare_gen_00000001"]
  spares.retire(tmp_path / nvme_format.generation_dirname(2))  # replaces the older spare
  assert _spare_dirs(tmp_path) == ["spare_gen_00000002"] and len(_gen_dirs(tmp_path)) == 2


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "page_cache"])
def test_a_longer_file_written_over_is_cut_to_size(tmp_path, direct_io):
  path = tmp_path / "c"
  path.write_bytes(b"x" * 3 * 4096)
  io = chunk_io.ChunkIO(threads=1, direct=direct_io)
  try:
    job = chunk_io.WriteJob(str(path), np.arange(10, dtype=np.uint8), file_nbytes=16)
    io.write([job])
    assert path.read_bytes() == bytes(range(10)) + bytes(6)
    read = chunk_io.ReadJob(str(path), 16, job.checksum, target=np.empty(10, np.uint8))
    io.read([read])
  finally:
    io.shutdown()


def test_reuse_leaves_hard_linked_files_alone(tmp_path):
  """A checkpoint hard-links a pinned generation's files; reusing them later must not change them."""
  values = _values(_GROUPS, 12)
  linked = tmp_path / "checkpoint"
  with NvmeStore(tmp_path / "store", _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.pin(1)
    saved = dict(reference)
    leaf_dir = store.leaf_path(1, "big")
    for path in leaf_dir.rglob("*"):
      if path.is_file():
        (linked / path.relative_to(leaf_dir)).parent.mkdir(parents=True, exist_ok=True)
        os.link(path, linked / path.relative_to(leaf_dir))
    store.unpin(1)
    reference = _run_protocol(store, _GROUPS, reference, start=1, steps=4)
    store.sync()
    assert store.stats["leaves_reused"] > 0
    _assert_bit_equal(store.read_generation(), reference)
  box = nvme.read_region(linked, (6000,), [(0, 6000)])
  assert box.tobytes() == saved["big"].tobytes()


def test_new_generation_only_from_the_newest_or_its_parent(tmp_path):
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    with pytest.raises(nvme.StaleGenerationError, match="newest generation is none"):
      store.new_generation(parent=0)
    first = store.new_generation()  # a new lineage (what init and restore do)
    store.write_initial(first, _values(_GROUPS, 6))
    child = store.new_generation(parent=first)
    assert store.new_generation(parent=first) > child  # from the newest's parent: MultiSteps
    newest = store.new_generation(parent=first)
    with pytest.raises(
      nvme.StaleGenerationError,
      match=rf"generation {child} is stale.* is {newest}, made from {first}",
    ):
      store.new_generation(parent=child)
    assert store.new_generation(parent=newest) == newest + 1  # the refusal changed nothing
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:  # reopened: the committed one
    assert store.committed_generation == first
    assert store.new_generation(parent=first) == first + 1


def test_pins_of_an_earlier_process_are_dropped_on_open(tmp_path):
  # A pin is held by a checkpoint save in progress; if its process dies, nothing will unpin it.
  values = _values(_GROUPS, 4)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.pin(1)
    reference = _run_protocol(store, _GROUPS, reference, start=1, steps=3)
  assert _gen_dirs(tmp_path) == ["gen_00000001", "gen_00000003", "gen_00000004"]
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    assert store.generations_on_disk == [3, 4]
    assert _gen_dirs(tmp_path) == ["gen_00000003", "gen_00000004"]
    _assert_bit_equal(store.read_generation(), reference)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    assert store.generations_on_disk == [3, 4]


def test_uncommitted_generations_are_removed_on_open(tmp_path):
  values = _values(_GROUPS, 5)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    store.put(0, 1, [values[s.name] for s in _GROUPS[0]])  # Never committed.
  (tmp_path / "gen_00000099" / "junk").mkdir(parents=True)
  (tmp_path / "MANIFEST.json.tmp").write_text("{")
  assert _gen_dirs(tmp_path) == ["gen_00000000", "gen_00000001", "gen_00000099"]
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    assert store.committed_generation == 0
    assert _gen_dirs(tmp_path) == ["gen_00000000"]
    assert not (tmp_path / "MANIFEST.json.tmp").exists()
    _assert_bit_equal(store.read_generation(), values)


def test_changed_leaves_are_refused(tmp_path):
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, _values(_GROUPS, 6))
  changed = [list(g) for g in _GROUPS]
  changed[1] = [LeafSpec("mu_bf16", (3001,), ml_dtypes.bfloat16)]
  with pytest.raises(ValueError, match=r"group 1 leaf 0: shape \[3000\] stored, \[3001\] given"):
    NvmeStore(tmp_path, changed)
  with pytest.raises(ValueError, match="3 groups stored, 2 given"):
    NvmeStore(tmp_path, _GROUPS[:2])
  with NvmeStore(tmp_path, _GROUPS) as store:  # The failed opens released the lock.
    assert store.committed_generation == 0


# ------------------------------------------------------------------------------------------------------
# Locking, paths and permissions.


def test_lock_in_process(tmp_path):
  with NvmeStore(tmp_path, _GROUPS):
    with pytest.raises(RuntimeError, match=rf"{tmp_path}.*pid {os.getpid()}.*another nvme_dir"):
      NvmeStore(tmp_path, _GROUPS)
  with NvmeStore(tmp_path, _GROUPS):
    pass


def test_missing_directory_with_create_false(tmp_path):
  with pytest.raises(FileNotFoundError, match="create=True"):
    NvmeStore(tmp_path / "absent", _GROUPS, create=False)
  assert not (tmp_path / "absent").exists()


def test_path_under_a_regular_file(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(NotADirectoryError, match="not a directory"):
    NvmeStore(tmp_path / "file" / "store", _GROUPS)
  with pytest.raises(NotADirectoryError, match="not a directory"):
    NvmeStore(tmp_path / "file", _GROUPS)


@pytest.mark.parametrize("how", ["mount", "injected"])
def test_a_read_only_directory_is_refused_with_the_fix(tmp_path, how):
  with read_only(tmp_path / "ro", how) as target:
    with pytest.raises(PermissionError, match="not writable.*writable nvme_dir"):
      NvmeStore(target, _GROUPS)
    with pytest.raises(PermissionError, match="cannot create.*writable nvme_dir"):
      NvmeStore(target / "sub", _GROUPS)


def test_a_directory_without_write_permission_is_refused_with_the_fix(tmp_path):
  if os.geteuid() == 0:
    pytest.skip("root ignores permission bits (the read-only tests cover root)")
  target = tmp_path / "ro"
  target.mkdir()
  target.chmod(0o500)
  with pytest.raises(PermissionError, match="not writable.*writable nvme_dir"):
    NvmeStore(target, _GROUPS)
  with pytest.raises(PermissionError, match="cannot create.*writable nvme_dir"):
    NvmeStore(target / "sub", _GROUPS)


# ------------------------------------------------------------------------------------------------------
# Failures: corruption, full disk, I/O errors.


@pytest.mark.parametrize("damage", ["flip", "padding", "truncate", "missing", "metadata"])
def test_corruption_is_detected(tmp_path, damage):
  values = _values(_GROUPS, 7)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
    reference = _run_protocol(store, _GROUPS, dict(values), start=0, steps=1)
    store.sync()
    chunk = _chunk_files(store, 1, "big")[2]
  if damage == "flip":
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x10
    chunk.write_bytes(bytes(data))
    shown = str(chunk)
  elif damage == "padding":  # past the array's end in the last chunk: the checksum covers it too
    chunk = _chunk_files(store, 1, "big")[-1]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0x01
    chunk.write_bytes(bytes(data))
    shown = str(chunk)
  elif damage == "truncate":
    chunk.write_bytes(chunk.read_bytes()[:-10])
    shown = str(chunk)
  elif damage == "missing":
    chunk.unlink()
    shown = str(chunk)
  else:
    (chunk.parents[1] / "zarr.json").unlink()
    shown = str(chunk.parents[1])
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    with pytest.raises(NvmeCorruptionError, match="leaf 'big' of generation 1") as info:
      store.read_generation()
    assert shown in str(info.value)
    with pytest.raises(NvmeCorruptionError, match="leaf 'big'"):
      store.fetch(2, 1)
    # Untouched leaves of the committed generation still read, through prefetch too.
    for g in (0, 1):
      for spec, x in zip(_GROUPS[g], store.fetch(g, 1), strict=True):
        assert x.tobytes() == reference[spec.name].tobytes()
    with pytest.raises(NvmeCorruptionError, match="leaf 'big'"):
      store.fetch(2, 1)


def test_io_error_in_writer_surfaces_and_keeps_committed_generation(tmp_path):
  values = _values(_GROUPS, 8)
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    store.write_initial(0, values)
  # A regular file where generation 1's directory must go: every write of generation 1 fails.
  (tmp_path / "gen_00000001").write_text("in the way")
  store = NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK)
  (tmp_path / "gen_00000001").write_text("in the way")  # The open removed the stray entry.
  store.put(0, 1, [values[s.name] for s in _GROUPS[0]])
  with pytest.raises(NvmeWriteError, match=r"leaf 'w/f32' of generation 1 to .*gen_00000001"):
    store.sync()
  for call in (
    lambda: store.fetch(0, 0),
    lambda: store.put(1, 1, [values["mu_bf16"]]),
    lambda: store.commit(1),
    store.sync,
  ):
    with pytest.raises(NvmeWriteError):
      call()
  store.close()  # Already reported: closes quietly.
  with NvmeStore(tmp_path, _GROUPS, chunk_bytes=_CHUNK) as store:
    assert store.committed_generation == 0
    _assert_bit_equal(store.read_generation(), values)


def test_unreported_error_is_raised_by_close(tmp_path):
  values = _values(_GROUPS, 9)
  (tmp_path / "store").mkdir()
  store = NvmeStore(tmp_path / "store", _GROUPS, chunk_bytes=_CHUNK)
  (tmp_path / "store" / "gen_00000000").write_text("in the way")
  store.put(0, 0, [values[s.name] for s in _GROUPS[0]])
  with pytest.raises(NvmeWriteError, match="gen_00000000"):
    store.close()
  store.close()


@pytest.mark.parametrize("how", ["mount", "injected"])
def test_full_disk_raises_and_keeps_committed_generation(tmp_path, how):
  # ~400 KB per generation on a 1 MiB filesystem: two committed generations fit, a third does not.
  groups = [[LeafSpec("m", (50_000,), np.float32)], [LeafSpec("v", (50_000,), np.float32)]]
  values = _values(groups, 10)
  with small_disk(tmp_path / "small", 1 << 20, how) as directory:
    store = NvmeStore(directory, groups, chunk_bytes=64 << 10)
    store.write_initial(0, values)
    reference = _run_protocol(store, groups, dict(values), start=0, steps=1)
    store.sync()
    with pytest.raises(NvmeWriteError, match=r"of generation 2 .*disk looks full"):
      _run_protocol(store, groups, dict(reference), start=1, steps=1)
      store.sync()
    with pytest.raises(NvmeWriteError):
      store.sync()
    store.close()
    assert _gen_dirs(directory) == ["gen_00000000", "gen_00000001"]
    with NvmeStore(directory, groups, create=False) as store:
      assert store.committed_generation == 1
      _assert_bit_equal(store.read_generation(), reference)
      _assert_bit_equal(store.read_generation(0), values)


# ------------------------------------------------------------------------------------------------------
# Other processes: lock and SIGKILL at random moments.


class _Zygote:
  """`tests/nvme_child.py`: imports the store once and forks a worker per command."""

  def __init__(self):
    env = child_env(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    self.proc = start_child("nvme_child.py", env=env, stdin=subprocess.PIPE, stderr=None)
    self.lines = queue.Queue()
    threading.Thread(target=self._pump, daemon=True).start()
    self.expect("zygote", timeout=60)

  def _pump(self):
    for line in self.proc.stdout:
      self.lines.put(line.split())

  def send(self, *words):
    self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
    self.proc.stdin.flush()

  def expect(self, *kinds, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
      words = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
      if words[0] in kinds:
        return words
      if words[0] in ("bad", "error"):
        raise AssertionError(" ".join(words))

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(10)


@pytest.fixture(scope="module")
def zygote():
  z = _Zygote()
  yield z
  z.close()


def _kill(pid: int) -> None:
  os.kill(pid, signal.SIGKILL)
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return
    time.sleep(0.005)
  raise AssertionError(f"process {pid} did not die")


def test_lock_across_processes(tmp_path, zygote):
  store = NvmeStore(tmp_path, child.GROUPS, chunk_bytes=child.CHUNK_BYTES)
  zygote.send("open", tmp_path)
  words = zygote.expect("error", "opened")
  message = " ".join(words)
  assert words[2] == "RuntimeError" and f"pid {os.getpid()}" in message and str(tmp_path) in message
  store.close()
  zygote.send("hold", tmp_path)
  pid = int(zygote.expect("holding")[1])
  try:
    with pytest.raises(RuntimeError, match=rf"locked by another NvmeStore \(process pid {pid}\)"):
      NvmeStore(tmp_path, child.GROUPS, chunk_bytes=child.CHUNK_BYTES)
  finally:
    _kill(pid)
  with NvmeStore(tmp_path, child.GROUPS, chunk_bytes=child.CHUNK_BYTES):
    pass


def test_sigkill_at_random_moments_keeps_last_committed_generation(tmp_path, zygote):
  rng = random.Random(0)
  directory = tmp_path / "store"
  generations, interrupted = [], 0
  for trial in range(12):
    zygote.send("run", directory, trial)
    words = zygote.expect("ready")
    pid, start_generation = int(words[1]), int(words[2])
    time.sleep(rng.uniform(0.0, 0.4))
    _kill(pid)
    # The writer runs at most 2 generations ahead of the last commit.
    assert len(_gen_dirs(directory)) <= 4 + 1  # + 1: killed between publishing and deleting.
    interrupted += len(_gen_dirs(directory)) > 2
    with NvmeStore(directory, child.GROUPS, chunk_bytes=child.CHUNK_BYTES) as store:
      committed = store.committed_generation
      assert committed >= start_generation
      on_disk = _gen_dirs(directory)
      assert on_disk == [f"gen_{g:08d}" for g in store.generations_on_disk]
      assert len(on_disk) <= 2
      if committed >= 0:
        _assert_bit_equal(store.read_generation(), child.expected(committed))
    generations.append(committed)
  assert generations[-1] > 0, generations
  assert interrupted > 0, "no kill landed while a generation was being written"
  assert not any(w[0] == "bad" for w in list(zygote.lines.queue))


def test_a_store_stopped_before_any_commit_says_so(tmp_path):
  # Every use after a failed write says what is intact and what to do; where nothing was
  # committed yet it named "generation (-1)" (helper review /tmp/revC).
  store = nvme.NvmeStore(tmp_path / "s", [[nvme.LeafSpec("a", (256,), np.float32)]])

  def no_space(op):
    raise OSError(errno.ENOSPC, "No space left on device (injected)")

  store._pipeline.write_group = no_space
  store.put(0, store.new_generation(), [np.zeros(256, np.float32)])
  with pytest.raises(nvme.NvmeWriteError, match="injected"):
    store.sync()
  with pytest.raises(nvme.NvmeWriteError, match="nothing was committed yet. Once the cause"):
    store.sync()
  store.close()  # (the error was reported: it closes)
