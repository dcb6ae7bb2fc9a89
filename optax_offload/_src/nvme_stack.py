"""Layer stacks on NVMe: weights that `offloaded_scan` reads from the drive one layer at a time.

A model whose stacked layer weights fit neither on the card nor in RAM (a 70B model's weights
are 140 GB in bf16) can keep them on an NVMe drive: `write_nvme_stack` writes a stack once, a layer per store
group (`nvme.NvmeStore`: zarr3 files that TensorStore reads, checksummed, read with direct I/O),
and returns the stack with an `NvmeStackLeaf` in place of each array. `offloaded_scan` takes such
leaves beside arrays in pinned host memory or on the device: each layer's weights come from the
drive by one callback per layer, read ahead in the order the pass needs them (the forward pass up
the layers, the backward pass down them, then the next step's forward), so the store reads the next
layer while this one computes. The host holds a few layers' buffers, never the stack.

Passed to the loss as an argument of its own, the weights on NVMe are frozen: `offloaded_scan`
computes no gradient for them (the backward pass differentiates only the stack's other leaves, the
carry and what the body closes over), as for adapters (LoRA) trained on a base too large for RAM.
Inside the params that `value_and_update` trains, they are trained: its backward pass reads each
layer again, updates it, and writes each block's new weights into the store's next generation
(`Writes`), committed after the optimizer state's; the params come back with leaves at the new
generation. `tx.update` and `update_and_apply` refuse them (the stack's whole gradients never
exist).

The read is a `jax.pure_callback` (a committed generation of a frozen stack reads the same bytes
every time, so `jax.checkpoint` may run it again), chained by a token in program order. On a mesh
of several devices it runs once and its layer is replicated to every device (data parallelism;
the weights are not sharded). One process: a stack's directory is locked by the process that
opened it.

Examples:
  >>> import tempfile, jax, jax.numpy as jnp, numpy as np, optax_offload as oo
  >>> layers = {"w": np.full((3, 4, 4), 0.5, np.float32)}
  >>> base = oo.write_nvme_stack(tempfile.mkdtemp(), layers)
  >>> base["w"]
  NvmeStackLeaf(shape=(3, 4, 4), dtype=float32, path="['w']")
  >>> def body(x, w):
  ...   return jnp.tanh(x @ w["w"]), None
  >>> y, _ = jax.jit(lambda x, base: oo.offloaded_scan(body, x, base))(jnp.ones((2, 4)), base)
  >>> float(y[0, 0]) == float(jax.lax.scan(body, jnp.ones((2, 4)), layers)[0][0, 0])
  True
  >>> oo.close_nvme_stack(base)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from optax_offload._src import nvme
from optax_offload._src import units

FORMAT = "optax_offload.nvme_stack"
VERSION = 1
DESCRIPTION = "stack.json"
"""The stack's description (leaf paths, shapes, dtypes, layers), written once the data is
committed: a directory with it holds a complete stack."""
STORE = "store"
FETCH_SCOPE = "nvme_stack_fetch"
"""`jax.named_scope` of the per-layer read callback (in its HLO ``op_name``)."""
PUT_SCOPE = "nvme_stack_put"
"""`jax.named_scope` of the callback that writes a block of a trained stack's layers."""


@jax.tree_util.register_pytree_node_class
class NvmeStackLeaf:
  """One stacked leaf of a layer stack kept on NVMe, in place of its array.

  It stands for an array of `shape` and `dtype` (leading axis: the layers), and is a pytree node
  whose only child is the store generation it reads (an int32 scalar), so it passes through
  `jax.jit` like the arrays beside it. `offloaded_scan` reads its layers; nothing else does.
  """

  def __init__(self, generation: Any, directory: str, path: str, shape, dtype, uid: str = ""):
    self.generation = generation
    self.directory = directory
    self.path = path
    self.shape = tuple(int(d) for d in shape)
    self.dtype = np.dtype(dtype)
    # The stack's id (in its description): a stack written later in its place has another.
    self.uid = uid

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  def tree_flatten(self):
    return (self.generation,), (self.directory, self.path, self.shape, self.dtype.name, self.uid)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self) -> str:
    return f'NvmeStackLeaf(shape={self.shape}, dtype={self.dtype.name}, path="{self.path}")'

  def __jax_array__(self):
    raise TypeError(
      f"NvmeStackLeaf {self.path} (in {self.directory}) is a layer stack on NVMe, not an array: "
      "only oo.offloaded_scan reads it, a layer at a time. Pass the stack to oo.offloaded_scan "
      "(read it whole with oo.read_nvme_stack)."
    )


def is_leaf(x: Any) -> bool:
  """Whether `x` is an `NvmeStackLeaf` (an `is_leaf` for tree maps over a stack)."""
  return isinstance(x, NvmeStackLeaf)


@dataclasses.dataclass
class _Opened:
  """An open stack directory: its store and description."""

  store: nvme.NvmeStore
  paths: list[str]
  num_layers: int
  uid: str
  last: tuple[tuple[int, int], list[np.ndarray]] | None = None
  """The layer read last, by (layer, generation): the passes read a layer twice in a row where
  they turn (the forward's last layer, the backward's first), which the store would read again."""

  def read(self, i: int, generation: int, stop: int) -> list[np.ndarray]:
    """Layer `i`, the layers after it up to `stop` read ahead (the store's ``prefetch_depth``)."""
    return self.fetch(i, generation, [(j, generation) for j in range(i + 1, stop)])

  def fetch(self, i: int, generation: int, then: list[tuple[int, int]]) -> list[np.ndarray]:
    last = self.last
    if last is not None and last[0] == (i, generation):
      return last[1]
    try:
      arrays = self.store.fetch(i, generation, then=then)
    except ValueError as e:
      on_disk = self.store.generations_on_disk
      if not on_disk or generation >= min(on_disk):
        raise
      raise ValueError(
        f"The layer stack leaves name generation {generation} of the stack at "
        f"{self.store.directory.parent}, which later steps have replaced (on disk: generations "
        f"{list(on_disk)}). Use the leaves the last step returned, oo.open_nvme_stack for the "
        "last committed weights, or oo.copy_nvme_stack at the step whose weights you want kept."
      ) from e
    except nvme.NvmeCorruptionError as e:
      names = ", ".join(f"leaf{j} = {p}" for j, p in enumerate(self.paths))
      raise nvme.NvmeCorruptionError(
        f"layer {i} of the layer stack at {self.store.directory.parent} failed verification "
        f"({names}): {e} The stack on disk is damaged: write it again from its source into a new "
        "directory (oo.write_nvme_stack)."
      ) from e
    self.last = ((i, generation), arrays)
    return arrays


_LOCK = threading.Lock()
_OPEN: dict[str, _Opened] = {}


def _key(directory: str | os.PathLike) -> str:
  return os.path.abspath(units.expanded_path(directory, "directory"))


def _dtype(a: Any) -> np.dtype:
  return np.dtype(a.dtype) if hasattr(a, "dtype") else np.asarray(a).dtype


def _groups(paths, shapes, dtypes, num_layers) -> list[list[nvme.LeafSpec]]:
  return [
    [nvme.LeafSpec(f"leaf{j}_layer{i}", s, d) for j, (s, d) in enumerate(zip(shapes, dtypes))]
    for i in range(num_layers)
  ]


DEFAULT_OPTIONS = nvme.NvmeOptions(prefetch_depth=2)
"""The store's options unless given: two layers read ahead (the next pair of the pass). Options
given replace them whole (`NvmeOptions`' own default reads one layer ahead): pass
``prefetch_depth=2`` with them to keep two."""


def _store(root: pathlib.Path, groups, options, create: bool) -> nvme.NvmeStore:
  """The stack's store, its errors about the directory said for a stack.

  Raises:
    RuntimeError: another process (or an optimizer state's NVMe tier) holds the directory.
    NotADirectoryError: the directory or a parent is a regular file.
  """
  o = DEFAULT_OPTIONS if options is None else nvme.NvmeOptions.of(options)
  try:
    return nvme.NvmeStore(root / STORE, groups, create=create, **dataclasses.asdict(o))
  except RuntimeError as e:
    raise RuntimeError(
      f"The layer stack directory {root} is in use by another process or store ({e}). Close "
      "the stack there with oo.close_nvme_stack(stack) (or let that process exit), or use "
      "another directory."
    ) from e
  except NotADirectoryError as e:
    raise NotADirectoryError(
      f"The layer stack directory {root} is not a directory, or a parent of it is a file ({e}); "
      "pass a directory."
    ) from e


def write_nvme_stack(
  directory: str | os.PathLike,
  layers: Any,
  num_layers: int | None = None,
  *,
  options: nvme.NvmeOptions | None = None,
) -> Any:
  """Writes a layer stack to NVMe, one layer at a time; returns it as `NvmeStackLeaf` leaves.

  Args:
    directory: a directory on the drive for this stack alone (made if missing). One that holds
      a stack already is refused: open it with `open_nvme_stack`.
    layers: the stack, a pytree of arrays with a common leading layer axis (numpy, or jax arrays
      anywhere); or a function ``layers(i)`` returning layer ``i``'s pytree (arrays without the
      layer axis), so that a stack larger than RAM is written as it is made or loaded.
    num_layers: the number of layers, with a function (ignored otherwise).
    options: the store's `NvmeOptions` (layers read ahead, chunk size, direct I/O); default
      `DEFAULT_OPTIONS`.

  Returns:
    The stack's pytree with an `NvmeStackLeaf` per leaf, for `offloaded_scan`.

  Raises:
    FileExistsError: `directory` holds a stack already; nothing there is changed.
    ValueError: the leaves disagree on the layer axis, a function's layers disagree in structure,
      shape or dtype, or `num_layers` is missing; nothing is described as written.
  """
  key = _key(directory)
  root = pathlib.Path(key)
  if (root / DESCRIPTION).exists():
    raise FileExistsError(
      f"write_nvme_stack: {key} holds a layer stack already (its {DESCRIPTION}); open it with "
      "oo.open_nvme_stack(directory, like), or write to another directory (delete this one to "
      "write it again)."
    )
  if callable(layers):
    if num_layers is None or int(num_layers) < 1:
      raise ValueError("write_nvme_stack: give num_layers (>= 1) with a function of the layer.")
    n = int(num_layers)
    first = layers(0)
    flat, treedef = jax.tree_util.tree_flatten_with_path(first)
    if not flat:
      raise ValueError("write_nvme_stack: layer 0 has no leaves; return the layer's arrays.")
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    shapes = [tuple(np.shape(a)) for _, a in flat]
    dtypes = [_dtype(a) for _, a in flat]
    full = [(n, *s) for s in shapes]
  else:
    flat, treedef = jax.tree_util.tree_flatten_with_path(layers)
    if not flat:
      raise ValueError("write_nvme_stack: the layer stack has no leaves.")
    sizes = {jax.tree_util.keystr(p): (np.shape(a)[0] if np.ndim(a) else None) for p, a in flat}
    if len(set(sizes.values())) != 1 or None in sizes.values() or 0 in sizes.values():
      raise ValueError(
        "write_nvme_stack: every leaf of the stack needs the same leading (layer) axis of at "
        f"least 1; got {sizes}."
      )
    n = next(iter(sizes.values()))
    paths = list(sizes)
    full = [tuple(np.shape(a)) for _, a in flat]
    shapes = [s[1:] for s in full]
    dtypes = [_dtype(a) for _, a in flat]

  def layer(i: int) -> list[np.ndarray]:
    """Layer `i`'s arrays, on the host."""
    if not callable(layers):
      return [np.asarray(jax.device_get(a[i])) for _, a in flat]
    tree = first if i == 0 else layers(i)
    if jax.tree.structure(tree) != treedef:
      raise ValueError(
        f"write_nvme_stack: layer {i} has the structure {jax.tree.structure(tree)}, layer 0 had "
        f"{treedef}; every layer needs the same structure, shapes and dtypes."
      )
    return [np.asarray(jax.device_get(a)) for a in jax.tree.leaves(tree)]

  with _LOCK:  # a stack that lived here was deleted while open: its store goes first
    stale = _OPEN.pop(key, None)
  if stale is not None:
    stale.store.close()
  store = _store(root, _groups(paths, shapes, dtypes, n), options, create=True)
  try:
    generation = store.new_generation()
    for i in range(n):
      arrays = layer(i)
      got = [(a.shape, a.dtype) for a in arrays]
      if got != list(zip(shapes, dtypes)):
        raise ValueError(
          f"write_nvme_stack: layer {i} has leaves {got}, layer 0 had {list(zip(shapes, dtypes))}; "
          "every layer needs the same structure, shapes and dtypes."
        )
      store.put(i, generation, arrays)
    store.commit(generation)
    store.sync()
  except BaseException:
    store.close()
    raise
  doc = {
    "format": FORMAT,
    "version": VERSION,
    "uid": uuid.uuid4().hex,
    "num_layers": n,
    "leaves": [
      {"path": p, "shape": list(s), "dtype": d.name} for p, s, d in zip(paths, full, dtypes)
    ],
  }
  nvme.write_json_atomic(root / DESCRIPTION, doc)
  opened = _Opened(store, paths, n, doc["uid"])
  with _LOCK:
    _OPEN[key] = opened
  return _leaves(key, treedef, full, dtypes, opened, _placement([a for _, a in flat]))


def _placement(arrays: Sequence[Any]) -> Any:
  """Where the leaves' generations go, so that a step that trains the stack returns them placed
  as they came (else its second call compiles again), where no other use can clash with it:
  replicated on the mesh of the arrays the stack was written from (or that `like` describes) when
  that mesh spans every device, else on the one device of a machine of one; else uncommitted (None),
  which a jitted function over any mesh takes."""
  devices = jax.devices()
  for a in arrays:
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      if sharding.mesh.size == len(devices):
        return jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(), memory_kind="device"
        )
      return None
  return devices[0] if len(devices) == 1 else None


def _leaves(key, treedef, full, dtypes, opened: _Opened, placement: Any = None) -> Any:
  gen = np.asarray(opened.store.committed_generation, np.int32)
  # An array of its own per leaf: a step that trains the stack donates each.
  return jax.tree.unflatten(
    treedef,
    [
      NvmeStackLeaf(
        jnp.asarray(gen) if placement is None else jax.device_put(gen, placement),
        key,
        p,
        s,
        d,
        opened.uid,
      )
      for p, s, d in zip(opened.paths, full, dtypes)
    ],
  )


def open_nvme_stack(
  directory: str | os.PathLike, like: Any, *, options: nvme.NvmeOptions | None = None
) -> Any:
  """Opens a stack that `write_nvme_stack` wrote (in this process or an earlier one).

  Args:
    directory: the stack's directory.
    like: the stack's structure: a pytree of arrays, `jax.ShapeDtypeStruct`s or `NvmeStackLeaf`s
      with the layer axis (e.g. ``jax.eval_shape`` of the function that makes the layers, or the
      leaves of the stack before it was closed).
    options: the store's `NvmeOptions` (default `DEFAULT_OPTIONS`), where this process has not
      opened the stack yet.

  Returns:
    The stack's pytree with an `NvmeStackLeaf` per leaf.

  Raises:
    FileNotFoundError: `directory` holds no complete stack.
    ValueError: `like` differs from the stack on disk (the message lists the differences).
  """
  key = _key(directory)
  doc = _description(key)
  flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=is_leaf)
  want = [(jax.tree_util.keystr(p), list(np.shape(a)), _dtype(a).name) for p, a in flat]
  have = [(d["path"], d["shape"], d["dtype"]) for d in doc["leaves"]]
  if want != have:
    diffs = [f"{w} != {h}" for w, h in zip(want, have) if w != h]
    if len(want) != len(have):
      diffs.append(f"{len(want)} leaves given, {len(have)} stored")
    raise ValueError(
      f"open_nvme_stack: {key} holds another stack than `like` describes: {'; '.join(diffs)}. "
      "Pass the structure, shapes and dtypes the stack was written with."
    )
  paths = [h[0] for h in have]
  full = [tuple(h[1]) for h in have]
  dtypes = [np.dtype(h[2]) for h in have]
  n = int(doc["num_layers"])
  with _LOCK:
    opened = _OPEN.get(key)
    if opened is None:
      groups = _groups(paths, [s[1:] for s in full], dtypes, n)
      store = _store(pathlib.Path(key), groups, options, create=False)
      opened = _OPEN[key] = _Opened(store, paths, n, doc.get("uid", ""))
  # Leaves given as `like` pass their generations' placement on, where committed.
  placed = [a.generation for _, a in flat if is_leaf(a) and getattr(a.generation, "committed", 0)]
  placement = placed[0].sharding if placed else _placement([a for _, a in flat])
  return _leaves(key, treedef, full, dtypes, opened, placement)


def _description(key: str) -> dict[str, Any]:
  path = pathlib.Path(key) / DESCRIPTION
  if not path.exists():
    raise FileNotFoundError(
      f"open_nvme_stack: {key} holds no complete layer stack (no {DESCRIPTION}; a write that did "
      "not finish leaves none). Write it with oo.write_nvme_stack(directory, layers)."
    )
  doc = json.loads(path.read_text())
  if doc.get("format") != FORMAT or int(doc.get("version", 0)) > VERSION:
    raise ValueError(
      f"open_nvme_stack: {path} is format {doc.get('format')!r} version {doc.get('version')}; "
      f"this optax_offload reads {FORMAT!r} up to version {VERSION}: upgrade optax_offload."
    )
  return doc


def close_nvme_stack(stack: Any) -> None:
  """Closes the stores of a stack's `NvmeStackLeaf` leaves (their directories stay on disk).

  The stack cannot be read afterwards; `open_nvme_stack` opens it again. Close it once the
  computations that read it are done (``jax.block_until_ready`` of their results): a read that
  finds the stack closed raises inside the running program.
  """
  for key in {x.directory for x in jax.tree.leaves(stack, is_leaf=is_leaf) if is_leaf(x)}:
    with _LOCK:
      opened = _OPEN.pop(key, None)
    if opened is not None:
      opened.store.close()


def _opened(key: str, uid: str) -> _Opened:
  with _LOCK:
    opened = _OPEN.get(key)
  if opened is None:
    raise RuntimeError(
      f"The layer stack on NVMe at {key} is closed (oo.close_nvme_stack) or was opened in another "
      "process; open it with oo.open_nvme_stack(directory, like)."
    )
  if opened.uid != uid:
    raise RuntimeError(
      f"The layer stack on NVMe at {key} was written again since these leaves were made (another "
      "stack now lives there); open it with oo.open_nvme_stack(directory, like) for its leaves."
    )
  return opened


def copy_nvme_stack(
  stack: Any, directory: str | os.PathLike, *, options: nvme.NvmeOptions | None = None
) -> Any:
  """Copies a stack on NVMe, at the generation its leaves name, into a new directory.

  A layer at a time (never whole in RAM); e.g. a checkpoint of a stack that `value_and_update`
  trains, saved beside the optimizer state's (`OffloadSave`) of the same step: the stack's own
  directory keeps only its last generations. `open_nvme_stack` opens the copy.

  Args:
    stack: a pytree of `NvmeStackLeaf`s of one directory (some or all of its leaves).
    directory: the new stack's directory (`write_nvme_stack`'s).
    options: the copy's `NvmeOptions` (`write_nvme_stack`'s).

  Returns:
    The copy's leaves.

  Raises:
    ValueError: `stack` holds other leaves or several directories.
    FileExistsError: `directory` holds a stack already; nothing there is changed.
  """
  leaves, treedef = jax.tree.flatten(stack, is_leaf=is_leaf)
  if not leaves or not all(map(is_leaf, leaves)) or len({x.directory for x in leaves}) != 1:
    raise ValueError(
      "copy_nvme_stack: give the NvmeStackLeaf leaves of one stack directory (as a training step "
      "or open_nvme_stack returns them), and copy the leaves of other directories on their own."
    )
  if len({int(np.asarray(x.generation)) for x in leaves}) != 1:
    raise ValueError(
      "copy_nvme_stack: the leaves name different generations of their stack; give leaves of one "
      "step (as a training step returns them)."
    )
  opened = _opened(leaves[0].directory, leaves[0].uid)
  gen, n = int(np.asarray(leaves[0].generation)), opened.num_layers
  members = [opened.paths.index(x.path) for x in leaves]

  def layer(i):
    arrays = opened.read(i, gen, n)
    return treedef.unflatten([arrays[j] for j in members])

  copy = write_nvme_stack(directory, layer, num_layers=n, options=options)
  source = leaves[0].generation
  if getattr(source, "committed", False):  # placed as the source's are
    copy = jax.device_put(copy, source.sharding)
  return copy


def host_stand_ins(values: Sequence[Any]) -> list[Any]:
  """`values` with each `NvmeStackLeaf` replaced by a `jax.ShapeDtypeStruct` in pinned host memory
  (replicated on the mesh of the other values' `NamedSharding`s, else on the first device): what
  the optimizer plans for a stack trained on NVMe, as for a stack kept in pinned host memory."""
  if not any(is_leaf(v) for v in values):
    return list(values)
  named = jax.sharding.NamedSharding
  meshes = [s.mesh for v in values if isinstance(s := getattr(v, "sharding", None), named)]
  host = (
    named(meshes[0], jax.sharding.PartitionSpec(), memory_kind="pinned_host")
    if meshes
    else jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  )
  return [
    jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=host) if is_leaf(v) else v for v in values
  ]


def read_rows(
  leaf: NvmeStackLeaf,
  start: int | None = None,
  stop: int | None = None,
  cache: dict[Any, list[np.ndarray]] | None = None,
) -> np.ndarray:
  """Layers ``start:stop`` of one leaf (all by default), read a layer at a time (host memory: the
  rows, and the layers of the directory's leaves being read).

  `cache`: layers read before, kept for reads of the other leaves' rows: the `CACHED_LAYERS` layers
  read last (every leaf of the directory's layer), and the rows of leaves of at most
  `SMALL_ROW_BYTES` a layer (a norm's scale) of every layer read. A caller that reads the leaves'
  row slices in row order, then the small leaves whole, reads each layer once.
  """
  opened = _opened(leaf.directory, leaf.uid)
  gen, j = int(np.asarray(leaf.generation)), opened.paths.index(leaf.path)
  layers = range(opened.num_layers)[slice(start, stop)]
  out = np.empty((len(layers), *leaf.shape[1:]), leaf.dtype)
  small = None if cache is None else cache.setdefault(("small", leaf.directory, gen), {})
  for r, i in enumerate(layers):
    if small is not None and (i, j) in small:
      out[r] = small[(i, j)]
      continue
    key = (leaf.directory, gen, i)
    arrays = None if cache is None else cache.get(key)
    if arrays is None:
      arrays = opened.read(i, gen, layers.stop)
      if cache is not None:
        cache[key] = arrays
        small.update(
          {(i, k): np.array(a) for k, a in enumerate(arrays) if a.nbytes <= SMALL_ROW_BYTES}
        )
        layers_kept = [k for k in cache if k[0] != "small"]
        for old in layers_kept[: max(0, len(layers_kept) - CACHED_LAYERS)]:
          del cache[old]  # the oldest reads
    out[r] = arrays[j]
  return out


CACHED_LAYERS = 2
"""Layers `read_rows` keeps in its cache: `tx.init` reads a stack's rows a layer or two at a time
(the NVMe tier's row slices), every leaf's in turn."""
SMALL_ROW_BYTES = 1 << 20
"""A leaf whose layer is at most this many bytes keeps every layer's row in `read_rows`' cache."""


def read_nvme_stack(stack: Any) -> Any:
  """The stack's arrays, read whole into host memory (numpy), e.g. to check or convert it.

  Each layer is read once (its store group holds every leaf of the layer)."""
  leaves, treedef = jax.tree.flatten(stack, is_leaf=is_leaf)
  on_disk = [k for k, x in enumerate(leaves) if is_leaf(x)]
  rows: dict[int, list[np.ndarray]] = {k: [] for k in on_disk}
  by_store: dict[tuple[str, int], list[int]] = {}
  for k in on_disk:
    x = leaves[k]
    by_store.setdefault((x.directory, int(np.asarray(x.generation))), []).append(k)
  for (key, gen), ks in by_store.items():
    opened = _opened(key, leaves[ks[0]].uid)
    members = [opened.paths.index(leaves[k].path) for k in ks]
    for i in range(opened.num_layers):
      arrays = opened.read(i, gen, opened.num_layers)
      for k, j in zip(ks, members):
        rows[k].append(arrays[j])
  out = [np.stack(rows[k]) if k in rows else x for k, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, out)


PASSES = ("forward", "train_forward", "backward", "update_backward")
"""Where a layer read sits, for its read-ahead: a forward pass with no backward after it
(`forward`: up the layers, then the next forward), a forward pass a backward follows
(`train_forward`), the backward pass (down the layers, then the next step's forward), and the
backward pass of a step that trains the stack (`update_backward`: down the layers only, as the
next forward reads the new generation, which `Writes.commit` reads ahead)."""


def read_ahead(i: int, num_layers: int, where: str, depth: int) -> list[int]:
  """The `depth` layers read after layer `i`, in the order the pass (and the next) reads them.

  Examples:
    >>> read_ahead(6, 8, "train_forward", 3)  # then the backward pass: 7 (read again), 6, ...
    [7, 6, 5]
  """
  if where == "forward":
    order = list(range(i + 1, num_layers)) + list(range(num_layers))
  elif where == "train_forward":
    order = list(range(i + 1, num_layers)) + list(range(num_layers - 1, -1, -1))
  elif where == "update_backward":
    order = list(range(i - 1, -1, -1))
  else:
    order = list(range(i - 1, -1, -1)) + list(range(num_layers))
  # A layer read twice in a row (where a pass turns) is read once: the second read finds it
  # (`_Opened.last`).
  distinct = [j for k, j in enumerate(order) if j != (order[k - 1] if k else i)]
  return distinct[:depth]


def read_layer(
  leaves: Sequence[NvmeStackLeaf], i: jax.Array, where: str, token: jax.Array | None = None
) -> tuple[list[jax.Array], jax.Array]:
  """Layer `i` of each leaf (in device memory), by one callback per stack directory.

  Args:
    leaves: the stack's leaves on NVMe.
    i: the layer (traced).
    where: the pass that reads (`PASSES`), for the read-ahead.
    token: the previous read's token (None: the first read), an int32 scalar each read takes and
      returns, so that the reads run in program order (the prefetch window follows that order).

  Returns:
    The layer of each leaf, and the token.
  """
  if where not in PASSES:
    raise ValueError(f"read_layer: where must be one of {PASSES}, got {where!r}.")
  if token is None:
    token = jnp.zeros((), jnp.int32)
  out: list[Any] = [None] * len(leaves)
  by_dir: dict[str, list[int]] = {}
  for k, x in enumerate(leaves):
    by_dir.setdefault(x.directory, []).append(k)
  for key, ks in by_dir.items():
    members = [leaves[k].path for k in ks]
    shapes = [jax.ShapeDtypeStruct(leaves[k].shape[1:], leaves[k].dtype) for k in ks]

    def fetch(i, generation, token, key=key, members=members, uid=leaves[ks[0]].uid):
      opened = _opened(key, uid)
      i, gen = int(i), int(generation)
      ahead = read_ahead(i, opened.num_layers, where, 4)  # the store reads its prefetch_depth
      arrays = opened.fetch(i, gen, [(j, gen) for j in ahead])
      return [*(np.asarray(arrays[opened.paths.index(m)]) for m in members), np.asarray(token)]

    # A pure callback: a committed generation of a frozen stack reads the same bytes every time,
    # so `jax.checkpoint` may recompute the read (an io_callback's effect refuses it); the token
    # keeps the reads in program order.
    with jax.named_scope(FETCH_SCOPE):
      *got, token = jax.pure_callback(
        fetch, [*shapes, jax.ShapeDtypeStruct((), jnp.int32)], i, leaves[ks[0]].generation, token
      )
    for k, a in zip(ks, got):
      out[k] = a
  return out, token


class Writes:
  """A stack trained by `value_and_update`: its new weights go to the next generation of each
  directory's store, a block of layers at a time, by callbacks chained with a token.

  ``begin`` makes the generation each directory's new weights go to (from the generation the
  leaves read), ``put`` writes a block of layers of it (one store group per layer, every leaf
  of the directory), and ``commit`` publishes it once every layer is put, then reads its first
  layers ahead for the next step's forward pass; its result is the new generation of each
  directory, for the leaves of the trained stack (`trained`). The token is that int32 vector
  (one generation per directory), passed through every callback.

  Raises (at construction where the stack is open, else when ``begin`` runs: a program compiled
  from stand-ins):
    ValueError: the leaves hold some but not all leaves of a stack directory (a layer is written
      whole, every leaf of its store group).
    RuntimeError: the stack was written again since the leaves were made, or is closed (at run
      time).
  """

  def __init__(self, leaves: Sequence[NvmeStackLeaf], where: str):
    self.leaves = list(leaves)
    self.dirs: dict[str, list[int]] = {}
    for k, x in enumerate(self.leaves):
      self.dirs.setdefault(x.directory, []).append(k)
    self.where = where
    self.order: dict[str, list[int]] = {}  # per directory, its leaves in the store's order
    for key, ks in self.dirs.items():
      with _LOCK:
        opened = _OPEN.get(key)
      if opened is not None:  # (stand-ins for a program compiled only: checked when it runs)
        self._check(key, _opened(key, self.leaves[ks[0]].uid))

  def _check(self, key: str, opened: _Opened) -> list[int]:
    """The positions of the directory's leaves in the store's leaf order; a ValueError unless
    they are all of the directory's leaves."""
    ks = self.dirs[key]
    paths = [self.leaves[k].path for k in ks]
    if sorted(paths) != sorted(opened.paths) or len(set(paths)) != len(paths):
      missing = sorted(set(opened.paths) - set(paths))
      raise ValueError(
        f"{self.where}: the layer stack on NVMe at {key} is trained only in part: its leaves "
        f"{', '.join(missing)} are not in the stack given to oo.offloaded_scan with "
        f"{', '.join(paths)}. A layer's leaves of one directory are written together: train "
        "all of the directory's leaves in one stack, or write the frozen ones to a directory "
        "of their own (oo.write_nvme_stack)."
      )
    return [ks[paths.index(p)] for p in opened.paths]

  def _callback(self, fn, *args):
    return io_callback(fn, jax.ShapeDtypeStruct((len(self.dirs),), jnp.int32), *args)

  def begin(self) -> jax.Array:
    """The token: per directory, the generation the new weights go to."""
    keys = list(self.dirs)

    def begin(*generations):
      children = []
      for key, g in zip(keys, generations):
        opened = _opened(key, self.leaves[self.dirs[key][0]].uid)
        self.order[key] = self._check(key, opened)  # (for the step's puts)
        children.append(opened.store.new_generation(int(g)))
      return np.asarray(children, np.int32)

    return self._callback(begin, *(self.leaves[ks[0]].generation for ks in self.dirs.values()))

  def put(self, token: jax.Array, start: jax.Array, rows: Sequence[jax.Array]) -> jax.Array:
    """Writes layers ``start ...`` of each leaf (`rows`: a block per leaf, leading axis the
    layers, in the leaves' order) into the token's generations; returns the token."""

    def put(token, start, *blocks):
      for d, (key, order) in enumerate(self.order.items()):  # as this step's begin found them
        opened = _opened(key, self.leaves[order[0]].uid)
        for r in range(blocks[0].shape[0]):
          opened.store.put(int(start) + r, int(token[d]), [np.asarray(blocks[k][r]) for k in order])
      return np.asarray(token)

    with jax.named_scope(PUT_SCOPE):
      return self._callback(put, token, start, *rows)

  def commit(self, token: jax.Array, after: Any = None) -> jax.Array:
    """Commits the token's generations (after `after`, e.g. the optimizer state's commit); returns
    them."""
    keys = list(self.dirs)

    def commit(token, parents, after):
      del after
      for d, key in enumerate(keys):
        opened = _opened(key, self.leaves[self.dirs[key][0]].uid)
        child = int(token[d])
        opened.store.commit(child, parent=int(parents[d]))
        opened.store.prefetch([(j, child) for j in range(min(opened.num_layers, 4))])
      return np.asarray(token)

    parents = jnp.stack([self.leaves[ks[0]].generation for ks in self.dirs.values()])
    after = jnp.zeros((), jnp.int32) if after is None else after
    return self._callback(commit, token, parents, after)

  def trained(self, token: jax.Array) -> list[NvmeStackLeaf]:
    """The leaves at the generations `token` holds (`commit`'s result)."""
    index = {key: d for d, key in enumerate(self.dirs)}
    return [
      NvmeStackLeaf(token[index[x.directory]], x.directory, x.path, x.shape, x.dtype, x.uid)
      for x in self.leaves
    ]


def refuse_in_params(params: Any, where: str) -> None:
  """A ValueError naming the `NvmeStackLeaf` leaves of `params`, where they cannot be trained."""
  found = [
    jax.tree_util.keystr(p)
    for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]
    if is_leaf(x)
  ]
  if found:
    raise ValueError(
      f"{where}: {', '.join(found[:5])} {'is a' if len(found) == 1 else 'are'} layer stack "
      "leaves on NVMe (oo.write_nvme_stack), which only oo.value_and_update trains (the loss "
      "applies the stack with oo.offloaded_scan, and the backward pass writes each layer's new "
      "weights to the drive); gradients of the whole stack never exist to update them here. "
      "Train with oo.value_and_update, or, for a frozen stack, keep it out of the params the "
      "optimizer sees (pass it to the loss as an argument of its own)."
    )
