"""Moments in a narrower dtype: `with_moment_dtype`, kept by `offload(moment_dtype=...)`.

The moments of an Adam-style optimizer are most of the bytes `offload` moves: 8 of the 12 bytes
per parameter of fp32 master AdamW. `with_moment_dtype` stores them in bf16 (2 bytes each), or
8-bit block-quantized (``"int8"``: 1 byte each plus an fp32 scale per block of 256, as
bitsandbytes' and torchao's 8-bit AdamW keep them), and widens them again for the inner update, so
the update computes as it would in fp32 and only the stored state is rounded. `offload` applies it
before planning (`tree_plan.offloaded_inner`), so the plan, `estimate` and the NVMe tier see the
narrower state and the link and disk move half (bf16) or about a quarter (int8) of the bytes.

8-bit moments (`QuantizedMoment`): bitsandbytes' blockwise dynamic quantization. An fp32 moment
of shape ``(..., n)`` becomes ``codes`` (8 bits, the same shape: an index into a 256-value map) and
``scales`` (fp32, shape ``(..., ceil(n / 256))``: the absolute maximum of each block of 256
elements along the last axis). A value is divided by its block's scale and replaced by the index
of the nearest map value (ties to the lower index); it reads back as ``map[code] * scale``. The
maps are bitsandbytes' `create_dynamic_map` (7 decades from 1e-7 to 1, linearly spaced within
each; computed here in float64 and rounded to fp32 once): the unsigned one for moments that are
never negative (slots named in `UNSIGNED_SLOTS`: Adam's ``nu``, ...; not sm3's), the signed one
for the others. Blocks run along the last axis (bitsandbytes' along the flattened array) so that a row
slice of a moment (the plan's row slices, a stacked layer) holds whole blocks and its scales.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import layout as layout_lib
from optax_offload._src import memory
from optax_offload._src import units
from optax_offload._src import update_dtypes

INT8 = np.dtype("int8")
"""`parse_moment_dtype`'s value for 8-bit block-quantized moments (`QuantizedMoment`)."""

BLOCK = 256
"""Elements per quantization block along a moment's last axis (bitsandbytes' 8-bit optimizers)."""

UNSIGNED_SLOTS = frozenset({"nu", "nu_max", "sum_of_squares"})
"""Names of the state fields whose moments are never negative, quantized with the unsigned map
(Adam's, RMSProp's, AdaBelief's ``nu``, AMSGrad's ``nu_max``, Adagrad's ``sum_of_squares``; as
bitsandbytes quantizes its second state); every other moment takes the signed map."""
_SIGNED_NU = (optax.ScaleBySM3State,)
"""States whose ``nu`` is signed (sm3's is its momentum)."""


def parse_moment_dtype(value: Any, name: str = "moment_dtype") -> np.dtype | None:
  """The moment dtype `with_moment_dtype` can keep: a float of 16 bits or more, or ``"int8"``
  (8-bit block-quantized, `QuantizedMoment`); None for None.

  Raises:
    ValueError: for another integer dtype (``"int4"``, ``"uint8"``, ...), an 8-bit float (no
      per-block scale, most moments would flush to zero) or a non-dtype.

  Examples:
    >>> parse_moment_dtype("bf16"), parse_moment_dtype("int8"), parse_moment_dtype(None)
    (dtype(bfloat16), dtype('int8'), None)
  """
  if value is None:
    return None
  try:
    dtype = units.parse_dtype(value, name)
  except ValueError:
    raise ValueError(
      f"{name} must be 'bf16', 'fp16' or 'int8' (8-bit block-quantized), got {value!r}."
    ) from None
  if dtype == INT8:
    return INT8
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"{name}={dtype.name}: the moments are kept in a float of 16 bits or more ('bf16', 'fp16') "
      f"or 8-bit block-quantized ('int8', a byte per element and an fp32 scale per {BLOCK}); "
      f"other integer widths are not implemented. Use {name}='int8' or {name}='bf16'."
    )
  if jnp.finfo(dtype).bits < 16:
    raise ValueError(
      f"{name}={dtype.name}: an 8-bit float without per-block scales cannot hold the moments "
      f"(Adam's second moment spans more binades than its exponent). Use {name}='int8' "
      f"(per-block scales) or {name}='bf16'."
    )
  return dtype


def is_moment(x: Any, param: Any, moment_dtype: Any) -> bool:
  """Whether state array `x` of a parameter-shaped subtree is stored in `moment_dtype`: a float
  shaped like its param and wider than `moment_dtype`.

  Examples:
    >>> is_moment(jnp.zeros(3), jnp.zeros(3), jnp.bfloat16)  # fp32 moment of an fp32 param
    True
    >>> is_moment(jnp.zeros(2), jnp.zeros(3), jnp.bfloat16)  # another shape (e.g. adafactor's)
    False
  """
  return jnp.shape(x) == jnp.shape(param) and narrows(jnp.result_type(x), moment_dtype)


def narrows(dtype: Any, moment_dtype: Any) -> bool:
  """Whether a moment of `dtype` is stored in `moment_dtype`: a float wider than it; for
  ``"int8"``, fp32.

  Examples:
    >>> narrows(jnp.float32, jnp.bfloat16), narrows(jnp.bfloat16, jnp.float16)
    (True, False)
    >>> narrows(jnp.float32, "int8"), narrows(jnp.bfloat16, "int8")
    (True, False)
  """
  if jnp.dtype(moment_dtype) == INT8:  # fp32 moments only: 8-bit codes read back as fp32
    return jnp.dtype(dtype) == jnp.float32
  return jnp.issubdtype(dtype, jnp.floating) and (
    jnp.finfo(dtype).bits > jnp.finfo(moment_dtype).bits
  )


def dynamic_map(signed: bool) -> np.ndarray:
  """The 256 values an 8-bit code stands for, sorted (bitsandbytes' `create_dynamic_map` with
  its defaults): 0, 1 and, in each decade from 1e-7 to 1, the midpoints of a linear grid on
  [0.1, 1] x the decade, 2**i of them in the i-th decade (and their negatives) for the signed map,
  2**(i+1) for the unsigned one. Computed in float64, rounded to fp32.

  Examples:
    >>> m = dynamic_map(signed=True)
    >>> m.dtype, len(m), [float(f"{v:.6g}") for v in m[[0, 127, 128, 254, 255]]]
    (dtype('float32'), 256, [-0.992969, 0.0, 5.5e-07, 0.992969, 1.0])
    >>> u = dynamic_map(signed=False)  # twice the values per decade, no negatives
    >>> [float(f"{v:.6g}") for v in u[[0, 1, 2, 254, 255]]]
    [0.0, 3.25e-07, 7.75e-07, 0.996484, 1.0]
  """
  data = [0.0, 1.0]
  for i in range(7):
    items = 2**i if signed else 2 ** (i + 1)
    bounds = np.linspace(0.1, 1.0, items + 1)
    means = 10.0 ** (i - 6) * (bounds[:-1] + bounds[1:]) / 2.0
    data += list(means) + (list(-means) if signed else [])
  return np.sort(np.asarray(data, np.float64)).astype(np.float32)


def _thresholds(signed: bool) -> np.ndarray:
  """fp32 thresholds t with: an fp32 value v is nearer map[i + 1] than map[i] iff v > t[i] (the
  exact midpoint, rounded down to fp32: a tie goes to the lower code)."""
  m = dynamic_map(signed).astype(np.float64)
  mid = (m[:-1] + m[1:]) / 2.0
  t = mid.astype(np.float32)
  return np.where(t > mid, np.nextafter(t, np.float32(-np.inf)), t).astype(np.float32)


class QuantizedMoment(NamedTuple):
  """An fp32 moment of shape ``(..., n)`` kept in 8 bits: ``codes`` of the moment's shape and
  ``scales`` (fp32, ``(..., ceil(n / 256))``), reading back as ``map[code] * scale`` per block
  (`dequantize`). The codes' dtype names the map: int8 the signed one (``map[code + 128]``),
  uint8 the unsigned one (``map[code]``)."""

  codes: jax.Array
  scales: jax.Array


def is_quantized(x: Any) -> bool:
  """A `QuantizedMoment`, or the mapping Flax NNX turns it into inside a variable."""
  if isinstance(x, QuantizedMoment):
    return True
  return isinstance(x, Mapping) and not isinstance(x, dict) and set(x.keys()) == {"codes", "scales"}


def _parts(q: Any) -> tuple[Any, Any]:
  """The codes and scales of a `QuantizedMoment` or of NNX's mapping of one."""
  return (q.codes, q.scales) if isinstance(q, QuantizedMoment) else (q["codes"], q["scales"])


def _blocks(x: jax.Array) -> jax.Array:
  """`x` (..., n) as (..., ceil(n / 256), 256), padded with zeros."""
  n = x.shape[-1]
  nb = -(-n // BLOCK)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * BLOCK - n)])
  return x.reshape(*x.shape[:-1], nb, BLOCK)


def _on_auto_axes(fun, arrays: tuple[jax.Array, ...], out_sharding) -> Any:
  """``fun(*arrays)``, with Explicit mesh axes made Auto inside it (`jax.sharding.auto_axes`) and
  its result placed by ``out_sharding(sharding of the first array)``: under Explicit axes jax
  refuses a sharded moment's reshapes into blocks and its table lookups without a sharding for
  each result, which the compiler propagates well."""
  sharding = jax.typeof(arrays[0]).sharding
  if not memory.on_explicit_axes(sharding):
    return fun(*arrays)
  return jax.sharding.auto_axes(fun, out_sharding=out_sharding(sharding))(*arrays)


# Jitted, as `dequantize`: a step or a probe that quantizes many moments of one shape traces it once
# (inlined into the caller's program: the same HLO); eagerly, one program, not one per op (an
# eager int8 init ran about 150 small compiles, 7 s of a 4-layer decoder's init, op by op).
@functools.partial(jax.jit, static_argnames="signed")
def quantize(x: jax.Array, signed: bool) -> QuantizedMoment:
  """`x` (fp32, at least 1-D) as 8-bit codes (int8 with the signed map, uint8 with the unsigned
  one) and an fp32 absmax scale per block of 256 along its last axis: each value divided by its
  block's scale (an all-zero block: by 1), then the nearest map value's index (ties to the lower
  one). NaN and inf propagate to the scale.

  Examples:
    >>> q = quantize(jnp.asarray([[0.5, -1.0, 0.0, 2e-3]]), signed=True)
    >>> q.codes.dtype, q.codes.shape, q.scales.shape, float(q.scales[0, 0])
    (dtype('int8'), (1, 4), (1, 1), 1.0)
    >>> [float(f"{v:.6g}") for v in dequantize(q)[0]]  # the nearest map values
    [0.500781, -0.992969, 0.0, 0.00184375]
  """
  return _on_auto_axes(
    functools.partial(_quantize, signed=signed),
    (x,),
    # (the scales replicated, as offload's init places an array not shaped like its param: a row
    # slice's new scales, sharded like its rows, could not be written into the whole moment's)
    lambda s: QuantizedMoment(s, memory.replicated(s)),
  )


def _quantize(x: jax.Array, signed: bool) -> QuantizedMoment:
  n = x.shape[-1]
  blocks = _blocks(x.astype(jnp.float32))
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  normed = blocks / jnp.where(scales > 0, scales, 1.0)[..., None]
  # A branchless binary search over the 255 thresholds: 8 steps of a compare and a select. The
  # first compares with one threshold (every code starts at 0): as a gather from constant codes
  # XLA folded it at compile time, element by element (4-16 s per moment of a 13B model).
  host_thresholds = np.append(_thresholds(signed), np.float32(np.inf))
  thresholds = jnp.asarray(host_thresholds)
  codes = jnp.where(jnp.float32(host_thresholds[127]) < normed, 128, 0).astype(jnp.int32)
  for step in (64, 32, 16, 8, 4, 2, 1):
    codes = jnp.where(thresholds[codes + step - 1] < normed, codes + step, codes)
  codes = codes.reshape(*x.shape[:-1], -1)[..., :n]
  if signed:
    return QuantizedMoment((codes - 128).astype(jnp.int8), scales)
  return QuantizedMoment(codes.astype(jnp.uint8), scales)


@jax.jit
def dequantize(q: QuantizedMoment) -> jax.Array:
  """The fp32 moment `q` stands for: ``map[code] * scale``.

  Raises:
    ValueError: `q`'s codes and scales do not hold the same blocks (e.g. a column slice of a
      2-D moment's codes with its scales whole).
  """
  codes, scales = _parts(q)
  n = codes.shape[-1]
  if scales.shape != (*codes.shape[:-1], -(-n // BLOCK)):
    raise ValueError(
      f"QuantizedMoment: codes of shape {codes.shape} need scales of shape "
      f"{(*codes.shape[:-1], -(-n // BLOCK))} (one per {BLOCK} along the last axis), got "
      f"{scales.shape}."
    )
  signed = jnp.dtype(codes.dtype) == jnp.int8

  def read(codes, scales):
    index = codes.astype(jnp.int32) + (128 if signed else 0)
    values = jnp.asarray(dynamic_map(signed))[_blocks(index)]
    return (values * scales[..., None]).reshape(*codes.shape[:-1], -1)[..., :n]

  return _on_auto_axes(read, (codes, scales), lambda s: s)


def quantized_nbytes(shape: tuple[int, ...]) -> int:
  """Bytes of a moment of `shape` kept in 8 bits: a byte per element, 4 per block of 256 along
  the last axis (a bare count: one axis).

  Examples:
    >>> quantized_nbytes((4096, 4096)), quantized_nbytes((1000,))
    (17039360, 1016)
  """
  *lead, n = shape
  return math.prod(shape) + 4 * math.prod(lead) * -(-n // BLOCK)


def dequantized(tree: Any) -> Any:
  """`tree` with every `QuantizedMoment` read back (`dequantize`) where its codes are, outside
  `jax.jit` (`to_inner`)."""

  def read(q):
    if not is_quantized(q):
      return q
    codes, scales = _parts(q)
    sharding = _sharding(codes)
    if sharding is None:
      return dequantize(QuantizedMoment(codes, scales))
    # Scales without a sharding of their own (a numpy array) go where the codes are, whole.
    scales_on = _sharding(scales) or _replicated(sharding)
    codes = jax.device_put(codes, sharding.with_memory_kind("device"))
    scales = jax.device_put(scales, scales_on.with_memory_kind("device"))
    return jax.device_put(dequantize(QuantizedMoment(codes, scales)), sharding)

  return jax.tree.map(read, tree, is_leaf=is_quantized)


def _sharding(x: Any) -> Any:
  """`x`'s sharding when it has one with a memory kind (a `jax.Array`), else None."""
  sharding = getattr(x, "sharding", None)
  return sharding if hasattr(sharding, "with_memory_kind") else None


def _replicated(sharding: Any) -> Any:
  """A sharding on `sharding`'s devices that holds an array of any shape whole."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return memory.replicated(sharding, sharding.memory_kind)
  return sharding


def _slot_name(path: Any) -> str:
  key = path[-1] if path else None
  for attr in ("name", "key", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return ""


def _parent(tree: Any, path: Any) -> Any:
  """The node of `tree` holding the subtree at `path` (None where a key does not index it)."""
  try:
    for key in path[:-1]:
      if hasattr(key, "name"):
        tree = getattr(tree, key.name)
      else:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
  except (AttributeError, KeyError, IndexError, TypeError):  # (a node its keys do not index)
    return None
  return tree


def _is_wrapper(x: Any) -> bool:
  """A pytree node around one array that is no container (e.g. Flax NNX's ``nnx.Param``, which
  ``nnx.Optimizer`` passes to ``init``)."""
  if x is None or isinstance(x, dict | list | tuple | Mapping) or hasattr(x, "shape"):
    return False
  leaves, treedef = jax.tree.flatten(x)
  return len(leaves) == 1 and treedef.num_nodes > 1


def quantizes(shape: tuple[int, ...]) -> bool:
  """Whether an fp32 moment of `shape` is kept in 8 bits: 2 or more dimensions and a last axis of
  2 or more. A last axis of 1 would cost 5 bytes per element (a code and a one-element block's
  scale), more than fp32's 4; a last axis of n >= 2 costs 1 + 4 * ceil(n / 256) / n <= 3. Row
  slices and the planner's miniatures (each axis cut to at most 3) keep the answer. A moment of
  no elements stays as it is.

  Examples:
    >>> quantizes((64, 256)), quantizes((64, 2)), quantizes((64, 1)), quantizes((4096,))
    (True, True, False, False)
  """
  return len(shape) >= 2 and shape[-1] >= 2 and 0 not in shape


def _flatten_params(params: Any) -> tuple[list[Any], Any]:
  """The params' leaves, taking None (a leaf outside a group) and wrappers (``nnx.Param``) as
  leaves, and their structure."""
  return jax.tree.flatten(params, is_leaf=lambda x: x is None or _is_wrapper(x))


def _map_moments(inner: optax.GradientTransformation, state: Any, params: Any, fn) -> Any:
  """`state` with ``fn(path, x, p, x_def)`` in place of each array ``x`` of its param-shaped
  subtrees that is alone under its param ``p``, bare or in a wrapper ``x_def`` (an ``nnx.Param``),
  where `fn` returns a tree (None: ``x`` is kept). Under a param, a container (sm3's list of
  accumulators, one per axis) or nothing (`optax.masked`'s `MaskedNode`; a leaf outside a group,
  None in `params`: `StateLayout.skeletons`) is kept as it is."""
  p_leaves, p_def = _flatten_params(params)
  template = layout_lib.state_template(inner, p_def)

  def per_slot(path, t, value):
    if not layout_lib.is_placeholder(t):
      return value

    def one(p, x):
      if not (hasattr(x, "shape") or _is_wrapper(x)):  # (a list, even of one: sm3's of a vector)
        return x
      x_leaves, x_def = jax.tree.flatten(x)
      p_leaves = jax.tree.leaves(p)
      if len(x_leaves) != 1 or len(p_leaves) != 1:
        return x
      new = fn(path, x_leaves[0], p_leaves[0], x_def)
      return x if new is None else new

    new = [one(p, x) for p, x in zip(p_leaves, layout_lib.param_parts(p_def, value))]
    return layout_lib.param_tree(p_def, new, value)

  return jax.tree_util.tree_map_with_path(
    per_slot, template, state, is_leaf=layout_lib.is_placeholder
  )


def _quantize_moments(inner: optax.GradientTransformation, state: Any, params: Any) -> Any:
  """`state` with its moments quantized: fp32 arrays shaped like their param that `quantizes`,
  in the param-shaped subtrees (the signed or unsigned map by the subtree's field name).

  The rule looks at the rank, not the size: a row slice of a leaf (the plan's slices, the planner's
  probes on miniatures) must be quantized as the whole leaf is. A moment in a wrapper (an
  ``nnx.Param``) becomes a `QuantizedMoment` of two wrapped arrays."""

  def quantized(path, x, p, x_def):
    if not quantizes(jnp.shape(x)) or not is_moment(x, p, INT8):
      return None
    signed = _slot_name(path) not in UNSIGNED_SLOTS or isinstance(_parent(state, path), _SIGNED_NU)
    # The barrier keeps XLA from constant-folding the quantization of the initial zeros inside a
    # trace (over 1 s for a 1024 x 256 moment: folding runs element by element at compile time).
    q = quantize(jax.lax.optimization_barrier(x), signed)
    return QuantizedMoment(x_def.unflatten([q.codes]), x_def.unflatten([q.scales]))

  return _map_moments(inner, state, params, quantized)


def _unquantized_init(inner: optax.GradientTransformation, params: Any) -> Any:
  """`inner.init(params)`; ValueError if its state already holds 8-bit moments (a
  `with_moment_dtype` inside `inner`, e.g. per leaf in ``optax.multi_transform``), whose other
  moments narrowing again would take from the dtype chosen for them."""
  state = inner.init(params)
  if any(is_quantized(x) for x in jax.tree.leaves(state, is_leaf=is_quantized)):
    raise ValueError(
      "moment_dtype: the inner transformation already keeps moments in 8 bits (a "
      "with_moment_dtype inside it, e.g. per leaf in optax.multi_transform); narrowing all of "
      "them again would override the dtypes chosen inside. Leave moment_dtype unset (offload's "
      "too) and choose every leaf's moment dtype inside (docs/tiers.md, 'Choosing per leaf')."
    )
  return state


def _quantized_moments(
  inner: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
  """`with_moment_dtype(inner, "int8")`."""

  def init_fn(params):
    if layout_lib.asks_for_layout(params):  # tree_map_params and offload ask for the layout
      return inner.init(params)
    return _quantize_moments(inner, _unquantized_init(inner, params), params)

  def update_fn(updates, state, params=None, **extra_args):
    wide = jax.tree.map(
      lambda x: dequantize(x) if is_quantized(x) else x, state, is_leaf=is_quantized
    )
    new_updates, new_state = inner.update(updates, wide, params, **extra_args)
    # Quantized again where it came quantized: a row slice keeps its leaf's form.
    new_state = jax.tree.map(
      lambda new, old: (
        quantize(new, signed=jnp.dtype(_parts(old)[0].dtype) == jnp.int8)
        if is_quantized(old)
        else new
      ),
      new_state,
      state,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def with_moment_dtype(
  inner: optax.GradientTransformation, moment_dtype: Any
) -> optax.GradientTransformationExtraArgs:
  """Keeps the moments of `inner`'s state in `moment_dtype`, computing the update as before.

  The moments are the float arrays of the state's parameter-shaped subtrees (the subtrees
  `optax.tree_utils.tree_map_params` maps), alone under their param, that have its shape and a
  dtype wider than `moment_dtype`: Adam's ``mu`` and ``nu``, momentum's ``trace``, Lion's ``mu``,
  ... . Step counts, hyper-parameters, adafactor's factored rows and columns, sm3's lists of
  accumulators and leaves already narrow are kept as they are; under `offload`'s ``master_dtype``
  the master copy is outside this state and stays in its dtype. (An inner state that keeps a
  param-shaped copy of the params, e.g. lookahead's slow weights, is rounded too: wrap only the
  part that holds moments.)

  ``update`` widens the moments to the dtype ``inner.init`` gives them for the params (for the
  updates when no params are passed), runs `inner`, and rounds the new moments to `moment_dtype`
  (round to nearest even). So the result equals `inner` on fp32 state whose moments are rounded
  to `moment_dtype` after every step, bit for bit. Optax's own ``mu_dtype`` differs: it computes
  ``b1 * mu`` in bf16 with ``b1`` rounded to bf16 (0.9 becomes 0.8984375), docs/tiers.md.

  With ``"int8"`` each fp32 moment of 2 or more dimensions becomes a `QuantizedMoment` (8-bit
  codes and an fp32 scale per block of 256 along the last axis, bitsandbytes' blockwise dynamic
  quantization; see the module's docstring); ``update`` reads them back to fp32, runs `inner` and
  quantizes the new moments (per-block absmax, nearest code). 1-D moments (biases, norm scales)
  stay fp32, whatever their size, and so do moments whose last axis is 1 (8 bits would take 5
  bytes per element there, `quantizes`); small 2-D ones are quantized too (the rule must not
  depend on the size: a row slice is quantized as its leaf); moments that are not fp32 (bf16
  params without a master copy) keep their dtype. `oo.to_inner` reads a quantized state back to
  the plain optimizer's.

  Args:
    inner: an optax transformation whose state `optax.tree_utils.tree_map_params` can map.
    moment_dtype: ``"bf16"``, ``jnp.bfloat16``, ``"fp16"``: a float of at least 16 bits; or
      ``"int8"``: 8-bit block-quantized.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state has `inner`'s structure (with
    ``"int8"``, a `QuantizedMoment` in place of each quantized moment).

  Raises:
    ValueError: `moment_dtype` is not a float of at least 16 bits or ``"int8"`` (``"int4"`` and
      8-bit floats are refused).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import optax_offload as oo
    >>> tx = oo.with_moment_dtype(optax.adam(1e-3), "bf16")
    >>> params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> state[0].mu["w"].dtype, state[0].count.dtype
    (dtype(bfloat16), dtype('int32'))
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"].dtype, state[0].nu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
    >>> tx = oo.with_moment_dtype(optax.adam(1e-3), "int8")
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> state[0].mu["w"].codes.dtype, state[0].nu["w"].codes.dtype, state[0].mu["w"].scales.shape
    (dtype('int8'), dtype('uint8'), (4, 1))
    >>> state[0].mu["b"].dtype  # 1-D: fp32
    dtype('float32')
  """
  dtype = parse_moment_dtype(moment_dtype)
  if dtype is None:
    raise ValueError("moment_dtype must be 'bf16', 'fp16' or 'int8', got None.")
  inner = optax.with_extra_args_support(inner)
  if dtype == INT8:
    return _quantized_moments(inner)

  # (a masked-out leaf's MaskedNode, from optax.masked, is no moment: as optax's docstring of
  # masked says, tree_map_params takes it as a leaf)
  def masked_out(x):
    return isinstance(x, optax.MaskedNode)

  def narrow(state, like):
    def narrowed(path, x, p, x_def):
      return x_def.unflatten([x.astype(dtype)]) if is_moment(x, p, dtype) else None

    return _map_moments(inner, state, like, narrowed)

  def init_fn(params):
    if layout_lib.asks_for_layout(params):  # tree_map_params and offload ask for the layout
      return inner.init(params)
    return narrow(_unquantized_init(inner, params), params)

  def update_fn(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    natural = jax.eval_shape(update_dtypes.plain_init(inner), like)
    # (the moments only: the shared leaves keep theirs, which the init of a group of the leaves
    # may give other dtypes, e.g. schedule_free's max_lr takes the params' narrowest)
    template = layout_lib.state_template(inner, _flatten_params(like)[1])
    moments = optax.tree_utils.tree_map_params(
      lambda _: template,
      lambda x: x if masked_out(x) else True,
      state,
      transform_non_params=lambda x: False,
      is_leaf=masked_out,
    )
    wide = jax.tree.map(
      lambda m, x, n: x.astype(n.dtype) if m and jnp.result_type(x) != n.dtype else x,
      moments,
      state,
      natural,
    )
    new_updates, new_state = inner.update(updates, wide, params, **extra_args)
    return new_updates, narrow(new_state, like)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
