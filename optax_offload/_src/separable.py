"""A check that an inner transformation is separable: each leaf's update ignores the other leaves.

`offload` runs the inner transformation group by group, which is only correct when the update of a
leaf depends on its own gradient, parameter and state plus shared scalars. The check runs the inner
transformation for a few steps on a miniature of the parameter tree (same structure, ranks and dtypes,
at most 3 elements per axis), once on the whole tree and once in two groups, with gradients of very
different scales in the two groups, and compares.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import closure_key
from optax_offload._src import stream
from optax_offload._src import stream_spec
from optax_offload._src.layout import StateLayout
from optax_offload._src.plan import Piece
from optax_offload._src.plan import Tier

logger = logging.getLogger(__name__)

_GROUP_SCALES = (1e3, 1e1, 1e2)
"""Gradient scale of the first group at each probe step; the second group's is fixed at 1e-2."""
_PARAM_SCALE = 8.0
"""The split probes' params in the first part are this many times the second part's."""


def _miniature(shape: Sequence[int]) -> tuple[int, ...]:
  return tuple(min(int(d), 3) for d in shape)


def _tolerance(dtype) -> float:
  return 1e-4 if jnp.finfo(dtype).bits >= 32 else 3e-2


def run_grouped(
  inner: optax.GradientTransformationExtraArgs,
  layout: StateLayout,
  groups: Sequence[Sequence[int]],
  grads: Sequence[jax.Array],
  state: optax.OptState,
  params: Sequence[jax.Array] | None,
  **extra_args,
) -> tuple[list[jax.Array], optax.OptState]:
  """The inner update run group by group (whole leaves), with no placement.

  Returns:
    The update leaves (in leaf order) and the new full state.
  """
  shared, per_leaf = layout.split(state)
  spec = _device_spec(tuple(tuple(Piece(i) for i in g) for g in groups), per_leaf, None)
  updates, new_shared, new_per_leaf, _ = stream.run(
    inner, layout, spec, grads, shared, per_leaf, params, extra_args
  )
  return updates, layout.merge(new_shared, new_per_leaf)


def _device_spec(units, per_leaf, dims=None, chunks=None) -> stream_spec.StreamSpec:
  """A spec with every array on the device (no moves), one chunk per piece unless given."""
  tiers = tuple((Tier.DEVICE,) * len(jax.tree.leaves(part)) for part in per_leaf)
  dims = dims or tuple((0,) * len(t) for t in tiers)
  chunks = chunks or tuple(((0, 1),) * len(u) for u in units)
  return stream_spec.StreamSpec(units, tiers, dims, chunks)


_PROBE_CAP = 256
"""Non-leading axes of a split probe are cut to this length (keeping e.g. adafactor's factoring,
which starts at 128)."""


def shared_dims(part: object, shape: Sequence[int]) -> tuple[int, ...]:
  """How many leading axes (at most 2) each array of a state part shares with its param."""
  out = []
  for x in jax.tree.leaves(part):
    d = 0
    while d < min(2, len(shape), len(x.shape)) and x.shape[d] == shape[d]:
      d += 1
    out.append(d)
  return tuple(out)


def splittable(
  inner: optax.GradientTransformationExtraArgs,
  avals: Sequence[jax.ShapeDtypeStruct],
  per_leaf: Sequence[object],
  dims: Sequence[Sequence[int]],
  min_size: int,
  axis: int,
  treedef=None,
) -> list[int]:
  """Per leaf: the length of `axis` when its update may be split along it, else 0.

  Axis 0: updating rows ``[0:1]`` and ``[1:n]`` as separate pieces equals updating the whole leaf
  (row slices and row chunks). Axis 1: updating it in two column chunks, each applied to the params
  in place, equals the whole update applied. A probe checks this on a small leaf with the same
  trailing axes (cut to 256) and very different param and gradient scales in the two parts, over
  a few steps; the large state arrays must share the split axes with the param. With the params'
  `treedef` (``avals`` then being all its leaves), a leaf that `inner` updates at its own path
  otherwise than on a tree of its own is not split (`_rules_as_probed`). Elementwise optimizers
  qualify; lamb and lars (trust ratio over the leaf) do not, nor adafactor's factored moments
  along the factored axes (stacked 3-D leaves split along axis 0 qualify).

  The probes of all the shapes asked for, along both axes, run in one compiled program, and their
  results are kept for the next call with `inner` or a transformation built alike (`_learned`):
  `offload` asks for the rows, then for the columns; a transformation initialized again, or built
  again alike in a new `offload`, is not probed again (nor checked by `check_separable` once it
  passed).
  """
  keys = []
  for aval, part, depth in zip(avals, per_leaf, dims):
    shape = tuple(aval.shape)
    arrays = jax.tree.leaves(part)
    big = [j for j, x in enumerate(arrays) if np.prod(x.shape) >= min_size]
    if (
      len(shape) <= axis
      or shape[axis] < 2
      or not big
      or not all(depth[j] > axis for j in big)
      or not jnp.issubdtype(aval.dtype, jnp.floating)
    ):
      keys.append(None)
      continue
    trailing = tuple(min(int(d), _PROBE_CAP) for d in shape[1:])
    keys.append((jnp.dtype(aval.dtype), trailing, tuple(depth), axis, jax.tree.structure(part)))
  asked = {k for k in keys if k is not None}
  known = _learned(inner)[0] if asked else {}
  if not asked <= known.keys():
    # Both axes of each shape: `offload` asks for the columns next.
    both = {
      k[:3] + (a,) + k[4:]
      for k in asked
      for a in (0, 1)
      if a <= len(k[1]) and min(k[2]) > a and (a == 0 or k[1][0] >= 2)
    }
    results, failed = _probe(inner, sorted((asked | both) - known.keys(), key=repr))
    known.update({k: v for k, v in results.items() if k not in failed})
    known = {**known, **results}
  split = [k is not None and known[k] for k in keys]
  if treedef is not None and any(split):
    split = [s and same for s, same in zip(split, _rules_as_probed(inner, treedef, avals))]
  return [int(a.shape[axis]) if s else 0 for s, a in zip(split, avals)]


def _rules_as_probed(inner, treedef, avals: Sequence[jax.ShapeDtypeStruct]) -> list[bool]:
  """Per leaf of `treedef`: whether `inner` updates it at its own path as on a tree of its own.

  The split probes run on a tree of their own, whose paths are not the params': a rule that
  ``optax.masked`` or ``optax.multi_transform`` picks by path and that keeps no state of its own
  (a trust ratio masked to some leaves, as ``optax.lars``'s ``trust_ratio_mask`` may be) would be
  probed without it. A step from the same values (a miniature of each leaf: at most 3 elements
  per axis), on the params' tree and on a tuple of its leaves, must give each leaf the same
  update (a rule with a state of its own is seen by the probes: the state's structure is part
  of their key). A rule picked by size is not seen (it sees the same sizes on both).
  """
  learned = _learned(inner)[0]
  minis = tuple((jnp.dtype(a.dtype), _miniature(a.shape)) for a in avals)
  asked = ("rules", treedef, minis)
  if asked in learned:
    return learned[asked]
  rng = np.random.default_rng(0)
  params, grads = [], []
  for dtype, shape in minis:
    p, g = rng.normal(size=shape) + 0.5, rng.normal(size=shape)
    if shape:  # (parts of very different scales, as in the split probes)
      p[:1] *= _PARAM_SCALE
      g[:1] *= 1e3
    params.append(p.astype(dtype))
    grads.append(g.astype(dtype))

  def step(params, grads):
    return jax.tree.leaves(inner.update(grads, inner.init(params), params)[0])

  def both(params, grads):
    return step(treedef.unflatten(params), treedef.unflatten(grads)), step(
      *map(tuple, (params, grads))
    )

  with jax.ensure_compile_time_eval():
    try:
      out = jax.device_get(_compiled(jax.jit(both).trace(params, grads))(params, grads))
    except Exception as e:  # a best effort: what cannot be checked is not split
      logger.warning(
        "offload: could not check that the split probes see each leaf's own rules (%s: %s); "
        "no leaf is split in slices (slower streaming, same results).",
        type(e).__name__,
        e,
      )
      return [False] * len(avals)
  result = []
  for dtype, at_path, alone in zip(minis, *out):
    try:
      if jnp.issubdtype(dtype[0], jnp.floating):
        _compare("x", dtype[0], at_path, alone)
      result.append(True)
    except _NotSeparable:
      result.append(False)
  learned[asked] = result
  return result


_PROBE_COMPILER_OPTIONS = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
}
"""XLA:CPU options of the probe programs: they run once on small arrays, so LLVM's optimizations
would cost more than they save (a 13B Llama's probes, measured once on a loaded machine: 2.5
CPU-s of compile instead of 3.4)."""


def _compiled(traced):
  """A traced probe program compiled with `_PROBE_COMPILER_OPTIONS`."""
  return traced.lower().compile(compiler_options=_PROBE_COMPILER_OPTIONS)


_LEARNED: collections.OrderedDict[str, tuple[list, dict]] = collections.OrderedDict()
"""What the probes found of the last `_LEARNED_KEPT` transformations probed, by `closure_key` (a
transformation built again alike, e.g. ``optax.adamw(1e-2)`` in a new `offload`, is not traced,
compiled nor run again): (the objects its key names by identity, the verdicts: a split key's
`splittable` verdict, and ``("separable", treedef, miniature)`` for a passed `check_separable`)."""
_LEARNED_KEPT = 16


def _learned(inner) -> tuple[dict, bool]:
  """The verdicts of the probes of `inner`, or of a transformation built alike, kept as the latest
  used (a new dict where there are none); and whether they are kept by `closure_key` (else by
  `inner`'s identity: code of another package, whose verdicts may change with what it reads)."""
  key, held = closure_key.closure_key(inner)
  alike = key is not None
  if not alike:
    key, held = f"id {id(inner)}", [inner]
  config = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
  key = f"{jax.default_backend()} {config} {key}"
  if key not in _LEARNED:
    _LEARNED[key] = (held, {})
    if len(_LEARNED) > _LEARNED_KEPT:
      _LEARNED.popitem(last=False)
  _LEARNED.move_to_end(key)
  return _LEARNED[key][1], alike


def _probe(inner, keys: Sequence[tuple]) -> tuple[dict[tuple, bool], set[tuple]]:
  """The split probes of ``(dtype, trailing axes, depth, axis, state structure)`` keys in one
  program, each key a leaf of one probe tree (the leaves' updates are independent:
  `check_separable`); one program a key if that fails, so that a key the probe cannot run stays
  whole alone.

  Returns:
    (each key's verdict, the keys whose probe failed: not split, and not kept for the next call).
  """
  try:
    return _probe_program(inner, keys), set()
  except Exception as e:  # a best effort: find the keys that fail
    if len(keys) == 1:  # do not split what the probe cannot check
      logger.warning(
        "offload: the split probe of %s failed (%s: %s); such leaves stay whole (slower "
        "streaming, same results).",
        keys[0],
        type(e).__name__,
        e,
      )
      return {keys[0]: False}, {keys[0]}
    results, failed = {}, set()
    for key in keys:
      verdict, bad = _probe(inner, [key])
      results.update(verdict)
      failed |= bad
    return results, failed


@dataclasses.dataclass
class _Probe:
  """The probe tree of the keys of one axis: params, gradients of each step, the split spec."""

  keys: list[tuple]
  axis: int
  layout: StateLayout
  params: tuple[np.ndarray, ...]
  grads: list[tuple[np.ndarray, ...]]
  spec: stream_spec.StreamSpec
  ok: list[bool]  # the state is the key's, sharing the split axes with the param as it says
  update_dtypes: list  # the dtype of each leaf's update (before it is applied)

  @classmethod
  def make(cls, inner, keys: list[tuple], axis: int) -> _Probe:
    shapes = [(next(m for m in range(5, 64) if m not in k[1]), *k[1]) for k in keys]
    # Each key's values from its own seed: its verdict does not depend on the keys beside it.
    rngs = [np.random.default_rng(zlib.crc32(repr(k[:4]).encode())) for k in keys]
    params = []
    for rng, s, k in zip(rngs, shapes, keys):
      p = rng.normal(size=s) + 0.5
      # Params of very different scales in the two parts too (a power of two: exact in any
      # dtype): a rule over the whole leaf's params (lamb's and lars's trust ratio, a param-RMS
      # scale) then moves the split update by far more than a rounding.
      p[(slice(None),) * axis + (slice(0, s[1] // 2 if axis else 1),)] *= _PARAM_SCALE
      params.append(p.astype(k[0]))
    params = tuple(params)
    layout = StateLayout(inner, jax.tree.structure(params))
    per_leaf = layout.split(jax.eval_shape(inner.init, params))[1]
    depths = [shared_dims(part, s) for part, s in zip(per_leaf, shapes)]
    # A key whose state does not share the split axes is not split (and is not separable); nor one
    # whose probe leaf gets another rule's state than the leaf's (optax.multi_transform or masked
    # picking rules of different states by path run another rule on the probe's leaf). A rule
    # picked by path or size that keeps no state of its own (a masked trust ratio) is not seen:
    # such a leaf may be split (docs/gpu.md says what to do).
    ok = [
      d == k[2] and jax.tree.structure(part) == k[4] for part, d, k in zip(per_leaf, depths, keys)
    ]
    if axis == 0:
      units = [(Piece(n, 0, 1),) if good else (Piece(n),) for n, good in enumerate(ok)]
      units += [(Piece(n, 1, s[0]),) for n, (s, good) in enumerate(zip(shapes, ok)) if good]
      chunks = None
    else:
      units = [(Piece(n),) for n in range(len(keys))]
      chunks = tuple(((1, 2) if good else (0, 1),) for good in ok)
    spec = _device_spec(tuple(units), per_leaf, tuple(depths), chunks)
    grads = []
    for scale in _GROUP_SCALES:
      step = []
      for rng, s, k in zip(rngs, shapes, keys):
        g = rng.normal(size=s) * 1e-2
        g[(slice(None),) * axis + (slice(0, s[1] // 2 if axis else 1),)] *= 1e2 * scale
        step.append(g.astype(k[0]))
      grads.append(tuple(step))
    updates = jax.eval_shape(lambda p, g: inner.update(g, inner.init(p), p)[0], params, grads[0])
    update_dtypes = [u.dtype for u in jax.tree.leaves(updates)]
    return cls(keys, axis, layout, params, grads, spec, ok, update_dtypes)

  def run(self, inner, params, grads):
    """The joint and the split update over the steps (traced, one step a scan iteration): for each
    step, (joint updates, split updates, joint state, split state)."""

    def step(states, g):
      state, split_state = states
      joint, state = inner.update(g, state, params)
      if self.axis == 1:
        joint = optax.apply_updates(params, joint)
      shared, per = self.layout.split(split_state)
      split, new_shared, new_per, _ = stream.run(
        inner, self.layout, self.spec, list(g), shared, per, list(params), {}, apply=self.axis == 1
      )
      split_state = self.layout.merge(new_shared, new_per)
      return (state, split_state), (list(joint), split, state, split_state)

    state = inner.init(params)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    _, out = jax.lax.scan(step, (state, state), stacked)
    return [jax.tree.map(lambda x, t=t: x[t], out) for t in range(len(grads))]

  def check(self, out) -> dict[tuple, bool]:
    """Each key's verdict from `run`'s results."""
    result = {}
    for n, key in enumerate(self.keys):
      dtype = key[0]
      params = np.asarray(self.params[n], np.float64)
      # Updates computed wider than low-precision params (master weights) may round either way:
      # 2 eps of the params is noise, not a dependence on the other part. Updates of the params'
      # own dtype get no such room (lamb's trust ratio on bfloat16 params moves an update by less
      # than a bfloat16 ulp of the params, far more than its own).
      wider = jnp.finfo(self.update_dtypes[n]).bits > jnp.finfo(dtype).bits
      rounding = 2 * float(jnp.finfo(dtype).eps) * np.abs(params)  # (each element's)
      ulp = rounding if wider else 0.0
      try:
        if not self.ok[n]:
          raise _NotSeparable("the state is not the key's, or does not share the split axes")
        for joint, split, state, split_state in out:
          if self.axis == 1:
            # New params, applied in place: their steps are compared, less a rounding of the sum
            # to the params' dtype (so a bfloat16 update that differs by less than the params'
            # ulp is not seen here: lamb's columns on bfloat16 params, docs/gpu.md).
            steps = [np.asarray(x[n], np.float64) - params for x in (joint, split)]
            _compare("x", dtype, *steps, atol=rounding)
          else:
            _compare("x", dtype, joint[n], split[n], atol=ulp)
          (shared, per), (split_shared, split_per) = (
            self.layout.split(state),
            self.layout.split(split_state),
          )
          for a, b in zip(
            jax.tree.leaves((shared, per[n])), jax.tree.leaves((split_shared, split_per[n]))
          ):
            # (each state array at its own precision: a float32 master copy at float32's)
            own = np.asarray(a).dtype
            _compare("x", own if jnp.issubdtype(own, jnp.floating) else dtype, a, b)
        result[key] = True
      except _NotSeparable:
        result[key] = False
    return result


def _probe_program(inner, keys: Sequence[tuple]) -> dict[tuple, bool]:
  probes = [
    _Probe.make(inner, [k for k in keys if k[3] == axis], axis)
    for axis in (0, 1)
    if any(k[3] == axis for k in keys)
  ]
  with jax.ensure_compile_time_eval():
    # Compiled, not op by op, and one program for all: eager ops compile one small program each,
    # per shape (for a 13B Llama's leaves, 5 s of the first compile's trace), and each program
    # ~0.3 s.
    args = [(p.params, p.grads) for p in probes]
    program = jax.jit(lambda args: [p.run(inner, *a) for p, a in zip(probes, args)])
    outs = jax.device_get(_compiled(program.trace(args))(args))
  result = {}
  for p, out in zip(probes, outs):
    result.update(p.check(out))
  return result


def check_separable(
  inner: optax.GradientTransformationExtraArgs,
  layout: StateLayout,
  paths: Sequence[str],
  avals: Sequence[jax.ShapeDtypeStruct],
) -> None:
  """Raises ValueError when the inner transformation mixes leaves.

  Args:
    inner: the inner transformation.
    layout: the state layout for the parameter tree.
    paths: key paths of the parameter leaves, for messages.
    avals: shapes and dtypes of the parameter leaves.

  Raises:
    ValueError: when the grouped update differs from the joint one.
  """
  n = layout.num_leaves
  if n < 2 or not all(jnp.issubdtype(a.dtype, jnp.floating) for a in avals):
    return
  learned, alike = _learned(inner)
  # (it runs on a miniature of the tree: what it finds holds for the trees of that miniature)
  asked = (
    "separable",
    layout.params_treedef,
    tuple((jnp.dtype(a.dtype), _miniature(a.shape)) for a in avals),
  )
  if learned.get(asked):  # (only passes are kept, and only by `closure_key`)
    return
  rng = np.random.default_rng(0)
  groups = (tuple(range(0, n, 2)), tuple(range(1, n, 2)))
  params = [(rng.normal(size=_miniature(a.shape)) + 0.5).astype(a.dtype) for a in avals]
  grads = [
    [
      (rng.normal(size=p.shape) * (scale if i % 2 == 0 else 1e-2)).astype(p.dtype)
      for i, p in enumerate(params)
    ]
    for scale in _GROUP_SCALES
  ]

  @jax.jit
  def joint_and_grouped(params, grads):
    params_tree = layout.params_treedef.unflatten(params)
    joint_state = split_state = inner.init(params_tree)
    out = []
    for g in grads:
      joint, joint_state = inner.update(
        layout.params_treedef.unflatten(g), joint_state, params_tree
      )
      split, split_state = run_grouped(inner, layout, groups, g, split_state, params)
      out.append((layout.params_treedef.flatten_up_to(joint), split))
    return out

  with jax.ensure_compile_time_eval():
    try:
      # Compiled, not op by op, in one program (see `_probe_program`).
      out = jax.device_get(_compiled(joint_and_grouped.trace(params, grads))(params, grads))
    except Exception as e:  # the probe is a best effort; the real update reports real errors
      logger.warning(
        "offload: could not check that the inner transformation is separable (%s: %s); "
        "continuing without the check.",
        type(e).__name__,
        e,
      )
      return
  for joint, split in out:
    for i in range(n):
      _compare(paths[i], avals[i].dtype, joint[i], split[i])
  if alike:  # (by identity a pass may not hold: what the code reads may have changed)
    learned[asked] = True


class _NotSeparable(ValueError):
  pass


def _compare(path: str, dtype, joint: jax.Array, split: jax.Array, atol: float = 0.0) -> None:
  a = np.asarray(joint, np.float64)
  b = np.asarray(split, np.float64)
  scale = np.max(np.abs(a), initial=0.0)
  diff = np.abs(a - b)
  bad = ~(diff <= _tolerance(dtype) * np.abs(a) + 1e-6 * scale + atol) & ~(
    np.isnan(a) & np.isnan(b)
  )
  if np.any(bad):
    rel = float(np.max(diff / np.maximum(np.abs(a), 1e-30)))
    raise _NotSeparable(
      "offload: the inner transformation is not separable: the update of leaf "
      f"{path} changes when the other leaves are updated in a separate group (relative "
      f"difference up to {rel:.3g}). offload updates the state group by group, so a transformation "
      "that mixes leaves (global-norm clipping, global noise, ...) must go outside it, e.g. "
      "optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-3))). If you are "
      "sure it is separable, pass check_separable=False."
    )
