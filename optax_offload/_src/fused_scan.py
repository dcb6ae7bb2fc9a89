"""A layer stack's gradients consumed inside the backward pass: accumulated, or used to update.

`offloaded_scan`'s backward produces one layer's weight gradient at a time, last layer first. Its
plain form writes each to a host-memory gradient stack. Here each gradient is consumed where it is
born instead, so the stack's gradients never exist whole (on the device or in host memory):

* ``"write"``: the gradient, in the accumulator's dtype, is written into an accumulator stack (the
  first micro-batch of an optimizer step);
* ``"accumulate"``: the accumulator's row comes in with the layer's weights and leaves updated,
  ``acc + (g - acc) / (n + 1)`` (``optax.MultiSteps``' running mean, the same expression);
* ``"update"``: the layer's optimizer state comes in with its weights, the optimizer updates them
  (optionally from the accumulated mean, cast to the gradient's dtype as `optax.MultiSteps` does),
  and the new weights and state leave: the update runs during the backward pass, layer l's state
  arriving while layer l+1 computes.

Each mode may also return the sum of squares of the (accumulated) gradient of every leaf, summed
over the layers (for global-norm clipping, which needs the norm before any update).

The mechanism is the custom VJP's cotangent: a caller differentiates with respect to the stack
(and to stand-ins for the accumulator and the state), and the "cotangents" that come back are the
new weights, accumulator and state. `value_and_update` is the caller; this module only runs the
layers.

Transfers: as `offloaded_scan` (two layers per iteration, every fetch one layer ahead), plus each
layer's accumulator rows and state. An iteration's outputs are stacked into one [2, ...] block per
array and written in the next iteration (two host writes into one buffer in one iteration
serialise); the buffers being read and written are carried through the loop, so XLA updates them
in place.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_offload._src import nvme_stack
from optax_offload._src import offloaded_scan as layers_lib

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device

MODES = ("write", "accumulate", "update")

_FUSION: contextvars.ContextVar[Any] = contextvars.ContextVar("optax_offload_fusion", default=None)
"""The fusion in force while a loss is traced by `value_and_update`: it claims the stacks that
`offloaded_scan` receives (`claim`)."""


@contextlib.contextmanager
def fusing(fusion: Any):
  """Makes `fusion` claim the stacks `offloaded_scan` receives while the block runs."""
  token = _FUSION.set(fusion)
  try:
    yield fusion
  finally:
    _FUSION.reset(token)


def claim(stack: Any) -> tuple[Consumer, dict[str, Any]] | None:
  """The consumer and inputs of a stack claimed by the fusion in force, or None."""
  fusion = _FUSION.get()
  return None if fusion is None else fusion.claim(stack)


@dataclasses.dataclass(frozen=True, eq=False)
class Consumer:
  """What the backward pass does with each layer's weight gradient.

  Attributes:
    mode: ``"write"``, ``"accumulate"`` or ``"update"`` (module docstring).
    mean: in ``"write"`` mode, write ``optax.MultiSteps``' running mean of one gradient (the
      first micro-batch of several: ``0 + (g - 0) / 1`` in the accumulator's dtype) rather than
      the gradient itself.
    accumulated: in ``"update"`` mode, first add the gradient to the accumulator's running mean
      (the last micro-batch of several) and update with that mean, cast to the gradient's dtype.
    update: in ``"update"`` mode, ``update(stack, parts, start, w, g, shared) -> (stack, parts)``:
      updates rows ``start : start + len`` of the stack's leaves, whose weights ``w`` and
      gradients ``g`` (tuples in the stack's leaf order, on the device) have that many rows; it
      reads and writes the rows of the (host-memory) weights ``stack`` and state arrays ``parts``
      (per leaf, the tuple of its state arrays) and returns them; ``shared`` is the shared state.
    norm: also return, per leaf, the float32 sum over the layers of the sum of squares of the
      gradient the update sees (cast to the gradient's dtype, squared in it).
    to_grads: write that gradient (cast to the gradient's dtype) into the ``"out"`` buffers instead
      of updating (the last micro-batch when clipping needs the norm first).
    grad_dtypes: per stack leaf, the gradient's dtype.
  """

  mode: str
  mean: bool = False
  accumulated: bool = False
  update: Callable[..., Any] | None = None
  norm: bool = False
  to_grads: bool = False
  grad_dtypes: tuple[Any, ...] = ()


DIFF_KEYS = ("acc", "parts", "norm", "out")
"""Keys of `fused_scan`'s ``io`` whose "cotangents" are their new values."""


def _space(x) -> Any:
  return getattr(jax.typeof(x), "memory_space", None)


def _row(a: jax.Array, i) -> jax.Array:
  """Row ``i`` of a stacked array with its leading axis kept, on the device."""
  r = lax.dynamic_slice_in_dim(a, i, 1, 0)
  return jax.device_put(r, _DEVICE) if _space(a) == _HOST else r


def _rows(a: jax.Array, i, n: int) -> jax.Array:
  r = lax.dynamic_slice_in_dim(a, i, n, 0)
  return jax.device_put(r, _DEVICE) if _space(a) == _HOST else r


def _weights(leaves, i, tok, where="update_backward"):
  """Layer ``i`` of each weight leaf as a ``[1, ...]`` row on the device, and the read token: a
  leaf on NVMe (a stack the step trains) is read by `nvme_stack.read_layer`, chained by `tok`."""
  out = [None if nvme_stack.is_leaf(a) else _row(a, i) for a in leaves]
  tok = layers_lib.read_disk_leaves(leaves, out, i, where, tok, row=True)
  return tuple(out), tok


_put = layers_lib._put


def _opaque_zeros(like: jax.Array, dtype) -> jax.Array:
  # An accumulator that starts at zero, as optax.MultiSteps' does: XLA must not fold `0 + x` into
  # `x` (which would keep -0.0 where MultiSteps' sum gives +0.0).
  return lax.optimization_barrier(jnp.zeros(like.shape, dtype))


def _mean(acc: jax.Array, g: jax.Array, n: jax.Array) -> jax.Array:
  """optax.MultiSteps' running mean (`use_grad_mean=True`), the same expression."""
  return acc + (g - acc) / (n + 1)


def fused_scan(
  body: Callable[..., Any],
  consumer: Consumer,
  consts: list[Any],
  carry: Any,
  stack: Any,
  io: dict[str, Any],
):
  """`offloaded_scan`'s forward with a backward that consumes the stack's gradients.

  Args:
    body: ``body(consts, x, w) -> (x, y)`` (closure-converted).
    consumer: what to do with each layer's gradient.
    consts: arrays `body` closes over (differentiated as usual).
    carry: the initial carry.
    stack: the weights, leading layer axis, in host or device memory.
    io: ``{"acc": stacked accumulators or None, "parts": per stack leaf the tuple of its state
      arrays (stacked) or None, "n": int32 scalar micro-batch index, "norm": float32 [leaves]
      stand-in}``; differentiate with respect to ``acc``, ``parts`` and ``norm`` to get their new
      values.

  Returns:
    ``(carry, ys)`` as `offloaded_scan`.
  """
  layers_lib._num_layers(stack)
  w_aval = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack, is_leaf=nvme_stack.is_leaf
  )
  out_aval = layers_lib.body_avals(body, consts, carry, w_aval)
  layers_lib._check_body_output(out_aval, carry)
  y_aval = jax.tree.map(layers_lib._aval, out_aval[1])
  return _fused(body, y_aval, consumer, consts, carry, stack, io)


def _fused(body, y_aval, consumer, consts, carry, stack, io):
  return _fused_vjp(body, y_aval, consumer, consts, carry, stack, io)


def _fused_primal(body, y_aval, consumer, consts, carry, stack, io):
  del consumer, io
  x, ys, _, _ = layers_lib._forward(body, consts, carry, stack, y_aval, save=False)
  return x, ys


def _fused_fwd(body, y_aval, consumer, consts, carry, stack, io):
  del consumer
  x, ys, xs, tok = layers_lib._forward(body, consts, carry, stack, y_aval, save=True)
  return (x, ys), (consts, xs, stack, io, tok)


def _fused_bwd(body, y_aval, consumer, res, cotangents):
  del y_aval
  consts, xs, stack, io, tok = res
  g, gys = cotangents

  def one(g, w, i, gconsts):
    x = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
    gy = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), gys)
    _, vjp = jax.vjp(body, consts, x, w)  # recompute layer i, then its backward
    gc, gx, gw = vjp((g, gy))
    return layers_lib._seal(gx), jax.tree.map(jnp.add, gconsts, gc), gw

  gconsts0 = jax.tree.map(jnp.zeros_like, consts)
  gconsts, gcarry, out = _consume(one, consumer, stack, io, g, gconsts0, tok)
  new_stack = out.get("stack")
  if new_stack is not None:  # a leaf on NVMe: its new weights went to the drive (no "cotangent")
    leaves, treedef = layers_lib._flat(stack)
    new_stack = treedef.unflatten(
      [None if nvme_stack.is_leaf(a) else x for a, x in zip(leaves, new_stack)]
    )
  io_cot = {key: (out.get(key) if key in DIFF_KEYS else None) for key in io}
  return gconsts, gcarry, new_stack, io_cot


_fused_vjp = jax.custom_vjp(_fused_primal, nondiff_argnums=(0, 1, 2))
_fused_vjp.defvjp(_fused_fwd, _fused_bwd)


def _consume(one, consumer: Consumer, stack, io, g, gconsts, tok):
  if consumer.mode == "update":
    return _consume_update(one, consumer, stack, io, g, gconsts, tok)
  return _consume_rows(one, consumer, stack, io, g, gconsts, tok)


def _consume_rows(one, consumer: Consumer, stack, io, g, gconsts, tok):
  """The backward loop (modes write and accumulate): layers from the last to the first, each gradient consumed.

  Returns (consts' gradients, carry's gradient, outputs): a dict with the new ``"stack"`` and
  ``"parts"`` (update), ``"acc"`` (write, accumulate), ``"out"`` (`to_grads`) and ``"norm"``.
  """
  n = layers_lib._num_layers(stack)
  mode = consumer.mode
  leaves, treedef = layers_lib._flat(stack)
  micro, shared = io.get("n"), io.get("shared")
  grad_dtypes = consumer.grad_dtypes or tuple(x.dtype for x in leaves)

  # The buffers written, carried through the loop so that XLA updates them in place; a fetch of
  # a row not yet written reads them too (the weights of the layers still to come).
  bufs: dict[str, Any] = {}
  if mode == "update":
    bufs["stack"] = tuple(leaves)
    bufs["parts"] = io["parts"]
  elif consumer.to_grads:
    bufs["out"] = io["out"]
  else:
    bufs["acc"] = io["acc"]
  reads_acc = mode == "accumulate" or (mode == "update" and consumer.accumulated)

  def fetch(b, i, tok):
    """Layer i's inputs: weights, and by mode accumulator rows and state rows."""
    w, tok = _weights(b.get("stack", leaves), i, tok, "backward")
    extra = {}
    if reads_acc:
      extra["acc"] = tuple(_row(a, i) for a in b.get("acc", io.get("acc")))
    if mode == "update":
      extra["parts"] = _part_rows(b["parts"], i, n)
    return w, extra, tok

  def consume(w, gw, extra, sums):
    """One layer: its outputs by buffer, and the norm sums."""
    gw = tuple(a[None] for a in treedef.flatten_up_to(gw))
    if mode == "write" and consumer.mean:
      final = tuple(_mean(_opaque_zeros(x, a.dtype), x, micro) for a, x in zip(io["acc"], gw))
    elif reads_acc:
      final = tuple(_mean(a, x, micro) for a, x in zip(extra["acc"], gw))
    else:
      final = gw
    out = {}
    if mode == "write" and not consumer.to_grads:
      out["acc"] = final
    elif mode == "accumulate" and not consumer.to_grads:
      out["acc"] = final
    else:
      final = tuple(x.astype(d) for x, d in zip(final, grad_dtypes))
      if consumer.to_grads:
        out["out"] = final
    if consumer.norm:
      sums = sums + jnp.stack([jnp.sum(jnp.square(x), dtype=jnp.float32) for x in final])
    if mode == "update":
      new_w, new_parts = consumer.update(w, final, extra["parts"], shared)
      out["stack"] = tuple(new_w)
      out["parts"] = tuple(new_parts)
    return out, sums

  def write(b, i, block):
    """Writes a block of outputs (leading axis: rows) at row i of each buffer."""
    b = dict(b)
    for key, value in block.items():
      if key == "parts":
        b["parts"] = _put_part_rows(b["parts"], i, value, n)
      else:
        b[key] = tuple(_put(buf, i, v) for buf, v in zip(b[key], value))
    return b

  sums = jnp.zeros((len(leaves),), jnp.float32)
  top = n - 1
  b = bufs
  if n % 2:  # the odd last layer alone; its outputs go out before the loop
    w_top, extra_top, tok = fetch(b, top, tok)
    wb, _, tok = fetch(b, max(top - 1, 0), tok)
    g, gconsts, gw = one(g, treedef.unflatten([a[0] for a in w_top]), top, gconsts)
    block, sums = consume(w_top, gw, extra_top, sums)
    b = write(b, top, block)
    top -= 1
  else:
    wb, _, tok = fetch(b, top, tok)
  if n < 2:
    return gconsts, g, _finish(b, sums, consumer)

  # The first iteration writes back the current rows top-1 and top of every buffer (a no-op:
  # their outputs are written later), so that the loop needs no branch.
  blk0 = {
    key: (
      _part_rows(v, top - 1, n, rows=2)
      if key == "parts"
      else tuple(_rows(a, top - 1, 2) for a in v)
    )
    for key, v in b.items()
  }

  def pair(c, k):
    g, wb, gconsts, b, blk, sums, tok = c  # wb: layer hi's weights
    hi = top - 2 * k
    wa, tok = _weights(leaves, hi - 1, tok, "backward")  # in flight during layer hi's backward
    # The pair's accumulator rows (hi-1, hi) arrive during layer hi's backward; the previous
    # pair's outputs leave during layer hi-1's. The barrier after layer hi orders this
    # iteration's reads of a buffer before its writes into it (else XLA copies the whole buffer
    # to keep the old one readable: measured, every accumulator once per iteration), and lets
    # neither wait on the other earlier than that.
    rows = {}
    if reads_acc:
      rows["acc"] = tuple(_rows(a, hi - 1, 2) for a in b.get("acc", io.get("acc")))
    g, gconsts, g_hi = one(g, treedef.unflatten([a[0] for a in wb]), hi, gconsts)
    out_hi, sums = consume(
      wb, g_hi, {key: tuple(r[1:] for r in v) for key, v in rows.items()}, sums
    )
    b, rows, g = lax.optimization_barrier((b, rows, g))
    b = write(b, jnp.where(k == 0, top - 1, hi + 1), blk)
    wb_next, tok = _weights(leaves, jnp.maximum(hi - 2, 0), tok, "backward")  # layer hi-1's
    g, gconsts, g_lo = one(g, treedef.unflatten([a[0] for a in wa]), hi - 1, gconsts)
    out_lo, sums = consume(
      wa, g_lo, {key: tuple(r[:1] for r in v) for key, v in rows.items()}, sums
    )
    blk = jax.tree.map(lambda lo, hi_: jnp.concatenate([lo, hi_]), out_lo, out_hi)
    return (g, wb_next, gconsts, b, blk, sums, tok), None

  init = (g, wb, gconsts, b, blk0, sums, tok)
  (g, _, gconsts, b, blk, sums, _), _ = lax.scan(pair, init, jnp.arange(n // 2))
  b = write(b, 0, blk)
  return gconsts, g, _finish(b, sums, consumer)


def _consume_update(one, consumer: Consumer, stack, io, g, gconsts, tok):
  """The backward loop of ``"update"`` mode: each pair of layers is updated in the next iteration.

  Iteration k computes the backward of layers hi and hi-1 and updates the pair of the iteration
  before (whose weights and gradients it carries): that update's state streams through the window
  (`Consumer.update`, the grouped update of `update_and_apply`) while this pair's backward
  computes, as it does not depend on it. The first pair is computed before the loop (nothing to
  update yet), the last pair is updated after it, and an odd top layer is updated on its own.
  """
  n = layers_lib._num_layers(stack)
  leaves, treedef = layers_lib._flat(stack)
  micro, shared = io.get("n"), io.get("shared")
  grad_dtypes = consumer.grad_dtypes or tuple(x.dtype for x in leaves)
  acc = io.get("acc") if consumer.accumulated else None

  def fetch(b, i, tok):
    w, tok = _weights(b[0], i, tok)
    a = None if acc is None else tuple(_row(x, i) for x in acc)
    return (w, a), tok

  def grads_of(gw, a):
    gw = tuple(x[None] for x in treedef.flatten_up_to(gw))
    if a is not None:
      gw = tuple(_mean(x, y, micro) for x, y in zip(a, gw))
    return tuple(x.astype(d) for x, d in zip(gw, grad_dtypes))

  def layer(g, gconsts, w, a, i):
    g, gconsts, gw = one(g, treedef.unflatten([x[0] for x in w]), i, gconsts)
    return g, gconsts, grads_of(gw, a)

  def update(b, start, w, gl, reads=()):
    # The update writes rows of the weights buffer that this iteration's fetches (`reads`) read
    # other rows of: the barrier makes the writes wait for those reads, else XLA copies the whole
    # buffer to keep the old one readable (measured: two host copies of each stacked leaf per
    # iteration).
    stack_bufs, _ = lax.optimization_barrier((b[0], reads))
    new_stack, new_parts = consumer.update(stack_bufs, b[1], start, w, gl, shared)
    return (tuple(new_stack), tuple(new_parts))

  b = (tuple(leaves), io["parts"])
  top = n - 1
  if n % 2:  # the odd top layer alone
    (w_top, a_top), tok = fetch(b, top, tok)
    nxt, tok = fetch(b, max(top - 1, 0), tok)
    g, gconsts, g_top = layer(g, gconsts, w_top, a_top, top)
    b = update(b, top, w_top, g_top, nxt)
    top -= 1
  else:
    nxt, tok = fetch(b, top, tok)
  if n < 2:
    return gconsts, g, {"stack": b[0], "parts": b[1]}

  def backward_pair(g, gconsts, wb, wa, hi):
    """Layers hi and hi-1 (weights `wb`, `wa`); their weights and gradients as [2, ...] blocks
    (rows hi-1, hi)."""
    g, gconsts, g_hi = layer(g, gconsts, wb[0], wb[1], hi)
    g, gconsts, g_lo = layer(g, gconsts, wa[0], wa[1], hi - 1)
    w_blk = tuple(jnp.concatenate([lo, hi_]) for lo, hi_ in zip(wa[0], wb[0]))
    g_blk = tuple(jnp.concatenate([lo, hi_]) for lo, hi_ in zip(g_lo, g_hi))
    return g, gconsts, w_blk, g_blk

  # Weights are fetched from the buffer before the iteration's update writes into it (rows above
  # the ones fetched), so the fetches do not wait for the update's writes.
  wa, tok = fetch(b, top - 1, tok)
  wb_next, tok = fetch(b, jnp.maximum(top - 2, 0), tok)
  g, gconsts, w_blk, g_blk = backward_pair(g, gconsts, nxt, wa, top)

  def pair(c, k):
    g, wb, gconsts, b, w_prev, g_prev, tok = c
    hi = top - 2 * k
    wa, tok = fetch(b, hi - 1, tok)  # in flight during layer hi's backward
    wb_next, tok = fetch(b, jnp.maximum(hi - 2, 0), tok)  # during layer hi-1's backward
    b = update(b, hi + 1, w_prev, g_prev, (wa, wb_next))  # the previous pair: rows hi+1, hi+2
    g, gconsts, w_blk, g_blk = backward_pair(g, gconsts, wb, wa, hi)
    return (g, wb_next, gconsts, b, w_blk, g_blk, tok), None

  wb = wb_next
  init = (g, wb, gconsts, b, w_blk, g_blk, tok)
  (g, _, gconsts, b, w_blk, g_blk, _), _ = lax.scan(pair, init, jnp.arange(1, n // 2))
  b = update(b, 0, w_blk, g_blk)
  return gconsts, g, {"stack": b[0], "parts": b[1]}


def _finish(b, sums, consumer: Consumer) -> dict[str, Any]:
  out = dict(b)
  if consumer.norm:
    out["norm"] = sums
  return out


def _part_rows(parts, i, n: int, rows: int = 1):
  """The layer rows of each state array that has the layer axis; other arrays whole."""
  return jax.tree.map(lambda a: _rows(a, i, rows) if _layered(a, n) else a, parts)


def _put_part_rows(parts, i, value, n: int):
  return jax.tree.map(lambda a, v: _put(a, i, v) if _layered(a, n) else v, parts, value)


def _layered(a, n: int) -> bool:
  return jnp.ndim(a) >= 1 and jnp.shape(a)[0] == n
