"""`value_and_update`: a training step whose layer stacks are updated inside the backward pass.

``jax.value_and_grad`` then ``oo.update_and_apply`` moves a layer stack's weights, gradients and
optimizer state over the host<->device link after the backward pass, when no compute is left to
hide the transfers. `value_and_update` differentiates the loss itself and hands each stack that
reaches `offloaded_scan` to the backward pass (`fused_scan`), which updates layer l as soon as its
gradient exists, with layer l's state arriving while layer l+1's backward computes. The stack's
gradients never exist whole, on the device or in host memory. Leaves outside the stacks
(embeddings, head, norms) are updated after the backward pass, streamed as `update_and_apply`
does.

With ``accumulate=k`` the step takes k micro-batches (a leading axis on the batch arguments) and
accumulates their gradients as ``optax.MultiSteps`` does (a running mean, the same expression):
for a stack, inside each backward pass into a host-memory accumulator; the update runs once, in
the last backward pass.

Global-norm clipping (``optax.chain(optax.clip_by_global_norm(c), oo.offload(...))``) needs the
norm before any update: the last backward pass then writes the stack's (accumulated) gradients to
host memory and sums their squares, and the update runs after it, streamed.

State in the NVMe tier (``offload(..., nvme_dir=..., host_limit=...)``): the step writes one NVMe
generation (in the pass that updates), begun before that pass's forward and committed after the
leaves outside the stacks. In the backward pass the streamed update of each block of layers
fetches each group's rows of the stack's NVMe arrays by one callback a leaf and puts the new rows
by one (`nvme_tier.layers`, `_BlockRows`), the disk reading ahead in the order the backward needs
them; the other leaves' NVMe groups follow, as
`update_and_apply` streams them (`_Begun`). With clipping the stacks are updated after the backward
pass, so their NVMe state streams with the other leaves'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_offload._src import _compat
from optax_offload._src import fused_scan
from optax_offload._src import layout as layout_lib
from optax_offload._src import memory
from optax_offload._src import nvme_stack
from optax_offload._src import offload as offload_lib
from optax_offload._src import offloaded_scan as scan_lib
from optax_offload._src import plan as plan_lib
from optax_offload._src import separable
from optax_offload._src import stream
from optax_offload._src import stream_spec
from optax_offload._src import tree_setup as setup_lib
from optax_offload._src import units
from optax_offload._src.nvme_tier import layers as nvme_tier_layers
from optax_offload._src.state import OffloadState

logger = logging.getLogger(__name__)

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device


@dataclasses.dataclass(frozen=True)
class _Structure:
  """What `value_and_update` recognised in a transformation."""

  offloaded: Any  # offload_lib._Offloaded
  clip: float | None  # clip_by_global_norm's max_norm, or None
  unpack: Callable[[Any], OffloadState]
  pack: Callable[[Any, OffloadState], Any]


def _structure(tx: Any) -> _Structure:
  """The offload transformation in `tx`: alone, or after ``clip_by_global_norm`` in a chain."""
  offloaded = offload_lib._OFFLOADED.get(getattr(tx, "update", None))
  if offloaded is not None:
    return _Structure(offloaded, None, lambda s: s, lambda _, s: s)
  parts = _compat.chain_parts(tx)
  if parts is not None and len(parts) == 2:
    clip = _compat.clip_by_global_norm_max_norm(parts[0])
    offloaded = offload_lib._OFFLOADED.get(getattr(parts[1], "update", None))
    if clip is not None and offloaded is not None:
      return _Structure(offloaded, clip, lambda s: s[1], lambda s, new: (s[0], new))
  raise TypeError(
    "value_and_update needs oo.offload(...) or optax.chain(optax.clip_by_global_norm(c), "
    "oo.offload(...)); for accumulation over micro-batches pass accumulate=k instead of "
    "optax.MultiSteps."
  )


class _Discovery:
  """Records the stacks `offloaded_scan` receives while a loss is traced (no fusion yet)."""

  def __init__(self, leaves):
    self.index = {id(x): i for i, x in enumerate(leaves)}
    self.stacks: list[tuple[tuple[int, ...], int]] = []

  def claim(self, stack):
    ids = [self.index.get(id(x)) for x in jax.tree.leaves(stack)]
    if not ids or any(i is None for i in ids):
      return None
    self.stacks.append((tuple(ids), scan_lib._num_layers(stack)))
    return fused_scan.Consumer("write"), {}


class _Claims:
  """Hands each known stack its consumer and inputs while the loss is differentiated."""

  def __init__(self, leaves, stacks, consumers, ios):
    self.index = {id(x): i for i, x in enumerate(leaves)}
    self.by_leaves = {s: k for k, (s, _) in enumerate(stacks)}
    self.consumers, self.ios = consumers, ios
    self.claimed: set[int] = set()

  def claim(self, stack):
    ids = tuple(self.index.get(id(x)) for x in jax.tree.leaves(stack))
    k = self.by_leaves.get(ids)
    if k is None:
      return None
    if k in self.claimed:
      raise ValueError(
        "value_and_update: the layer stack reaches oo.offloaded_scan twice in one loss; its "
        "update runs in the backward pass of one offloaded_scan, so apply the stack once."
      )
    self.claimed.add(k)
    return self.consumers[k], self.ios[k]


def value_and_update(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  has_aux: bool = False,
  accumulate: int = 1,
  accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
  """A training step: the loss, its gradients and the offloaded update, fused.

  ``value_and_update(loss_fn, tx)(params, state, *batch)`` returns ``(value, params, state)``
  with the same values (bit for bit for the layer bodies the tests use; XLA may fuse others
  differently, within an ulp or two: docs/layers.md, "Numerics") as::

    value, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
    params, state = oo.update_and_apply(tx, grads, state, params)

  but a layer stack that ``loss_fn`` applies with `offloaded_scan` (a leaf of `params`, as it is:
  ``oo.offloaded_scan(body, x, params["layers"])``) is updated inside the backward pass, layer by
  layer, as each layer's gradient is computed. Its gradients never exist whole; its optimizer
  state arrives one layer ahead while the backward computes. The stack may live in pinned host
  memory (weights offloaded too), on the device, or partly each (a card with room keeps some of
  its leaves: they are used in place, and their state still streams with the stack's), or on NVMe
  (`write_nvme_stack`'s leaves: each block's new weights are written to the drive, and the params
  come back at the store's new generation). Use it under `jax.jit` with the params and state
  donated.

  Args:
    loss_fn: ``loss_fn(params, *batch, **kwargs) -> loss`` (or ``(loss, aux)`` with `has_aux`).
    tx: ``oo.offload(...)``, or ``optax.chain(optax.clip_by_global_norm(c), oo.offload(...))``.
    has_aux: as in `jax.value_and_grad`.
    accumulate: micro-batches per step: the batch arguments carry a leading axis of this length,
      and their gradients are averaged as ``optax.MultiSteps(..., every_k_schedule=accumulate)``
      averages them (its running mean), before one update.
    accumulator_dtype: dtype of the accumulated gradients (``optax.MultiSteps``' default, float32;
      ``"bf16"`` or ``jnp.bfloat16`` halves the host memory a stack's accumulators take).
      A fused stack leaf's accumulator lives beside the leaf during the step (in host memory
      for a leaf there, on the device for a leaf kept on the device). The accumulators of the
      other leaves (params outside the stacks, and a stack that is not fused, e.g. one that
      mixes params with frozen leaves) are on the device, as ``optax.MultiSteps``' are, also
      for a leaf in host memory: their device bytes are the leaves' own.

  Returns:
    ``step(params, state, *batch, **kwargs) -> (value, params, state)``; with ``accumulate > 1``
    the value is the mean of the micro-batches' losses (and the last micro-batch's aux).

  Raises:
    TypeError: for a transformation it does not recognise.
    ValueError: when a stack's optimizer state cannot be updated layer by layer.
    NotImplementedError: with ``update_on="host"``; with a stack's state in the NVMe tier and
      params on a mesh of several devices; with a stack on NVMe and a clip or several devices;
      with a stack's state holding integers of 8 bytes or booleans (8-bit moments,
      ``moment_dtype="int8"``, are carried: `_carrier`).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_offload as oo
    >>> params = {"layers": oo.to_pinned_host(jnp.full((4, 64, 64), 0.1)), "out": jnp.ones(64)}
    >>> def loss_fn(p, x):
    ...   x, _ = oo.offloaded_scan(lambda x, w: (jnp.tanh(x @ w), None), x, p["layers"])
    ...   return jnp.mean(x @ p["out"])
    >>> tx = oo.offload(optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> step = jax.jit(oo.value_and_update(loss_fn, tx), donate_argnums=(0, 1))
    >>> loss, params, state = step(params, state, jnp.ones((8, 64)))
    >>> params["layers"].sharding.memory_kind
    'pinned_host'
  """
  units.check_accumulate(accumulate)
  structure = _structure(tx)
  acc_dtype = units.parse_accumulator_dtype(accumulator_dtype)
  host_memory = structure.offloaded.host_memory

  def check_plan():
    if host_memory is not None:  # offload(host_memory=...): what the plan counted
      host_memory.check_step(accumulate, acc_dtype)
      if structure.clip is not None:
        host_memory.check_whole_gradients(
          "clip_by_global_norm before offload in the chain (the stack is then updated after "
          "the backward pass)"
        )

  check_plan()  # where tx.init ran already; else when the step is traced

  def step(params, state, *batch, **kwargs):
    check_plan()
    return _Step(structure, loss_fn, has_aux, accumulate, acc_dtype).run(
      params, state, batch, kwargs
    )

  return step


class _Step:
  """One traced step of `value_and_update`."""

  def __init__(self, structure: _Structure, loss_fn, has_aux, k, acc_dtype):
    self.s, self.loss_fn, self.has_aux, self.k, self.acc_dtype = (
      structure,
      loss_fn,
      has_aux,
      k,
      acc_dtype,
    )

  def micro(self, batch, n):
    if self.k == 1:
      return batch
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, n, keepdims=False), batch)

  def run(self, params, state, batch, kwargs):
    off = self.s.offloaded
    off_state = self.s.unpack(state)
    # A layer stack on NVMe (`nvme_stack.NvmeStackLeaf`) is one leaf of the params here, as the
    # optimizer sees it; the loss is differentiated with its generation (an int32 scalar, its only
    # child) in its place (`diff_leaves`).
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=nvme_stack.is_leaf)
    paths = [layout_lib.leaf_path(p) for p, _ in flat]
    leaves = [v for _, v in flat]
    avals = [jax.ShapeDtypeStruct(jnp.shape(v), _dtype(v)) for v in leaves]
    self.on_disk = {i for i, v in enumerate(leaves) if nvme_stack.is_leaf(v)}
    self.loss_treedef = jax.tree.structure(params)
    self.diff_leaves = [v.generation if i in self.on_disk else v for i, v in enumerate(leaves)]
    setup = off.setup_for_update(paths, avals)
    layout = off.layout_for(treedef)
    shared, per_leaf = off.split_checked(setup, layout, off_state.inner, paths)
    if self.k > 1:
      if any(nvme_stack.is_leaf(b) for b in jax.tree.leaves(batch, is_leaf=nvme_stack.is_leaf)):
        raise ValueError(
          f"value_and_update(accumulate={self.k}): a layer stack on NVMe (oo.write_nvme_stack) is "
          "among the batch arguments, which are split into micro-batches: close over it in the "
          "loss, or pass it as a keyword argument."
        )
      for b in jax.tree.leaves(batch):
        if jnp.ndim(b) < 1 or jnp.shape(b)[0] != self.k:
          raise ValueError(
            f"value_and_update(accumulate={self.k}): every batch argument needs a leading "
            f"micro-batch axis of length {self.k}; got an array of shape {jnp.shape(b)}."
          )
    self.treedef, self.paths, self.setup, self.layout = treedef, paths, setup, layout
    self.shared, self.per_leaf, self.leaves = shared, per_leaf, leaves
    stacks = self.discover(batch, kwargs)
    self.stacks = stacks
    fused = {i for s, _ in stacks for i in s}
    self.fused = fused
    self.writes = self.stack_writes(fused)
    # Without a clip the stacks' state rides through the backward pass (with one, the stacks are
    # updated after it, streamed as update_and_apply streams them).
    for i in sorted(fused) if self.s.clip is None else ():
      for x in jax.tree.leaves(per_leaf[i]):
        if _carrier(x.dtype) is None:
          raise NotImplementedError(
            f"value_and_update: the optimizer state of stack leaf {paths[i]} holds a "
            f"{jnp.dtype(x.dtype).name} array; a layer stack updated in the backward pass returns "
            "its new state as the backward's float 'cotangents', which carry integer state as "
            "floats of the same width (bit for bit) for 1, 2 and 4-byte integers only (not "
            "booleans or 8-byte integers). Use "
            "jax.value_and_grad and oo.update_and_apply for this optimizer."
          )
    # The NVMe tier: one generation per optimizer step, begun in the pass that updates.
    self.traced = setup.callbacks
    self.layers = None
    self.nvme_stacks: set[int] = set()
    if self.traced is not None and self.s.clip is None:
      # (With clipping the stacks are updated after the backward pass, with the other leaves.)
      self.nvme_stacks = {
        s
        for s, (leaves_, _) in enumerate(stacks)
        if any(k[0] in leaves_ for k in setup.nvme.arrays)
      }
      if self.nvme_stacks and self.s.offloaded.update_on == "device":
        self.layers = nvme_tier_layers.TracedLayers(
          self.traced, [leaves_ for leaves_, _ in stacks], paths
        )
    logger.info(
      "value_and_update: %s updated inside the backward pass; %d other leaves after it",
      ", ".join(f"{paths[s[0]]} (+{len(s) - 1} leaves, {n} layers)" for s, n in stacks)
      or "nothing",
      len(leaves) - len(fused),
    )
    rest = [i for i in range(len(leaves)) if i not in fused]

    clip = self.s.clip is not None
    k = self.k
    value_sum = None
    acc_stack = None  # per stack: accumulators (host memory) as a tuple in the stack's leaf order
    acc_rest = None  # leaf -> accumulator of a leaf outside the stacks (device)

    def differentiate(mode_of, ios, lv, b_n):
      consumers = [mode_of(k_) for k_ in range(len(stacks))]

      def f(lv, io_diff):
        ios_full = [dict(io, **d) for io, d in zip(ios, io_diff)]
        with fused_scan.fusing(_Claims(lv, stacks, consumers, ios_full)) as claims:
          out = self.loss_fn(self.loss_treedef.unflatten(lv), *b_n, **kwargs)
        missing = set(range(len(stacks))) - claims.claimed
        if missing:
          raise ValueError(
            "value_and_update: a layer stack did not reach oo.offloaded_scan the second time "
            "the loss was traced; the loss must apply the same stacks on every call."
          )
        return out

      io_diff = [{key: io[key] for key in fused_scan.DIFF_KEYS if key in io} for io in ios]
      # A stack on NVMe enters as its int32 generation: its "gradient" is float0 (its new weights
      # go to the drive in the backward pass, `nvme_stack.Writes`).
      value, (g, cot) = jax.value_and_grad(
        f, argnums=(0, 1), has_aux=self.has_aux, allow_int=bool(self.on_disk)
      )(lv, io_diff)
      return value, g, cot

    n0 = jnp.asarray(0, jnp.int32)
    last = k - 1
    # Micro-batches 0 .. k-2: accumulate.
    if k > 1:
      ios0 = [self.io(s, n0, acc=self.empty_acc(s)) for s in range(len(stacks))]
      value0, g0, cot0 = differentiate(
        lambda s: fused_scan.Consumer("write", mean=True, grad_dtypes=self.grad_dtypes(s)),
        ios0,
        self.diff_leaves,
        self.micro(batch, 0),
      )
      acc_stack = [c["acc"] for c in cot0]
      g0 = _rest_on_device(g0, rest)
      acc_rest = {i: _mean(_opaque_zeros(g0[i], self.acc_dtype), g0[i], n0) for i in rest}
      value_sum = _loss(value0, self.has_aux)

      def body(n, carry):
        acc_stack, acc_rest, value_sum = carry
        ios = [self.io(s, n, acc=acc_stack[s]) for s in range(len(stacks))]
        value, g, cot = differentiate(
          lambda s: fused_scan.Consumer("accumulate", grad_dtypes=self.grad_dtypes(s)),
          ios,
          self.diff_leaves,
          self.micro(batch, n),
        )
        g = _rest_on_device(g, rest)
        acc_rest = {i: _mean(acc_rest[i], g[i], n) for i in rest}
        return [c["acc"] for c in cot], acc_rest, value_sum + _loss(value, self.has_aux)

      if last > 1:
        acc_stack, acc_rest, value_sum = lax.fori_loop(
          1, last, body, (acc_stack, acc_rest, value_sum)
        )

    n_last = jnp.asarray(last, jnp.int32)
    final_batch = self.micro(batch, last)
    token = self.begin(off_state)
    written = {s: w.begin() for s, w in self.writes.items()}  # the stacks' weights on NVMe
    if not clip:
      ios = [
        self.io(
          s,
          n_last,
          acc=None if acc_stack is None else acc_stack[s],
          parts=True,
          token=token,
          written=written.get(s),
        )
        for s in range(len(stacks))
      ]
      value, g, cot = differentiate(
        lambda s: fused_scan.Consumer(
          "update",
          accumulated=k > 1,
          update=self.block_update(s),
          grad_dtypes=self.grad_dtypes(s),
        ),
        ios,
        self.diff_leaves,
        final_batch,
      )
      grads = self.final_rest_grads(g, acc_rest, rest, n_last)
      if self.nvme_stacks:
        # Every stack's last put before the leaves after it (and the commit).
        tokens = [
          _from_carrier(cot[s]["parts"][len(stacks[s][0])], _TOKEN)
          for s in sorted(self.nvme_stacks)
        ]
        token, *_ = lax.optimization_barrier((tokens[0], *tokens[1:]))
      for s in written:
        written[s] = _from_carrier(cot[s]["parts"][-1], written[s])
      new_leaves, new_shared, new_per_leaf, token = self.update_rest(grads, rest, None, token)
      for s, (stack_leaves, _) in enumerate(stacks):
        new_parts = cot[s]["parts"]
        for pos, i in enumerate(stack_leaves):
          new_leaves[i] = g[i]  # the backward's "cotangent" of a fused stack: its new weights
          new_per_leaf[i] = _from_carrier(new_parts[pos], self.per_leaf[i])
    else:
      ios = [
        self.io(
          s,
          n_last,
          acc=None if acc_stack is None else acc_stack[s],
          out=self.empty_grads(s),
          norm=True,
        )
        for s in range(len(stacks))
      ]
      value, g, cot = differentiate(
        lambda s: fused_scan.Consumer(
          "accumulate" if k > 1 else "write",
          norm=True,
          to_grads=True,
          grad_dtypes=self.grad_dtypes(s),
        ),
        ios,
        self.diff_leaves,
        final_batch,
      )
      grads = self.final_rest_grads(g, acc_rest, rest, n_last)
      sums = {}
      for s, (stack_leaves, _) in enumerate(stacks):
        for pos, i in enumerate(stack_leaves):
          grads[i] = cot[s]["out"][pos]
          sums[i] = cot[s]["norm"][pos]
      norm = _global_norm(grads, sums, len(leaves))
      new_leaves, new_shared, new_per_leaf, token = self.update_rest(
        grads, list(range(len(leaves))), _clip_fn(norm, self.s.clip), token
      )
    if k > 1:
      value = _mean_value(value, value_sum, k, self.has_aux)
    new_shared, new_per_leaf = setup_lib.pin_device_state(self.setup, new_shared, new_per_leaf)
    new_leaves = setup_lib.pin_device_params(self.setup, new_leaves)
    new_inner = layout.merge(new_shared, new_per_leaf)
    new_off = off_state._replace(inner=new_inner)
    if self.traced is not None:
      new_off = new_off._replace(nvme_generation=self.traced.commit(token))
    for s, w in self.writes.items():
      # The weights' generation is committed after the state's (a crash between the two leaves
      # the weights a step behind the master copy, which `oo.master_params` reads).
      after = new_off.nvme_generation if self.traced is not None else None
      trained = w.trained(w.commit(written[s], after=after))
      for i, leaf in zip(self.disk_leaves(s), trained):
        new_leaves[i] = leaf
    return value, treedef.unflatten(new_leaves), self.s.pack(state, new_off)

  # -- discovery and validation ---------------------------------------------------------------

  def disk_leaves(self, s) -> list[int]:
    """The leaves of stack s on NVMe, in the stack's order."""
    return [i for i in self.stacks[s][0] if i in self.on_disk]

  def stack_writes(self, fused) -> dict[int, nvme_stack.Writes]:
    """Per stack with leaves on NVMe, the writes of its new weights (`nvme_stack.Writes`).

    Raises:
      ValueError: a leaf on NVMe is not in a stack that reaches `offloaded_scan`, a directory's
        leaves are trained in part, or by two stacks.
      NotImplementedError: with clipping, or params on several devices.
    """
    if not self.on_disk:
      return {}
    outside = sorted(self.on_disk - fused)
    if outside:
      raise ValueError(
        f"value_and_update: {', '.join(self.paths[i] for i in outside)} "
        f"{'is a layer stack leaf' if len(outside) == 1 else 'are layer stack leaves'} on NVMe "
        "that the loss does not apply with oo.offloaded_scan (as part of a stack of params); a "
        "stack on NVMe is trained only there, a layer at a time. Apply the stack with "
        "oo.offloaded_scan(body, x, params[...]), or pass a frozen stack to the loss as an "
        "argument of its own."
      )
    if self.s.clip is not None:
      raise NotImplementedError(
        "value_and_update: clip_by_global_norm with a layer stack trained on NVMe is not built "
        "yet (the clip needs the whole gradient's norm before any update, and the stack is then "
        "updated after the backward pass, which reads and writes weights in host memory only). "
        "Train without the clip in the chain, or keep the stack in pinned host memory."
      )
    sharded = [
      self.paths[i]
      for i, sh in enumerate(self.setup.shardings)
      if sh is not None and len(getattr(sh, "device_set", ())) > 1
    ]
    if sharded:
      raise NotImplementedError(
        "value_and_update: a layer stack trained on NVMe runs on one device for now; the params "
        f"{', '.join(sharded[:3])} are placed on several. Train on one device, or keep the "
        "stack in pinned host memory."
      )
    writes = {
      s: nvme_stack.Writes([self.leaves[i] for i in self.disk_leaves(s)], "value_and_update")
      for s in range(len(self.stacks))
      if self.disk_leaves(s)
    }
    first: dict[str, int] = {}  # per directory, the first stack that writes it
    for s, w in writes.items():
      for directory in w.dirs:
        t = first.setdefault(directory, s)
        if t != s:  # (both would begin a generation of it: one commits, the other fails)
          raise ValueError(
            f"value_and_update: the layer stack on NVMe at {directory} is applied by two "
            f"oo.offloaded_scan calls (params {self.paths[self.disk_leaves(t)[0]]} and "
            f"{self.paths[self.disk_leaves(s)[0]]}), and a step writes a directory's new weights "
            "once. Apply it in one oo.offloaded_scan, or train a copy of it as the other stack "
            "(oo.copy_nvme_stack, then oo.open_nvme_stack)."
          )
    return writes

  def discover(self, batch, kwargs):
    found = []

    def probe(lv):
      d = _Discovery(lv)
      with fused_scan.fusing(d):
        out = self.loss_fn(self.loss_treedef.unflatten(lv), *self.micro(batch, 0), **kwargs)
      found.extend(d.stacks)
      return out

    jax.eval_shape(probe, self.diff_leaves)
    for stack_leaves, n_layers in found:
      self.check_rules(stack_leaves)
      for i in stack_leaves:
        self.check_fusable(i, n_layers)
    return found

  def avals(self) -> list[jax.ShapeDtypeStruct]:
    """The params' shapes and dtypes (as planned)."""
    return [
      jax.ShapeDtypeStruct(jnp.shape(x), dtype) for x, dtype in zip(self.leaves, self.setup.dtypes)
    ]

  def check_rules(self, stack_leaves) -> None:
    """A stack's leaves are updated as a tuple of their own (`update`): the inner transformation
    must update them there as at their own paths."""
    same = separable.rules_on_a_tuple(
      self.s.offloaded.inner, self.treedef, self.avals(), stack_leaves
    )
    fix = (
      "give the rule by the leaves' shapes (e.g. mask=lambda p: jax.tree.map(lambda x: x.ndim "
      "> 1, p)), or use jax.value_and_grad and oo.update_and_apply, which update every leaf at "
      "its own path."
    )
    if same is None:
      raise ValueError(
        "value_and_update: the optimizer cannot update a layer stack's leaves as a tuple of "
        "their own, as value_and_update does (a mask or labels given as a pytree, or by a function "
        "of the params' dicts?); " + fix
      )
    for i, ok in zip(stack_leaves, same):
      if not ok:
        raise ValueError(
          f"value_and_update: the optimizer updates stack leaf {self.paths[i]} by a rule picked "
          "by its path (a mask or labels given by a function of the paths?), and "
          "value_and_update updates a layer stack's leaves as a tuple of their own, where that "
          "rule is not picked; " + fix
        )

  def check_fusable(self, i: int, n_layers: int) -> None:
    setup, path = self.setup, self.paths[i]
    if setup.part_shapes[i] and n_layers == 1:  # (no probe splits an axis of one)
      raise ValueError(
        f"value_and_update: stack leaf {path} has one layer, and a stack is updated a layer at a "
        "time from two layers on. Apply a layer of one without oo.offloaded_scan (its weights as "
        "params: oo.read_nvme_stack reads a stack on NVMe), or use jax.value_and_grad and "
        "oo.update_and_apply."
      )
    if setup.part_shapes[i] and setup.leaves[i].rows != n_layers and not self.splits(i):
      raise ValueError(
        f"value_and_update: the update of stack leaf {path} cannot run layer by layer (its "
        "update mixes the layers, e.g. lamb's or lars' trust ratio over the whole leaf, or the "
        "leaf's layer axis is sharded); use jax.value_and_grad and oo.update_and_apply."
      )
    for shape in setup.part_shapes[i]:
      if not shape or shape[0] != n_layers:
        raise ValueError(
          f"value_and_update: an optimizer state array of stack leaf {path} (shape {shape}) has "
          f"no layer axis of length {n_layers}, so it cannot be updated layer by layer; use "
          "jax.value_and_grad and oo.update_and_apply."
        )

  def splits(self, i: int) -> bool:
    """Whether leaf i's update may run in row slices, probed whatever the size of its state
    (the plan probes only leaves with state of at least `min_size` elements)."""
    off = self.s.offloaded
    avals = self.avals()
    _, per_leaf = self.layout.split(jax.eval_shape(off.inner.init, self.treedef.unflatten(avals)))
    dims = [separable.shared_dims(part, a.shape) for part, a in zip(per_leaf, avals)]
    rows = separable.splittable(off.inner, avals, per_leaf, dims, 1, axis=0, treedef=self.treedef)
    return rows[i] > 0

  def begin(self, off_state):
    """The NVMe token of this step's generation (None without an NVMe tier); the disk starts
    reading what the backward pass needs first."""
    if self.traced is None:
      return None
    token = self.traced.begin(off_state.nvme_generation, store=off_state.nvme_store)
    return self.layers.start(token) if self.layers is not None else token

  # -- inputs of the fused backward ---------------------------------------------------------

  def grad_dtypes(self, s):
    return tuple(_dtype(self.leaves[i]) for i in self.stacks[s][0])

  def empty_acc(self, s):
    return tuple(scan_lib._empty(self.leaves[i], self.acc_dtype) for i in self.stacks[s][0])

  def empty_grads(self, s):
    return tuple(scan_lib._empty(self.leaves[i]) for i in self.stacks[s][0])

  def io(self, s, n, *, acc=None, parts=False, out=None, norm=False, token=None, written=None):
    stack_leaves = self.stacks[s][0]
    io: dict[str, Any] = {"n": n, "shared": self.shared}
    if acc is not None:
      io["acc"] = tuple(acc)
    if out is not None:
      io["out"] = tuple(out)
    if parts:
      io["parts"] = tuple(_to_carrier(self.per_leaf[i]) for i in stack_leaves)
      if s in self.nvme_stacks:
        # The NVMe token rides with the state through the backward loop (as float32 bits: the
        # "cotangent" of an integer input would be float0), so the layer callbacks run in order.
        io["parts"] = (*io["parts"], _to_carrier(token))
      if written is not None:  # the generations a stack's new weights on NVMe go to, last
        io["parts"] = (*io["parts"], _to_carrier(written))
    if norm:
      io["norm"] = jnp.zeros((len(stack_leaves),), jnp.float32)
    return io

  def block_update(self, s):
    """`fused_scan.Consumer.update` for stack s: rows of its leaves updated with the grouped
    update of `update_and_apply` (`stream.run`) on views of those rows, streamed through the
    window and written back in place."""
    stack_leaves = self.stacks[s][0]
    n_layers = self.stacks[s][1]
    off, setup = self.s.offloaded, self.setup
    if off.update_on != "device":
      raise NotImplementedError(
        "value_and_update runs the update on the device (update_on='device'); with "
        "update_on='host' use jax.value_and_grad and oo.update_and_apply."
      )
    layout = layout_lib.StateLayout(off.inner, jax.tree.structure(tuple(stack_leaves)))
    tiers = tuple(setup.array_tiers[i] for i in stack_leaves)
    on_nvme = s in self.nvme_stacks
    dims = tuple(setup.spec.dims[i] for i in stack_leaves)
    specs: dict[int, stream_spec.StreamSpec] = {}

    def spec_for(rows: int) -> stream_spec.StreamSpec:
      if rows not in specs:
        infos = [
          plan_lib.block_info(setup.leaves[i], rows, n_layers, bool(setup.part_shapes[i]))
          for i in stack_leaves
        ]
        plan = plan_lib.make_plan(infos, min_size=0, window_bytes=setup.plan.window_bytes)
        chunks = tuple(
          setup_lib.row_chunks(unit, infos, tiers, len(plan.units)) for unit in plan.units
        )
        specs[rows] = stream_spec.StreamSpec(plan.units, tiers, dims, chunks)
      return specs[rows]

    writes = self.writes.get(s)
    disk = [k for k, i in enumerate(stack_leaves) if i in self.on_disk]

    def update(stack, parts, start, w, g, shared):
      rows = jnp.shape(w[0])[0]
      spec = spec_for(rows)
      block = None
      if writes is not None:
        parts, written = parts[:-1], parts[-1]
      if on_nvme:
        # The streamed update fetches each group's NVMe rows by one callback a piece and puts
        # them back by one, as `update_and_apply` fetches and puts a group's NVMe arrays.
        parts, token = parts[:-1], _from_carrier(parts[-1], _TOKEN)
        block = _BlockRows(spec, self.layers, stack_leaves, start, rows, token)
      parts = tuple(_from_carrier(p, self.per_leaf[i]) for p, i in zip(parts, stack_leaves))

      # Host-tier state arrays stay whole (`row_offset`: their rows are read and written in place
      # by the streamed update); device-tier ones are cut to the rows here and put back after;
      # NVMe-tier ones are placeholders (their rows come from `block`).
      def view(t, j, a):
        return lax.dynamic_slice_in_dim(a, start, rows, 0) if t is plan_lib.Tier.DEVICE else a

      views = [
        setup_lib.map_arrays(part, leaf_tiers, view) for part, leaf_tiers in zip(parts, tiers)
      ]
      new_w, _, new_views, token = stream.run(
        off.inner,
        layout,
        spec,
        list(g),
        shared,
        views,
        list(w),
        {},
        placement="device",
        nvme=block,
        apply=True,
        row_offset=start,
      )

      def back(t, j, v, part):
        old = jax.tree.leaves(part)[j]
        if t is plan_lib.Tier.NVME:
          return old  # the placeholder
        return lax.dynamic_update_slice_in_dim(old, v, start, 0) if t is plan_lib.Tier.DEVICE else v

      parts = tuple(
        setup_lib.map_arrays(new_view, leaf_tiers, functools.partial(back, part=part))
        for part, new_view, leaf_tiers in zip(parts, new_views, tiers)
      )
      stack = tuple(
        buf if k in disk else fused_scan._put(buf, start, x)
        for k, (buf, x) in enumerate(zip(stack, new_w))
      )
      parts = tuple(_to_carrier(p) for p in parts)
      if on_nvme:
        parts = (*parts, _to_carrier(token))
      if writes is not None:  # the block's new weights on NVMe: to the drive, one callback
        tok = writes.put(_from_carrier(written, _WRITTEN), start, [new_w[k] for k in disk])
        parts = (*parts, _to_carrier(tok))
      return stack, parts

    return update

  # -- leaves outside the stacks ---------------------------------------------------------------

  def final_rest_grads(self, g, acc_rest, rest, n_last):
    grads = list(g)
    if acc_rest is not None:
      on_device = _rest_on_device(g, rest)
      for i in rest:
        grads[i] = _mean(acc_rest[i], on_device[i], n_last).astype(jnp.result_type(g[i]))
    return grads

  def update_rest(self, grads, members, grad_transform, token):
    """Updates `members` (leaf indices) with `update_and_apply`'s streamed update.

    Returns (new param leaves, new shared leaves, new per-leaf parts, NVMe token); leaves outside
    `members` keep their params and state.
    """
    spec, setup = self.setup.spec, self.setup
    chosen = set(members)
    units, chunks, plan_groups = [], [], []
    for k, (unit, unit_chunks) in enumerate(zip(spec.units, spec.chunks)):
      keep = [(p, c) for p, c in zip(unit, unit_chunks) if p.leaf in chosen]
      if keep:
        units.append(tuple(p for p, _ in keep))
        chunks.append(tuple(c for _, c in keep))
        plan_groups.append(k)
    leaves = list(self.diff_leaves)  # (a stack on NVMe, never among `members`: its generation)
    if not units:
      return leaves, self.shared_after_empty_update(), list(self.per_leaf), token
    sub = dataclasses.replace(spec, units=tuple(units), chunks=tuple(chunks))
    nvme = None if self.traced is None else _Begun(self.traced, token, plan_groups, self.layers)
    new_params, new_shared, new_per_leaf, token = stream.run(
      self.s.offloaded.inner,
      self.layout,
      sub,
      grads,
      self.shared,
      self.per_leaf,
      leaves,
      {},
      placement=self.s.offloaded.update_on,
      nvme=nvme,
      apply=True,
      grad_transform=grad_transform,
    )
    del setup
    new_params = [p if p is not None else x for p, x in zip(new_params, leaves)]
    return new_params, new_shared, new_per_leaf, token

  def shared_after_empty_update(self):
    """The shared leaves (step count, ...) after an update of no leaf."""
    layout, n_leaves = self.layout, self.layout.num_leaves
    _, new_state = stream._inner_update(self.s.offloaded.inner)(
      layout.masked([None] * n_leaves, []),
      layout.view(self.shared, {}, []),
      layout.masked([None] * n_leaves, []),
      {},
    )
    return layout.unview(new_state, [])[0]


class _Begun:
  """`stream.run`'s NVMe callbacks for some of the plan's groups, on an update begun already.

  `stream.run` begins and commits a generation itself; here the generation is begun before the
  backward pass (whose layer callbacks write the stacks' groups) and committed after `stream.run`,
  which updates the other groups: its ``begin`` returns the token so far and its ``commit`` the
  token after its puts.
  """

  def __init__(self, traced, token, plan_groups, layers):
    self.traced, self.token, self.plan_groups, self.layers = traced, token, plan_groups, layers
    self.groups = {k: traced.groups[g] for k, g in enumerate(plan_groups) if g in traced.groups}

  def _shared(self, k):
    """The store group of sub-group k when the backward pass holds it (it holds a stack's
    arrays too), else None."""
    sg = self.groups[k]
    return sg if self.layers is not None and sg in self.layers.others else None

  def begin(self, generation, store=None):
    del generation, store
    return self.token

  def fetch(self, k, token):
    sg = self._shared(k)
    if sg is not None:
      return self.layers.fetch_members(sg, token)
    return self.traced.fetch(self.plan_groups[k], token)

  def put(self, k, token, parts):
    sg = self._shared(k)
    if sg is not None:
      return self.layers.put_members(sg, token, parts)
    return self.traced.put(self.plan_groups[k], token, parts)

  def commit(self, token):
    return token


class _BlockRows:
  """`stream.run`'s NVMe callbacks for one block of layers of a stack (rows ``[start, start +
  rows)``): each NVMe piece of a group (a stack leaf's rows of the block, or a slice of them)
  arrives by one `TracedLayers.fetch` when the streamed update fetches the group and leaves by one
  `TracedLayers.put` when it sends the group's new state. So the device holds the NVMe rows of the
  groups in flight, within the window, and on a GPU a callback's copy of its operands is one
  piece's rows. Keys are (position in the stack, array)."""

  def __init__(self, spec: stream_spec.StreamSpec, layers, stack_leaves, start, rows: int, token):
    self.spec, self.layers, self.stack_leaves = spec, layers, stack_leaves
    self.start, self.rows, self.token = start, rows, token
    self.groups = {
      k: k
      for k, unit in enumerate(spec.units)
      if any(plan_lib.Tier.NVME in spec.array_tiers[p.leaf] for p in unit)
    }

  def _pieces(self, k):
    """Group k's pieces with NVMe arrays: (piece, [array index], first row, rows)."""
    for p in self.spec.units[k]:
      arrays = [j for j, t in enumerate(self.spec.array_tiers[p.leaf]) if t is plan_lib.Tier.NVME]
      if arrays:
        first = p.start or 0
        yield p, arrays, self.start + first, (self.rows if p.whole else p.stop - p.start)

  def begin(self, generation, store=None):
    del generation, store
    return self.token

  def fetch(self, k, token):
    out = {}
    for p, arrays, first, rows in self._pieces(k):
      keys = [(self.stack_leaves[p.leaf], j) for j in arrays]
      got, token = self.layers.fetch(token, first, rows, keys)
      out.update({(p.leaf, j): got[key] for j, key in zip(arrays, keys)})
    return out, token

  def put(self, k, token, parts):
    for p, arrays, first, _ in self._pieces(k):
      new = jax.tree.leaves(parts[p.leaf])
      token = self.layers.put(
        token, first, {(self.stack_leaves[p.leaf], j): new[j] for j in arrays}
      )
    return token

  def commit(self, token):
    return token


_WRITTEN = jax.ShapeDtypeStruct((), jnp.int32)
"""The dtype of `nvme_stack.Writes`' token (its shape: one generation per stack directory)."""

_TOKEN = jax.ShapeDtypeStruct((), jnp.int32)
"""The dtype of the NVMe tier's token (`nvme_tier.callbacks`; `_from_carrier` reads only dtypes):
the token rides through the backward pass with the state, carried as float32 bits."""

_CARRIERS = {8: jnp.float8_e4m3fn, 16: jnp.bfloat16, 32: jnp.float32}
"""The float dtype that carries an integer state array of each bit width through the backward
pass."""


def _carrier(dtype) -> Any:
  """The dtype in which a state array of `dtype` rides through the backward pass as a
  "cotangent" (its new value): itself for a float, else a float of the same width (None: none).

  The "cotangent" of an integer input would be float0, so integer state (`compress`'s 8-bit codes)
  travels bit-cast to a float: nothing in the backward adds or scales it (one use, no other
  cotangent joins it), so every bit pattern, NaNs and -0 included, comes back unchanged (tested
  with codes taking all 256 values); XLA turns a same-width bit-cast into a free bitcast, on host
  memory too (`tests/test_value_and_update.py::
  test_int8_state_in_host_memory_compiles_to_bitcasts_on_the_gpu`).
  """
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return dtype
  if jnp.issubdtype(dtype, jnp.integer):
    return _CARRIERS.get(jnp.iinfo(dtype).bits)  # int4: none (its itemsize is 1, its bits 4)
  return None


def _to_carrier(tree):
  return jax.tree.map(
    lambda x: x if _carrier(x.dtype) == x.dtype else lax.bitcast_convert_type(x, _carrier(x.dtype)),
    tree,
  )


def _from_carrier(tree, like):
  """`tree` (carried) in the dtypes of `like` again."""
  return jax.tree.map(
    lambda x, a: x if x.dtype == a.dtype else lax.bitcast_convert_type(x, a.dtype), tree, like
  )


def _dtype(x) -> Any:
  """A param's dtype (a stack leaf on NVMe has no array for `jnp.result_type`)."""
  return x.dtype if nvme_stack.is_leaf(x) else jnp.result_type(x)


def _rest_on_device(g, rest):
  """The gradients of the leaves outside the fused stacks, those in host memory moved to the device
  for their accumulators there (a stack that is not fused, e.g. one that mixes params with frozen
  leaves, gives its gradient in pinned host memory, as `offloaded_scan` does)."""
  g = list(g)
  for i in rest:
    if memory.in_host(g[i]):
      g[i] = jax.device_put(g[i], memory.DEVICE)
  return g


def _opaque_zeros(like, dtype):
  return lax.optimization_barrier(jnp.zeros(jnp.shape(like), dtype))


def _mean(acc, g, n):
  """optax.MultiSteps' running mean (`use_grad_mean=True`), the same expression."""
  return acc + (g - acc) / (n + 1)


def _loss(value, has_aux):
  return (value[0] if has_aux else value).astype(jnp.float32)


def _mean_value(value, value_sum, k, has_aux):
  total = (value_sum + _loss(value, has_aux)) / k
  return (total, value[1]) if has_aux else total


def _global_norm(grads, sums, n_leaves):
  """``optax.tree.norm(grads)``: per-leaf sums of squares in the leaf's dtype, added in tree order
  from 0; a stack leaf's sum comes from its per-layer sums (float32)."""
  per_leaf = []
  for i in range(n_leaves):
    g = grads[i]
    if i in sums:
      per_leaf.append(sums[i].astype(jnp.result_type(g)))
    else:
      per_leaf.append(jnp.sum(jnp.square(g)))
  return jnp.sqrt(jnp.array(_reduce_add(per_leaf)))


def _reduce_add(values):
  total = 0
  for v in values:
    total = operator.add(total, v)
  return total


def _clip_fn(norm, max_norm):
  """optax.clip_by_global_norm's per-leaf clip, given the norm."""
  trigger = jnp.squeeze(norm < max_norm)

  def clip(t):
    return lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)

  return clip
