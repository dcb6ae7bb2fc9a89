"""Streamed layer stacks: `lax.scan` over layer weights that live in pinned host memory.

A model whose layers are stacked (every layer's weights of one kind in one leaf with a leading
layer axis, as `lax.scan` models, MaxText and Flax's scanned layers keep them) can keep the whole
stack in pinned host memory and stream it through the device one layer at a time, forward and
backward. `offloaded_scan` does that with `jax.checkpoint` semantics (the backward pass recomputes
each layer from its saved input carry), and returns the stack's gradient in pinned host memory.

Forward: two layers per loop iteration, so the two layer-weight buffers alternate and no
loop-carried buffer is written while it is still read; layer l+1's weights are fetched (a dynamic
slice of the host stack moved to device memory) while layer l computes. Backward (a
`jax.custom_vjp`): the same in reverse, with layer l-1 fetched while layer l's backward runs. An
iteration's two weight gradients are stacked into one [2, ...] block per leaf, carried, and written
to the host stack in the next iteration with one host write per leaf: two writes into one host
buffer in the same iteration serialise (measured on the compiled 7B program: 112 of 224 gradient
writes overlapped compute with two writes per leaf and iteration, 112 of 112 with blocks, at
0.4 GiB more device memory). An odd last layer runs alone after the loop (forward) and before
it (backward).

Device memory: the carries of every layer (as `jax.checkpoint` keeps them) plus about 3 layers of
weights and 4 layers of gradients (7B decoder, bf16, batch 1 x 2048, compiled for a 24 GiB H100:
4.66 GiB for forward and backward, against 26.86 GiB for the plain scan).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_offload._src import memory
from optax_offload._src import nvme_stack
from optax_offload._src.memory import DEVICE
from optax_offload._src.memory import HOST

WEIGHT_LAYERS_ON_DEVICE = 3
"""Layers of weights on the device at once (as compiled: the pair computing and the next fetched)."""
GRAD_LAYERS_ON_DEVICE = 4
"""Layers of weight gradients on the device at once (a pair's [2, ...] block and the one written)."""

STREAM_XLA_OPTIONS: dict[str, Any] = {
  "xla_gpu_enable_latency_hiding_scheduler": True,
  "xla_gpu_experimental_parallel_async_compute_limit": 64,
  "xla_gpu_enable_host_memory_offloading": True,
}
"""XLA:GPU options under which `offloaded_scan`'s copies overlap compute.

XLA:GPU (jax 0.10.2) runs its latency-hiding scheduler by default on Hopper only: compiled for an
RTX 4090 (sm_89) without it, none of the host<->device copies of a 1B `offloaded_scan` training
step overlapped compute (165 of 165 exposed; 6 of 165 with it, as on the H100). Host<->device
slices are "async compute" for that scheduler, which keeps one in flight by default (measured: no
weight copy hidden); and without host-memory offloading enabled the rematerialization pass counts
the host stack as device memory and reschedules the backward.
Pass them per executable, e.g. ``jax.jit(step).lower(*args).compile(compiler_options=...)`` or
``oo.compile_for_gpu(step, *args, xla_flags=oo.STREAM_XLA_OPTIONS)``.
"""

_HOST_HOWTO = (
  "put the stack there first: jax.device_put(stack, NamedSharding(mesh, P(), "
  "memory_kind='pinned_host')) or oo.to_pinned_host(stack) (inside jit: "
  "jax.device_put(x, jax.memory.Space.Host)). Abstract inputs need a NamedSharding: a "
  "ShapeDtypeStruct's SingleDeviceSharding loses its memory kind when traced (jax 0.10)"
)


def _flat(stack) -> tuple[list[Any], Any]:
  """The stack's leaves (arrays and `nvme_stack.NvmeStackLeaf`s) and its structure."""
  return jax.tree.flatten(stack, is_leaf=nvme_stack.is_leaf)


def _frozen(stack) -> list[bool]:
  """Per leaf of the stack, whether it gets no gradient: on NVMe, or not of a float dtype (an
  int8 base under adapters), as `jax.grad` differentiates none of those."""
  return [
    nvme_stack.is_leaf(a) or not jnp.issubdtype(a.dtype, jnp.inexact) for a in _flat(stack)[0]
  ]


def _fetch(stack, i, where: str = "forward", token=None):
  """Layer `i` of the stack in device memory, and the read token: an async host->device slice of
  a leaf in host memory, and one read callback per NVMe stack directory (`where`: which pass
  reads, for the read-ahead: `nvme_stack.PASSES`). The token (None where no leaf is on NVMe)
  chains the reads in program order, so that XLA neither hoists nor swaps them and each finds the
  layer the one before read ahead."""
  leaves, treedef = _flat(stack)
  out = [
    a
    if nvme_stack.is_leaf(a)
    else jax.device_put(lax.dynamic_index_in_dim(a, i, keepdims=False), DEVICE)
    for a in leaves
  ]
  token = read_disk_leaves(leaves, out, i, where, token)
  return jax.tree.unflatten(treedef, out), token


def read_disk_leaves(leaves, out, i, where: str, token, row: bool = False):
  """Puts layer `i` of the NVMe leaves among `leaves` at their positions in `out` (with `row`, as
  ``[1, ...]`` rows), read by one callback per stack directory (`nvme_stack.read_layer`; `where`
  and `token` as `_fetch`'s); returns the token."""
  disk = [k for k, a in enumerate(leaves) if nvme_stack.is_leaf(a)]
  if disk:
    got, token = nvme_stack.read_layer([leaves[k] for k in disk], i, where, token)
    for k, a in zip(disk, got):
      out[k] = a[None] if row else a
  return token


def _trainable(stack) -> list[Any]:
  """The stack's leaves that get a gradient (not `_frozen`)."""
  return [a for a, f in zip(_flat(stack)[0], _frozen(stack)) if not f]


def _set(buf, i, tree):
  """buf[i] = tree, on the device."""
  return jax.tree.map(lambda b, t: lax.dynamic_update_index_in_dim(b, t, i, 0), buf, tree)


def _put(buf, i, block):
  """``buf[i:i+len(block)] = block`` in the buffer's own memory (in host memory an async
  device->host write)."""
  block = memory.reshard_as(block, jax.typeof(buf).sharding)
  if memory.in_host(buf):
    block = jax.device_put(block, HOST)
  return lax.dynamic_update_slice_in_dim(buf, block.astype(buf.dtype), i, 0)


def _write(buf, i, tree, rows):
  """buf[i:i+rows] = tree, each leaf in its buffer's memory; `rows` 1 adds the axis."""
  return jax.tree.map(lambda b, t: _put(b, i, t if rows > 1 else t[None]), buf, tree)


def _seal(tree):
  # Keeps XLA from fusing across a layer boundary: without it bf16 gradients differed from the
  # plain scan's by one ulp on XLA:CPU; with it they are bit-identical (fp32 too).
  return lax.optimization_barrier(tree)


def _num_layers(stack: Any) -> int:
  """The common leading (layer) axis of a stack.

  Raises:
    ValueError: when the stack has no leaves or no layers, or its leaves disagree, naming them.
  """
  leaves = jax.tree_util.tree_leaves_with_path(stack, is_leaf=nvme_stack.is_leaf)
  if not leaves:
    raise ValueError("offloaded_scan: the layer stack has no leaves; pass at least one array.")
  sizes = {jax.tree_util.keystr(p): (a.shape[0] if a.ndim else None) for p, a in leaves}
  first = next(iter(sizes.values()))
  odd = {p: n for p, n in sizes.items() if n != first or n is None}
  if odd:
    detail = ", ".join(
      f"{p or 'stack'}: {n if n is not None else 'a scalar'}" for p, n in sizes.items()
    )
    raise ValueError(
      "offloaded_scan: every leaf of the layer stack needs the same leading (layer) axis; got "
      f"{detail}. Stack each kind of weight over the layers (leading axis = number of layers)."
    )
  if first == 0:
    raise ValueError("offloaded_scan: the layer stack has no layers (leading axis 0).")
  return first


def _check_on_host(stack) -> None:
  """A ValueError unless some leaf of the stack is in host memory or on NVMe (leaves on the
  device are used in place: a card with room keeps them)."""
  leaves = jax.tree_util.tree_leaves_with_path(stack, is_leaf=nvme_stack.is_leaf)
  if not any(nvme_stack.is_leaf(a) or memory.in_host(a) for _, a in leaves):
    bad = [jax.tree_util.keystr(p) or "stack" for p, _ in leaves]
    raise ValueError(
      f"offloaded_scan: the layer stack must live in pinned host memory (or on NVMe: "
      f"oo.write_nvme_stack), but {', '.join(bad)} "
      f"{'is' if len(bad) == 1 else 'are'} in device memory; {_HOST_HOWTO}. (Leaves of the stack "
      "may stay on the device when the card has room for them, beside others in host memory.)"
    )


def _explicit(sharding, spec=lambda spec: spec):
  """On Explicit mesh axes, `sharding` (a type's) as a NamedSharding of its mesh, its spec mapped
  by `spec`; None elsewhere (on Auto axes XLA places the buffers the scan makes)."""
  if not memory.on_explicit_axes(sharding):
    return None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec(sharding.spec)))


def _empty(like, dtype=None):
  """An uninitialised buffer shaped like `like` (in `dtype`, default its own) in its memory (a
  stack leaf on NVMe: pinned host memory), as `lax.scan` makes its stacked outputs.

  XLA:GPU allocates a host one in host memory; ``jnp.zeros`` instead builds the zeros on the
  device and copies them (measured: a device temporary the size of the stack).
  """
  if nvme_stack.is_leaf(like):  # a stack leaf on NVMe: its buffers live in pinned host memory
    e = lax.empty(like.shape, like.dtype if dtype is None else dtype)
    return jax.device_put(e, HOST)
  placed = _explicit(jax.typeof(like).sharding)  # as `like` (in device memory: moved below)
  dtype = jnp.result_type(like) if dtype is None else dtype
  e = lax.empty(jnp.shape(like), dtype, out_sharding=placed)
  return jax.device_put(e, HOST) if memory.in_host(like) else e


def _stacked_zeros(n: int, like) -> jax.Array:
  """Zeros for `n` stacked copies of `like` (a layer's carry or output, an array or a
  `jax.ShapeDtypeStruct`). On Explicit mesh axes, sharded as `like` is along its own axes: a
  layer's slice is written into them as it comes, and JAX refuses an update sharded otherwise."""
  sharding = like.sharding if isinstance(like, jax.ShapeDtypeStruct) else jax.typeof(like).sharding
  stacked = _explicit(sharding, lambda spec: (None, *spec))
  return jnp.zeros((n, *jnp.shape(like)), like.dtype, out_sharding=stacked)


def _forward(body, consts, carry, stack, y_aval, *, save):
  """Runs the stack; returns the final carry, the stacked per-layer outputs, with `save` every
  layer's input carry (the residuals of the backward), and the read token (`_fetch`)."""
  n = _num_layers(stack)
  xs = jax.tree.map(lambda a: _stacked_zeros(n, a), carry) if save else None
  ys = jax.tree.map(lambda a: _stacked_zeros(n, a), y_aval)

  def one(x, w, i, xs, ys):
    if save:
      xs = _set(xs, i, x)
    x, y = _seal(body(consts, x, w))
    return x, xs, _set(ys, i, y)

  where = "train_forward" if save else "forward"

  def pair(c, k):
    x, wa, xs, ys, tok = c  # wa: layer 2k's weights, on the device
    wb, tok = _fetch(stack, 2 * k + 1, where, tok)  # in flight during layer 2k
    x, xs, ys = one(x, wa, 2 * k, xs, ys)
    wa, tok = _fetch(stack, jnp.minimum(2 * k + 2, n - 1), where, tok)  # during layer 2k+1
    x, xs, ys = one(x, wb, 2 * k + 1, xs, ys)
    return (x, wa, xs, ys, tok), None

  w0, tok = _fetch(stack, 0, where)
  (x, wa, xs, ys, tok), _ = lax.scan(pair, (carry, w0, xs, ys, tok), jnp.arange(n // 2))
  if n % 2:
    x, xs, ys = one(x, wa, n - 1, xs, ys)
  return x, ys, xs, tok


def _backward(one, stack, g, gconsts, tok):
  """Layers from the last to the first; returns (consts', carry's, and the gradients of the
  stack's trainable leaves, `_trainable`'s order, in their memory). `tok`: the forward's read
  token (`_fetch`)."""
  n = _num_layers(stack)
  fetch = functools.partial(_fetch, stack, where="backward")
  gstack = [_empty(a) for a in _trainable(stack)]
  top = n - 1
  if n % 2:  # the odd last layer alone; its gradient goes out before the loop
    w_top, tok = fetch(top, token=tok)
    w_next, tok = fetch(max(top - 1, 0), token=tok)
    g, gconsts, g_odd = one(g, w_top, top, gconsts)
    gstack = _write(gstack, top, g_odd, rows=1)
    top, wb = top - 1, w_next
  else:
    wb, tok = fetch(top, token=tok)
  if n < 2:
    return gconsts, g, gstack
  # The first iteration writes its (zero) block at rows top-1 and top; both are written again
  # later with their true gradients: one wasted two-layer write per step, no branch in the loop.
  blk0 = [_stacked_zeros(2, _layer_aval(a)) for a in _trainable(stack)]

  def pair(c, k):
    g, wb, gconsts, gstack, blk, tok = c  # wb: layer hi's weights; blk: gradients of hi+1, hi+2
    hi = top - 2 * k
    gstack = _write(gstack, jnp.where(k == 0, top - 1, hi + 1), blk, rows=2)
    wa, tok = fetch(hi - 1, token=tok)  # in flight during layer hi's backward
    g, gconsts, g_hi = one(g, wb, hi, gconsts)
    wb, tok = fetch(jnp.maximum(hi - 2, 0), token=tok)  # in flight during layer hi-1's backward
    g, gconsts, g_lo = one(g, wa, hi - 1, gconsts)
    blk = [
      memory.reshard_as(jnp.stack([a, b]), jax.typeof(z).sharding)
      for a, b, z in zip(g_lo, g_hi, blk0)
    ]
    return (g, wb, gconsts, gstack, blk, tok), None

  init = (g, wb, gconsts, gstack, blk0, tok)
  (g, _, gconsts, gstack, blk, _), _ = lax.scan(pair, init, jnp.arange(n // 2))
  return gconsts, g, _write(gstack, 0, blk, rows=2)


def _layer_aval(a) -> jax.ShapeDtypeStruct:
  """One layer of stack leaf `a` (its leading axis dropped), in device memory; on Explicit mesh
  axes sharded as `a` is along its other axes (a layer's gradient comes so)."""
  row = _explicit(jax.typeof(a).sharding, lambda spec: tuple(spec)[1:])
  return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=row)


def body_avals(layer, *args):
  """``layer(*args)``'s output as abstract values, with their shardings on mixed Explicit and
  Auto mesh axes too (`jax.eval_shape` drops them there; the traced program keeps them)."""
  closed, shapes = jax.make_jaxpr(layer, return_shape=True)(*args)
  return jax.tree.unflatten(jax.tree.structure(shapes), closed.out_avals)


def _aval(a) -> jax.ShapeDtypeStruct:
  """`a`'s shape and dtype, and its sharding on Explicit mesh axes (`_stacked_zeros`); hashable,
  for a static argument."""
  return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_explicit(getattr(a, "sharding", None)))


def _check_body_output(out_aval, carry) -> None:
  """A TypeError unless `out_aval` is (carry of the same structure, shapes and dtypes, y)."""
  ok = isinstance(out_aval, tuple) and len(out_aval) == 2
  if ok:
    got = jax.tree.map(lambda a: (a.shape, a.dtype), out_aval[0])
    ok = got == jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), carry)
  if not ok:
    raise TypeError(
      "offloaded_scan: body(carry, w) must return (carry, y), the new carry with the structure, "
      f"shapes and dtypes of the old one ({jax.tree.map(jax.typeof, carry)}); got {out_aval}."
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _streamed(body, y_aval, consts, carry, stack):
  x, ys, _, _ = _forward(body, consts, carry, stack, y_aval, save=False)
  return x, ys


def _streamed_fwd(body, y_aval, consts, carry, stack):
  x, ys, xs, tok = _forward(body, consts, carry, stack, y_aval, save=True)
  return (x, ys), (consts, xs, stack, tok)


def _streamed_bwd(body, y_aval, res, cotangents):
  del y_aval
  consts, xs, stack, tok = res
  g, gys = cotangents
  frozen_leaves = _frozen(stack)
  treedef = _flat(stack)[1]

  def one(g, w, i, gconsts):
    x = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
    gy = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), gys)
    leaves = jax.tree.leaves(w)
    frozen = [a for a, f in zip(leaves, frozen_leaves) if f]

    def layer(consts, x, trained):  # frozen weights are constants: no gradient computed
      it, fr = iter(trained), iter(frozen)
      return body(
        consts, x, jax.tree.unflatten(treedef, [next(fr if f else it) for f in frozen_leaves])
      )

    trained = [a for a, f in zip(leaves, frozen_leaves) if not f]
    _, vjp = jax.vjp(layer, consts, x, trained)  # recompute layer i, then its backward
    gc, gx, gw = vjp((g, gy))
    return _seal(gx), jax.tree.map(jnp.add, gconsts, gc), gw

  gconsts0 = jax.tree.map(jnp.zeros_like, consts)
  gconsts, gcarry, gtrained = _backward(one, stack, g, gconsts0, tok)
  it = iter(gtrained)
  gstack = jax.tree.unflatten(treedef, [None if f else next(it) for f in frozen_leaves])
  return gconsts, gcarry, gstack


_streamed.defvjp(_streamed_fwd, _streamed_bwd)


def offloaded_scan(
  body: Callable[[Any, Any], tuple[Any, Any]], carry: Any, stack: Any
) -> tuple[Any, Any]:
  """``jax.lax.scan(jax.checkpoint(body), carry, stack)`` over a stack kept in pinned host memory.

  Each layer's weights are copied to the device while the layer before computes, forward and
  backward (the backward recomputes each layer from its input carry, as `jax.checkpoint` does).
  The stack never gathers on the device, and its gradient comes back in pinned host memory. Leaves
  of the stack that are on the device (a card with room for some of them) are used in place, and
  their gradients stay there. Use it
  under `jax.jit`, compiled with `STREAM_XLA_OPTIONS` on a GPU (the copies are serialised
  otherwise). Arrays `body` closes over are differentiated too (`jax.closure_convert`).

  Args:
    body: ``body(carry, w) -> (carry, y)`` for one layer, as for `jax.lax.scan`; `w` has the
      stack's structure without the leading axis, in device memory.
    carry: the initial carry, e.g. the hidden states (device memory).
    stack: a pytree of arrays with a common leading layer axis, in pinned host memory (some
      leaves may be on the device), and frozen leaves on NVMe (`oo.write_nvme_stack`'s
      `NvmeStackLeaf`s: read a layer at a time from the drive, no gradient computed).

  Returns:
    ``(carry, ys)`` as `jax.lax.scan` returns them; `ys` (the stacked `y`) in device memory.

  Raises:
    ValueError: when the stack is empty, its leaves disagree on the leading axis or none is in
      host memory or on NVMe; the message names the leaves.
    TypeError: when `body` does not return ``(carry, y)`` with the carry's shapes and dtypes.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_offload as oo
    >>> stack = oo.to_pinned_host({"w": jnp.full((3, 4, 4), 0.5)})
    >>> def body(x, p):
    ...   return jnp.tanh(x @ p["w"]), None
    >>> loss = lambda stack, x: jnp.sum(oo.offloaded_scan(body, x, stack)[0])
    >>> g = jax.jit(jax.grad(loss))(stack, jnp.ones((2, 4)))
    >>> g["w"].shape, g["w"].sharding.memory_kind
    ((3, 4, 4), 'pinned_host')
  """
  _num_layers(stack)
  from optax_offload._src import fused_scan  # the update-in-backward hook; it imports this module

  claimed = fused_scan.claim(stack)
  if claimed is None:
    _check_on_host(stack)
  w_aval = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack, is_leaf=nvme_stack.is_leaf
  )
  converted, consts = jax.closure_convert(body, carry, w_aval)

  def layer(consts, x, w):
    return converted(x, w, *consts)

  if claimed is not None:
    consumer, io = claimed
    return fused_scan.fused_scan(layer, consumer, list(consts), carry, stack, io)

  out_aval = body_avals(layer, consts, carry, w_aval)
  _check_body_output(out_aval, carry)
  y_aval = jax.tree.map(_aval, out_aval[1])
  return _streamed(layer, y_aval, list(consts), carry, stack)


def offloaded_layers(layers: Any, carry: Any, *args: Any, **kwargs: Any) -> Any:
  """Applies a stacked Flax NNX module layer by layer, its params streamed from pinned host memory.

  `layers` is one module whose params have a leading layer axis (as `nnx.vmap` builds a stack of
  layers), placed in pinned host memory (`to_pinned_host` of its state, or of the module). Each
  layer computes ``carry = layer(carry, *args, **kwargs)``, through `offloaded_scan`. The layers'
  other state (dropout RNGs, batch statistics) is not threaded through: pure layers only.

  Args:
    layers: the stacked module.
    carry: the input of the first layer, e.g. the hidden states.
    *args: further inputs of every layer (e.g. an attention mask), closed over.
    **kwargs: keyword inputs of every layer.

  Returns:
    The last layer's output.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_offload as oo
    >>> from flax import nnx
    >>> @nnx.vmap(in_axes=0, out_axes=0)
    ... def make(key):
    ...   return nnx.Linear(4, 4, rngs=nnx.Rngs(key))
    >>> stack = make(jax.random.split(jax.random.key(0), 3))   # 3 layers
    >>> nnx.update(stack, oo.to_pinned_host(nnx.state(stack)))
    >>> grads = nnx.grad(lambda m: oo.offloaded_layers(m, jnp.ones((2, 4))).sum())(stack)
    >>> grads["kernel"][...].shape, grads["kernel"][...].sharding.memory_kind
    ((3, 4, 4), 'pinned_host')
  """
  from flax import nnx  # Flax is needed only here

  graphdef, stack = nnx.split(layers)

  def body(x, w):
    return nnx.merge(graphdef, w)(x, *args, **kwargs), None

  return offloaded_scan(body, carry, stack)[0]
