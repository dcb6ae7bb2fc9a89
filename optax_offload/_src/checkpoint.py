"""Orbax checkpoints of offloaded optimizer states, the NVMe tier included.

`OffloadSave` and `OffloadRestore` are Orbax `CheckpointArgs` handled by `OffloadCheckpointHandler`;
use them as an item of ``ocp.args.Composite`` with a ``CheckpointManager``, as ``ocp.args.StandardSave``
is used for parameters.

The checkpoint does not depend on where the state lived: it holds the *plain* inner optimizer state
(what `to_inner` returns), so it restores into any placement (device, host, NVMe, another
``host_limit``, another ``nvme_dir``, plain optax). In the Orbax item directory::

  <item>/_METADATA, manifest.ocdbt, ocdbt.process_0/, ...   PyTreeCheckpointHandler: the plain state;
                                                           NVMe-tier arrays are ocp.PLACEHOLDER there
  <item>/optax_offload/process_0/manifest.json             every array: path, shape, dtype, and for
                                                           NVMe-tier arrays this process's shards
  <item>/optax_offload/process_0/store_0/leaf00004_part0_shard0000/
                                                           one shard of an NVMe-tier array: the store's
                                                           zarr3 files (chunk checksums in zarr.json),
                                                           hard-linked or copied
  <item>/optax_offload/process_0/store_0/leaf00000_part0_shard0000_rows000000-000025/
                                                           a row slice of a shard, for a leaf the plan
                                                           streams in row slices

Each process saves the parts its store holds (its devices' distinct shards, or their row slices),
under its own ``process_{i}``, and the manifest records the region (box) of each; restore reads,
for each region the target needs, the saved regions that overlap it (from any process's
directory), so a checkpoint restores into another sharding, process count or row slicing
(another ``window_bytes``). Checkpoints of whole shards, saved before NVMe leaves were sliced,
restore the same way: the format (version 2) is unchanged.

NVMe-tier arrays are not read at save time: the generation the state names is pinned in its store
(`NvmeStore.pin`), and its files, immutable once committed, are hard-linked into the checkpoint
(zero copy), or copied when the checkpoint is on another filesystem. Deleting ``nvme_dir`` afterwards
loses nothing: a hard link is a name of the same data. On restore, NVMe-tier arrays of the target are
written into its store as a new generation, one store group at a time, and device and host arrays are
restored by Orbax straight into the target's shardings (``pinned_host`` included).

Length: about 900 lines, over the ~500 we aim for: one Orbax handler (save, restore, metadata)
with its NVMe-tier paths and the multi-process rendezvous they need; Orbax's own handlers are
longer. Splitting save from restore would duplicate the item layout they share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import json
import logging
import os
import pathlib
import shutil
import threading
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from optax_offload._src import _compat
from optax_offload._src import layout as layout_lib
from optax_offload._src import memory
from optax_offload._src import nvme
from optax_offload._src import nvme_tier
from optax_offload._src.state import OffloadState

logger = logging.getLogger(__name__)

FORMAT = "optax_offload.checkpoint"
FORMAT_VERSION = 2
SUBDIR = "optax_offload"
"""Directory of the offload-specific files inside the Orbax item directory."""
_MANIFEST = "manifest.json"
# Failures of os.link that mean "links are not possible here" (another filesystem, no hard links).
_NO_LINK_ERRNOS = frozenset(
  {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
)
_NEEDS_TARGET = (
  "OffloadRestore needs the target state: oo.OffloadRestore(tx.init(params)), made by the offload "
  "transformation (and nvme_dir) that is to hold the restored state."
)


# ------------------------------------------------------------------------------------------------
# The plain view of a state.


@dataclasses.dataclass(frozen=True, eq=False)
class _NvmeRef:
  """Stands for an NVMe-tier array in the plain state (a pytree leaf)."""

  store: int  # index of its OffloadState among the tree's OffloadStates
  key: tuple[int, int]  # (leaf index, array index) in the NvmeTier
  shape: tuple[int, ...]
  dtype: np.dtype
  placeholder: Any  # what the OffloadState holds in its place


def _is_offload_state(x: Any) -> bool:
  return isinstance(x, OffloadState) or _is_nnx_form(x)


def _is_nnx_form(x: Any) -> bool:
  """An `OffloadState` as ``nnx.state(optimizer)`` holds it: a mapping of its fields.

  NNX turns the named tuple into a mapping (``nnx.State``) and wraps each array in a Variable;
  ``nnx.as_pure`` of that leaves a dict of arrays.
  """
  return (
    isinstance(x, Mapping)
    and not isinstance(x, OffloadState)
    and set(x.keys()) == set(OffloadState._fields)
  )


def _nnx_view(x: Mapping) -> tuple[OffloadState, Callable[[Any, Any], Any]]:
  """An `OffloadState` whose inner is the NNX form's, and how to rebuild the NNX form.

  ``rebuild(inner, generation)`` returns the mapping with that inner (same structure) and that
  generation, in the same Variables.
  """
  (store,) = jax.tree.leaves(x["nvme_store"])
  (generation,) = jax.tree.leaves(x["nvme_generation"])
  flat, treedef = jax.tree_util.tree_flatten_with_path(x)
  fields = [_key_name(path[0]) for path, _ in flat]

  def rebuild(inner: Any, new_generation: Any) -> Any:
    inner_leaves = iter(jax.tree.leaves(inner))
    out = []
    for field, (_, leaf) in zip(fields, flat):
      if field == "inner":
        out.append(next(inner_leaves))
      elif field == "nvme_generation":
        out.append(new_generation)
      else:
        out.append(leaf)
    return treedef.unflatten(out)

  return OffloadState(x["inner"], store, generation), rebuild


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _normalized(path: Sequence[Any]) -> tuple[str, ...]:
  """A tree path by names only, without Variables' ``.value``: the same in the NNX form."""
  return tuple(
    _key_name(k)
    for k in path
    if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
  )


def _with_refs_by_path(inner: Any, tier: nvme_tier.NvmeTier, k: int) -> Any:
  """`_with_refs` for an inner state in NNX form: NVMe arrays found by their paths."""
  where = {key: _normalized(path) for key, path in tier.array_paths().items()}
  flat, treedef = jax.tree_util.tree_flatten_with_path(inner)
  index = {_normalized(path): n for n, (path, _) in enumerate(flat)}
  leaves = [x for _, x in flat]
  for key in tier.keys():
    n = index.get(where[key])
    if n is None:
      raise ValueError(
        f"optax_offload checkpoint: NVMe array {'/'.join(where[key])} is not in this optimizer "
        "state. Pass nnx.state(optimizer) (or nnx.as_pure(optimizer.opt_state)) as it is."
      )
    leaves[n] = _NvmeRef(k, key, *tier.shape_dtype(key), leaves[n])
  return treedef.unflatten(leaves)


def _is_ref(x: Any) -> bool:
  return isinstance(x, _NvmeRef)


@dataclasses.dataclass
class _Plain:
  """A state seen as its plain inner state, with `_NvmeRef` leaves for NVMe-tier arrays."""

  outer_def: Any  # tree structure with each OffloadState as a leaf
  outer: list[Any]  # its leaves: arrays and OffloadStates (or their NNX form)
  states: list[OffloadState]  # the OffloadStates, in tree order (of an NNX form: a view)
  rebuilds: list[Callable[[Any, Any], Any] | None]  # for an NNX form, see `_nnx_view`
  tiers: list[nvme_tier.NvmeTier | None]  # their NVMe tiers
  plain_def: Any  # structure of the plain state (`_NvmeRef` are leaves)
  paths: list[str]
  leaves: list[Any]


def _tier_of(state: OffloadState) -> nvme_tier.NvmeTier | None:
  if not isinstance(state.nvme_store, jax.Array | np.ndarray | int):
    raise TypeError(
      "optax_offload checkpoints need a concrete optimizer state (the one tx.init(params) or "
      f"tx.update returned), got {type(state.nvme_store).__name__} in OffloadState.nvme_store."
    )
  if int(np.asarray(state.nvme_store)) < 0:
    return None
  return nvme_tier.lookup(state.nvme_store)


def _with_refs(inner: Any, tier: nvme_tier.NvmeTier, k: int) -> Any:
  return tier.replace_arrays(inner, lambda key, x: _NvmeRef(k, key, *tier.shape_dtype(key), x))


def _decompose(state: Any) -> _Plain:
  outer, outer_def = jax.tree.flatten(state, is_leaf=_is_offload_state)
  states, rebuilds, tiers, inners = [], [], [], []
  for x in outer:
    if not _is_offload_state(x):
      inners.append(x)
      continue
    rebuild = None
    if _is_nnx_form(x):
      x, rebuild = _nnx_view(x)
    tier = _tier_of(x)
    if tier is None:
      inners.append(x.inner)
    elif rebuild is None:
      inners.append(_with_refs(x.inner, tier, len(states)))
    else:
      inners.append(_with_refs_by_path(x.inner, tier, len(states)))
    states.append(x)
    rebuilds.append(rebuild)
    tiers.append(tier)
  flat, plain_def = jax.tree_util.tree_flatten_with_path(
    outer_def.unflatten(inners), is_leaf=_is_ref
  )
  paths = [layout_lib.leaf_path(p) for p, _ in flat]
  return _Plain(outer_def, outer, states, rebuilds, tiers, plain_def, paths, [x for _, x in flat])


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], str]:
  if _is_ref(x):
    return tuple(x.shape), np.dtype(x.dtype).name
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  return tuple(int(d) for d in np.shape(x)), np.dtype(dtype).name


# ------------------------------------------------------------------------------------------------
# Files.


# The store's own durability helpers: one implementation for NVMe files.
_fsync = nvme.fsync_path


def _copy_file(src: str, dst: pathlib.Path) -> None:
  shutil.copyfile(src, dst)
  _fsync(dst)


def _link_tree(src: pathlib.Path, dst: pathlib.Path, link: bool) -> str:
  """Hard-links (or copies) every file under `src` into `dst`; returns "link" or "copy"."""
  if not src.is_dir():
    raise nvme.NvmeCorruptionError(f"NVMe array directory {src} is missing.")
  mode = "link" if link else "copy"
  made = []

  def fail(e):
    raise e

  for dirpath, _, filenames in os.walk(src, onerror=fail):
    out = dst / os.path.relpath(dirpath, src)
    out.mkdir(parents=True, exist_ok=True)
    made.append(out)
    for name in filenames:
      source = os.path.join(dirpath, name)
      if mode == "link":
        try:
          os.link(source, out / name)
          continue
        except OSError as e:
          if e.errno not in _NO_LINK_ERRNOS:
            raise
          logger.info("optax_offload checkpoint: cannot hard-link %s (%s); copying.", source, e)
          mode = "copy"
      _copy_file(source, out / name)
  for d in reversed(made):
    _fsync(d, directory=True)
  _fsync(dst.parent, directory=True)
  return mode


def _root(directory: Any) -> pathlib.Path:
  return pathlib.Path(os.fspath(directory)) / SUBDIR


def _process_dir(directory: Any) -> pathlib.Path:
  return _root(directory) / f"process_{jax.process_index()}"


def _read_manifest(directory: Any) -> dict[str, Any]:
  """This process's manifest, with every process's NVMe shards merged into its NVMe entries."""
  own = _process_dir(directory) / _MANIFEST
  paths = sorted(_root(directory).glob(f"process_*/{_MANIFEST}"))
  if not own.exists() and not paths:
    raise FileNotFoundError(
      f"{directory} is not a complete optax_offload checkpoint item: {own} is missing. Save "
      "optimizer states with oo.OffloadSave and restore them with oo.OffloadRestore."
    )
  if own in paths:  # this process's first: its non-NVMe entries are the ones used
    paths = [own] + [p for p in paths if p != own]
  manifests = []
  for path in paths:
    try:
      manifest = json.loads(path.read_text())
      if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')!r} is not {FORMAT!r}")
      if int(manifest["version"]) != FORMAT_VERSION:
        raise ValueError(f"version {manifest['version']} is not {FORMAT_VERSION}")
      manifest["arrays"] = list(manifest["arrays"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise nvme.NvmeCorruptionError(f"checkpoint manifest {path} cannot be read: {e}") from e
    manifests.append(manifest)
  first = manifests[0]
  shards: dict[str, list[dict[str, Any]]] = {}
  for manifest in manifests:
    for entry in manifest["arrays"]:
      if entry["nvme"] is not None:
        shards.setdefault(entry["path"], []).extend(entry["nvme"])
  for entry in first["arrays"]:
    if entry["nvme"] is not None:  # a replicated array's shard is saved by every process: once
      unique = {tuple(map(tuple, s["region"])): s for s in shards.get(entry["path"], [])}
      entry["nvme"] = list(unique.values())
  return first


def _region_slices(region: Sequence[Sequence[int]]) -> tuple[slice, ...]:
  return tuple(slice(int(a), int(b)) for a, b in region)


def _read_region(
  directory: Any, shards: Sequence[dict[str, Any]], region, dtype: np.dtype, context
) -> np.ndarray:
  """Reads a box of an NVMe-tier array of a checkpoint from the saved shards that overlap it.

  Checksums are verified; a box not covered by the saved shards is an error.
  """
  region = [(int(a), int(b)) for a, b in region]
  out = np.empty([b - a for a, b in region], dtype)
  covered = 0
  for shard in shards:
    saved = [(int(a), int(b)) for a, b in shard["region"]]
    box = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, saved)]
    if any(a >= b for a, b in box):
      continue
    path = _root(directory) / shard["file"]
    try:
      # The store's reader: it verifies the checksums that its zarr.json keeps (TensorStore would
      # read the chunks of format 2 unverified).
      want = [b - a for a, b in saved]
      data = nvme.read_region(
        path, want, [(a - c, b - c) for (a, b), (c, _) in zip(box, saved)], context
      )
    except (
      Exception
    ) as e:  # TensorStore reports missing and corrupt files as ValueError and others.
      raise nvme.NvmeCorruptionError(
        f"NVMe data of the checkpoint at {path} failed verification: {e}"
      ) from e
    if data.dtype != dtype:
      if data.dtype.itemsize != dtype.itemsize:
        raise nvme.NvmeCorruptionError(
          f"NVMe data of the checkpoint at {path} is {data.dtype}, expected {dtype}."
        )
      data = data.view(dtype)  # the store keeps dtypes zarr3 lacks as unsigned ints of that width
    out[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(box, region))] = data
    covered += int(np.prod([b - a for a, b in box]))
    if covered >= out.size:
      break
  if covered < out.size:
    raise nvme.NvmeCorruptionError(
      f"NVMe data of the checkpoint {directory} does not cover region {region} of an array: its "
      "shards are missing (a process's optax_offload/process_* directory was lost?)."
    )
  return out


# ------------------------------------------------------------------------------------------------
# The handler.


@dataclasses.dataclass
class _SavePlan:
  item: Any  # the plain state for PyTreeCheckpointHandler, NVMe arrays as ocp.PLACEHOLDER
  has_pytree: bool
  arrays: list[dict[str, Any]]
  sources: list[tuple[pathlib.Path, str]]  # (generation's array directory, name in the checkpoint)
  pinned: list[tuple[nvme_tier.NvmeTier, int]]
  started: bool = False  # whether the background part ran (it unpins); else `_release_if_dropped`


def _unpin(pinned: Sequence[tuple[nvme_tier.NvmeTier, int]]) -> None:
  for tier, generation in pinned:
    try:
      tier.unpin(generation)
    except (RuntimeError, ValueError, nvme.NvmeError) as e:  # closed store, failed store
      logger.warning(
        "optax_offload checkpoint: could not unpin generation %d of %s: %s",
        generation,
        tier.directory,
        e,
      )


def _release_if_dropped(future: Any, plan: _SavePlan) -> None:
  """Unpins when Orbax gives up on a save before its background part ran.

  Orbax waits for the checkpoint directory to be created before running a handler's background
  part; when creating it fails (read-only or full filesystem), that part never runs, and would
  otherwise leave the generation pinned.
  """
  try:
    future.result()
  except BaseException as e:  # The save failed; Orbax reports it to the caller.
    logger.debug("optax_offload checkpoint: save failed: %s", e)
  if not plan.started:
    _unpin(plan.pinned)


class OffloadCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Orbax handler for optimizer states holding `OffloadState`s (anywhere in the tree).

  Use it through its args, `OffloadSave` and `OffloadRestore` (registered with it, so
  ``ocp.args.Composite`` finds it), or pass an instance in ``item_handlers`` to configure it.
  Device and host arrays are written by Orbax's ``PyTreeCheckpointHandler``; NVMe-tier arrays are
  hard-linked from the store (or copied when ``link=False`` or linking is impossible).

  Args:
    link: hard-link the NVMe tier's files into the checkpoint where the filesystem allows it.
    **pytree_kwargs: passed to ``ocp.PyTreeCheckpointHandler`` (e.g. ``use_ocdbt``).
  """

  SUBDIR = SUBDIR

  def __init__(self, *, link: bool = True, **pytree_kwargs):
    self._link = link
    self._pytree = ocp.PyTreeCheckpointHandler(**pytree_kwargs)

  # -- save ---------------------------------------------------------------------------------------

  def _plan_save(self, state: Any) -> _SavePlan:
    plain = _decompose(state)
    pinned = []
    try:
      generations = {}
      for k, (s, tier) in enumerate(zip(plain.states, plain.tiers)):
        if tier is None:
          continue
        generation = int(np.asarray(s.nvme_generation))  # waits for the step that made it
        try:
          tier.pin(generation)
        except ValueError:
          raise _stale_generation_error(generation, tier) from None
        pinned.append((tier, generation))
        generations[k] = generation
      arrays, sources, item_leaves = [], [], []
      for path, x in zip(plain.paths, plain.leaves):
        shape, dtype = _shape_dtype(x)
        entry = {"path": path, "shape": list(shape), "dtype": dtype, "nvme": None}
        if _is_ref(x):
          tier = plain.tiers[x.store]
          entry["nvme"] = []
          for region, src in tier.stored_parts(x.key, generations[x.store]):
            name = f"process_{jax.process_index()}/store_{x.store}/{src.name}"
            entry["nvme"].append({"file": name, "region": [list(r) for r in region]})
            sources.append((src, name))
          item_leaves.append(ocp.PLACEHOLDER)
        else:
          item_leaves.append(x)
        arrays.append(entry)
    except BaseException:
      _unpin(pinned)
      raise
    has_pytree = any(leaf is not ocp.PLACEHOLDER for leaf in item_leaves)
    item = plain.plain_def.unflatten(item_leaves)
    return _SavePlan(item, has_pytree, arrays, sources, pinned)

  def _write_nvme(self, directory: Any, plan: _SavePlan) -> None:
    plan.started = True
    try:
      root = _process_dir(directory)
      root.mkdir(parents=True, exist_ok=True)
      start, modes = time.perf_counter(), set()
      for src, name in plan.sources:
        modes.add(_link_tree(src, _root(directory) / name, self._link))
      transfer = "copy" if "copy" in modes else ("link" if modes else None)
      manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "pytree": plan.has_pytree,
        "nvme_transfer": transfer,
        "arrays": plan.arrays,
      }
      nvme.write_json_atomic(root / _MANIFEST, manifest)
      _fsync(root.parent, directory=True)
      logger.info(
        "optax_offload checkpoint %s: %d NVMe arrays %s in %.3fs.",
        directory,
        len(plan.sources),
        {"link": "linked", "copy": "copied", None: "saved"}[transfer],
        time.perf_counter() - start,
      )
    finally:
      _unpin(plan.pinned)

  async def async_save(self, directory: Any, args: OffloadSave) -> list[Any] | None:
    """Starts saving `args.item`; returns the futures that complete it.

    Device and host arrays are copied before this returns (as Orbax does); NVMe generations are
    pinned until their files are linked (or copied) into the checkpoint.
    """
    plan = self._plan_save(args.item)
    try:
      futures = []
      if plan.has_pytree:
        futures += (
          await self._pytree.async_save(directory, args=ocp.args.PyTreeSave(item=plan.item)) or []
        )
    except BaseException:
      _unpin(plan.pinned)
      raise

    async def write_nvme():
      await asyncio.to_thread(self._write_nvme, directory, plan)

    future = ocp.future.CommitFutureAwaitingContractedSignals(
      write_nvme(), name="optax_offload_nvme"
    )
    if plan.pinned:
      threading.Thread(
        target=_release_if_dropped, args=(future, plan), name="optax_offload_unpin", daemon=True
      ).start()
    return [*futures, future]

  def save(self, directory: Any, args: OffloadSave) -> None:
    """Saves `args.item` synchronously."""

    async def run():
      for f in await self.async_save(directory, args) or []:
        f.result()

    try:
      asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
      asyncio.run(run())
      return
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(asyncio.run, run()).result()

  def finalize(self, directory: Any) -> None:
    if any(pathlib.Path(os.fspath(directory)).glob("ocdbt.process_*")):
      self._pytree.finalize(directory)

  # -- restore ------------------------------------------------------------------------------------

  def restore(self, directory: Any, args: OffloadRestore | None = None) -> Any:
    """Restores into the placement of ``args.item``; see `OffloadRestore`."""
    if args is None or args.item is None:
      raise ValueError(_NEEDS_TARGET)
    manifest = _read_manifest(directory)
    target = _decompose(args.item)
    saved = _check_matches(manifest, target, directory)
    context = nvme.ts_context()
    values = list(target.leaves)
    in_memory = [n for n, x in enumerate(target.leaves) if not _is_ref(x)]
    from_pytree = [n for n in in_memory if saved[target.paths[n]]["nvme"] is None]
    if from_pytree:
      values = self._restore_pytree(directory, target, from_pytree, values, numpy=False)
      for n in from_pytree:
        values[n] = _in_memory_space_of(values[n], target.leaves[n])
    for n in in_memory:
      entry = saved[target.paths[n]]
      if entry["nvme"] is not None:
        x = target.leaves[n]
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)

        def read(index, shards=entry["nvme"], shape=shape, dtype=dtype):
          region = [sl.indices(d)[:2] for sl, d in zip(index, shape)]
          return _read_region(directory, shards, region, dtype, context)

        if isinstance(x, jax.Array):
          values[n] = jax.make_array_from_callback(shape, x.sharding, read)
          values[n] = _in_memory_space_of(values[n], x)
        else:
          values[n] = read(tuple(slice(None) for _ in shape))
    generations = {}
    for k, tier in enumerate(target.tiers):
      if tier is not None:
        generations[k] = self._restore_store(directory, target, saved, k, tier, context)
    values = [x.placeholder if _is_ref(x) else v for x, v in zip(target.leaves, values)]
    parts = target.outer_def.flatten_up_to(target.plain_def.unflatten(values))
    out, k = [], 0
    for x, part in zip(target.outer, parts):
      if not _is_offload_state(x):
        out.append(part)
        continue
      state, rebuild = target.states[k], target.rebuilds[k]
      generation = state.nvme_generation
      if k in generations:
        sharding = getattr(generation, "sharding", None)
        generation = jax.device_put(np.asarray(generations[k], np.int32), sharding)
      if rebuild is None:
        out.append(OffloadState(part, state.nvme_store, generation))
      else:
        out.append(rebuild(part, generation))
      k += 1
    return target.outer_def.unflatten(out)

  def _restore_pytree(self, directory, target: _Plain, indices, values, numpy: bool) -> list[Any]:
    """Restores the plain leaves `indices` with Orbax (into their target shardings, or as numpy)."""
    wanted = set(indices)
    items, restore_args = [], []
    for n, x in enumerate(target.leaves):
      if n not in wanted:
        items.append(ocp.PLACEHOLDER)
        restore_args.append(ocp.RestoreArgs())
        continue
      shape, dtype = _shape_dtype(x)
      sharding = None if numpy or _is_ref(x) else getattr(x, "sharding", None)
      if sharding is None:
        items.append(jax.ShapeDtypeStruct(shape, dtype))
        restore_args.append(ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.dtype(dtype)))
      else:
        items.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
        restore_args.append(
          ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
        )
    restored = self._pytree.restore(
      directory,
      args=ocp.args.PyTreeRestore(
        item=target.plain_def.unflatten(items),
        restore_args=target.plain_def.unflatten(restore_args),
      ),
    )
    flat = target.plain_def.flatten_up_to(restored)
    return [flat[n] if n in wanted else v for n, v in enumerate(values)]

  def _restore_store(self, directory, target: _Plain, saved, k: int, tier, context) -> int:
    """Writes the target store's arrays as a new generation, one store group at a time."""
    where = {x.key: n for n, x in enumerate(target.leaves) if _is_ref(x) and x.store == k}
    full: dict[int, Any] = {}

    def fill(parts):  # (key, region) of each part of one store group
      nonlocal full
      members = sorted({where[key] for key, _ in parts})
      # A leaf stored in row slices spans consecutive groups: its array, read whole, serves them
      # all, and is dropped after the last.
      full = {n: x for n, x in full.items() if n in members}
      from_pytree = [n for n in members if saved[target.paths[n]]["nvme"] is None and n not in full]
      if from_pytree:  # saved from memory: Orbax reads the whole array (as numpy)
        flat = self._restore_pytree(
          directory, target, from_pytree, [None] * len(target.leaves), numpy=True
        )
        full.update({n: np.asarray(flat[n]) for n in from_pytree})
      arrays = []
      for key, region in parts:
        n = where[key]
        if n in full:
          arrays.append(np.ascontiguousarray(full[n][_region_slices(region)]))
        else:
          dtype = np.dtype(target.leaves[n].dtype)
          shards_saved = saved[target.paths[n]]["nvme"]
          arrays.append(_read_region(directory, shards_saved, region, dtype, context))
      return arrays

    generation = tier.write_generation(fill)
    logger.info(
      "optax_offload checkpoint %s: restored into %s, generation %d.",
      directory,
      tier.directory,
      generation,
    )
    return generation

  def metadata(self, directory: Any) -> dict[str, Any] | None:
    """The checkpoint's manifest: every array's path, shape, dtype and NVMe file (or None)."""
    try:
      return _read_manifest(directory)
    except FileNotFoundError:
      return None

  def close(self) -> None:
    self._pytree.close()


def _stale_generation_error(generation: int, tier: nvme_tier.NvmeTier) -> ValueError:
  return ValueError(
    f"Cannot save this optimizer state: the NVMe generation {generation} it names is no longer "
    f"in {tier.directory} (the store keeps the last two). Save the state the latest update "
    "returned."
  )


def _check_savable(state: Any) -> None:
  """Raises if `state` cannot be saved: abstract, closed NVMe store, or a stale generation."""
  plain = _decompose(state)
  for s, tier in zip(plain.states, plain.tiers):
    if tier is not None:
      generation = int(np.asarray(s.nvme_generation))  # waits for the step that made it
      if not tier.has_generation(generation):  # after its commit
        raise _stale_generation_error(generation, tier)


def _in_memory_space_of(x: Any, like: Any) -> Any:
  """`x` with the memory space of `like` in its type (not only in its sharding).

  Orbax builds restored arrays with a ``pinned_host`` sharding but a device-space type, which a
  jitted update then treats as device memory; `jax.device_put` to the space retypes it.
  """
  if not isinstance(x, jax.Array) or not isinstance(like, jax.Array):
    return x
  space = memory.space_of(like)
  if memory.space_of(x) == space:
    return x
  y = jax.device_put(x, space)
  x.delete()  # one leaf at a time: at most one extra copy
  return y


def _check_matches(manifest: dict[str, Any], target: _Plain, directory: Any) -> dict[str, Any]:
  """The manifest's arrays by path; raises when they do not match the target's."""
  saved = {e["path"]: e for e in manifest["arrays"]}
  want = {p: _shape_dtype(x) for p, x in zip(target.paths, target.leaves)}
  have = {p: (tuple(e["shape"]), e["dtype"]) for p, e in saved.items()}
  problems = []
  only_saved = [p for p in have if p not in want]
  only_target = [p for p in want if p not in have]
  differ = [p for p in want if p in have and have[p] != want[p]]
  if only_saved:
    problems.append(f"only in the checkpoint: {', '.join(only_saved[:5])}")
  if only_target:
    problems.append(f"only in the target: {', '.join(only_target[:5])}")
  for p in differ[:5]:
    (hs, hd), (ws, wd) = have[p], want[p]
    problems.append(f"{p} is {hd}{list(hs)} in the checkpoint but {wd}{list(ws)} in the target")
  if problems:
    quantized = [p for p in only_saved + only_target if p.endswith((".codes", ".scales"))]
    narrowed = [p for p in differ if {have[p][1], want[p][1]} == {"bfloat16", "float32"}]
    hint = ""
    if quantized or narrowed:  # (a plain optax target: moments of the optimizer's own dtype)
      hint = (
        " The moments' dtype differs (offload's moment_dtype: 8-bit codes and scales, or bf16, "
        "in one of them): restore into tx.init(params) of an offload with the moment_dtype the "
        "checkpoint was saved with; oo.to_inner(state) then gives the plain optax state."
      )
    raise ValueError(
      f"The optimizer state in {directory} does not match the restore target: "
      f"{'; '.join(problems)}. Restore into tx.init(params) of the same optimizer and a parameter "
      f"tree of the same structure, shapes and dtypes.{hint}"
    )
  return saved


_ZERO_SIZE_HINT = (
  "An optimizer state of optax_offload with an NVMe tier holds empty placeholders in place of its "
  "NVMe arrays (their data is in nvme_dir): save it with oo.OffloadSave and restore it with "
  "oo.OffloadRestore (as an item of ocp.args.Composite), not with StandardSave or PyTreeSave."
)


def _offload_save_hint(infos: Any) -> str | None:
  """For a failed restore of arrays that an `OffloadSave` item holds (its SUBDIR beside them), how
  to restore it; else None."""
  for info in infos:
    parent = getattr(info, "parent_dir", None)
    if parent is not None and os.path.isdir(os.path.join(os.fspath(parent), SUBDIR)):
      return (
        f"{os.fspath(parent)} was saved with oo.OffloadSave (its NVMe data and manifest are in "
        f"{SUBDIR}/ there): restore it with oo.OffloadRestore(tx.init(params)), as an item of "
        "ocp.args.Composite, not with StandardRestore or PyTreeRestore."
      )
  return None


# Orbax's own zero-size error names only the leaf; a StandardSave of an NVMe-tier state meets it
# first, and nothing of ours runs in such a save; a StandardRestore of an OffloadSave item fails in
# TensorStore, naming a leaf's file. So the hints go into the handler Orbax uses for jax.Array,
# once, when this module is imported (see docs/checkpoints.md, "What optax_offload changes in
# Orbax", and `_compat.install_orbax_array_handler` for the non-public parts it relies on).
_compat.install_orbax_array_handler(_ZERO_SIZE_HINT, _offload_save_hint)


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_save=True)
@dataclasses.dataclass
class OffloadSave(ocp.args.CheckpointArgs):
  """Saves an optimizer state with offloaded parts, as ``ocp.args.StandardSave`` saves a pytree.

  The state may hold `OffloadState`s anywhere (``optax.chain``, ``optax.MultiSteps``, ...) or none.
  NVMe-tier data is hard-linked into the checkpoint (copied across filesystems).

  Attributes:
    item: the optimizer state, as ``tx.init`` or ``tx.update`` returned it.

  Raises:
    ValueError: the state names an NVMe generation its store no longer keeps.
    RuntimeError: the state's NVMe store is closed.

  Examples:
    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> import optax_offload as oo
    >>> params = {"w": jnp.ones((128, 64)), "b": jnp.zeros(64)}
    >>> tx = oo.offload(optax.adam(1e-2), host_limit=0, nvme_dir=tempfile.mkdtemp())
    >>> state = tx.init(params)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...   _ = mngr.save(0, args=ocp.args.Composite(opt_state=oo.OffloadSave(state)))
    ...   mngr.wait_until_finished()
    ...   host_tx = oo.offload(optax.adam(1e-2))  # restore into another placement
    ...   target = host_tx.init(params)
    ...   restored = mngr.restore(0, args=ocp.args.Composite(opt_state=oo.OffloadRestore(target)))
    >>> oo.footprint(state), oo.footprint(restored["opt_state"])
    ({'device': 524, 'host': 0, 'nvme': 65536}, {'device': 524, 'host': 65536, 'nvme': 0})
    >>> restored["opt_state"].inner[0].mu["w"].sharding.memory_kind
    'pinned_host'
    >>> oo.close_nvme(state)
  """

  item: Any

  def __post_init__(self):
    # Checked here, before Orbax starts the save: an error raised once it has started leaves
    # Orbax's background threads waiting for the checkpoint directory (for minutes).
    _check_savable(self.item)


@ocp.args.register_with_handler(OffloadCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class OffloadRestore(ocp.args.CheckpointArgs):
  """Restores an optimizer state into the placement of a target state.

  Every array comes back where the target keeps it: device and ``pinned_host`` arrays in the
  target's shardings, NVMe-tier arrays as a new generation of the target's store. The checkpoint
  may come from another placement (another ``host_limit``, ``nvme_dir``, or plain optax).

  Attributes:
    item: the target, ``tx.init(params)`` of the offload transformation that is to hold the
      restored state; it also tells the tree structure, shapes and dtypes to expect.

  Raises:
    ValueError: `item` is None.

  Examples:
    The way back to plain optax: restore into a plain state (here with a standalone Checkpointer).

    >>> import tempfile, jax.numpy as jnp, optax, orbax.checkpoint as ocp
    >>> import optax_offload as oo
    >>> params = {"w": jnp.ones((128, 64))}
    >>> state = oo.offload(optax.sgd(0.1, momentum=0.9)).init(params)
    >>> path = tempfile.mkdtemp() + "/opt_state"
    >>> target = optax.sgd(0.1, momentum=0.9).init(params)
    >>> with ocp.Checkpointer(oo.OffloadCheckpointHandler()) as ckptr:
    ...   ckptr.save(path, args=oo.OffloadSave(state))
    ...   plain = ckptr.restore(path, args=oo.OffloadRestore(target))
    >>> plain[0].trace["w"].sharding.memory_kind
    'device'
  """

  item: Any

  def __post_init__(self):
    if self.item is None:
      raise ValueError(_NEEDS_TARGET)
