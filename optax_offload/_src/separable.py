"""A check that an inner transformation is separable: each leaf's update ignores the other leaves.

`offload` runs the inner transformation group by group, which is only correct when the update of a
leaf depends on its own gradient, parameter and state plus shared scalars. The check runs the inner
transformation for `_STEPS` steps on a miniature of the parameter tree (same structure, ranks and
dtypes, at most 3 elements per axis), once on the whole tree and once in two groups, with gradients
of very different scales in the two groups, and compares.

`splittable` probes, the same way, which leaves may be updated in row slices or column chunks, on
a tree of its own, over `_FEW_STEPS` steps (`_STEPS` for a transformation whose update waits:
`_Learned.steps`); each leaf's rule (`_fingerprints`) says whether the probe's verdict is the leaf's, or
the leaf must be probed at its own path (a rule picked by path).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import weakref
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_offload._src import closure_key
from optax_offload._src import master
from optax_offload._src import stream
from optax_offload._src import stream_spec
from optax_offload._src import update_dtypes
from optax_offload._src.layout import StateLayout
from optax_offload._src.plan import Piece
from optax_offload._src.plan import Tier

logger = logging.getLogger(__name__)

_GROUP_SCALES = (1e3, 1e1, 1e2)
"""Gradient scales of the first group, in turn at each probe step; the second group's is 1e-2."""
_STEPS = 16
"""Steps of the separability check, and of the split probes of a transformation whose update
waits (``optax.MultiSteps`` inside `offload`, a learning rate of 0 at first): it is seen where it
moves within them. A leaf whose update (or master copy) moves in none of them is not split."""
_FEW_STEPS = 3
"""Steps of the split probes (and the rules, `_fingerprints`) of a transformation until one
probe's update waits longer (`_Learned.steps`)."""
_LONGEST_CHECK = 256
"""Steps of the separability check where no update moved in `_STEPS` (on miniatures: cheap); a
transformation whose updates wait longer is not checked (a warning)."""


def _scale(t: int) -> float:
  """The first group's gradient scale at probe step t."""
  return _GROUP_SCALES[t % len(_GROUP_SCALES)]


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
  """`_splittable`'s lengths; with the params' `treedef`, 0 for the leaves whose update changes
  when they are cut (`same_rule_when_cut`, on `inner`'s `twin`)."""
  lengths = _splittable(inner, avals, per_leaf, dims, min_size, axis, treedef)
  if treedef is None:
    return lengths
  return same_rule_when_cut(twin(inner), treedef, avals, lengths, axis)


def _splittable(
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
  (row slices and row chunks). Axis 1: updating it in two column chunks (which `update_and_apply`
  applies to the params in place) equals updating it whole. A probe checks this on a small leaf
  with the same trailing axes (cut to 256) and very different param and gradient scales in the
  two parts, over a few steps; the large state arrays must share the split axes with the param.
  Elementwise optimizers qualify; lamb and lars (trust ratio over the leaf) do not, nor
  adafactor's factored moments along the factored axes (stacked 3-D leaves split along axis 0
  qualify).

  The probes run on a tree of their own, a tuple, whose paths are not the params': with the
  params' `treedef` (``avals`` then being all its leaves), each leaf's rule is compared with its
  probe's (`_fingerprints`: a rule that ``optax.masked`` or ``optax.multi_transform`` picks by
  path, e.g. weight decay or a trust ratio masked to some leaves), and a leaf whose rule differs,
  or whose transformation cannot run on a tuple (a mask or labels given as a pytree), is probed
  at its own path (`At`). Without `treedef` only the tuple's verdicts are taken.

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
  if not asked:
    return [0] * len(keys)
  known, alike = _learned(inner)
  # On a tuple tree: each key's (verdict, fingerprint of the rule at its probe's path).
  todo = [k for k in _both_axes(asked) if k not in known.split and k not in known.no_tuple]
  if todo:
    results, failed = _probe(inner, sorted(todo, key=repr), warn=treedef is None)
    known.split.update({k: v for k, v in results.items() if k not in failed})
    known.no_tuple.update(failed)
  on_a_tuple = known.no_tuple.isdisjoint(asked)
  # Only a user's function or pytree picks a rule by path (optax's own code does not): with
  # neither (a `closure_key`), the tuple's rules are the params' (but for params that are a tuple
  # themselves, whose mask may be a tuple too, fitting the probes' tree).
  tuple_root = treedef is not None and (treedef.node_data() or (None,))[0] is tuple
  if treedef is None or (alike and on_a_tuple and not tuple_root):
    return [
      int(a.shape[axis]) if k in known.split and known.split[k][0] else 0
      for k, a in zip(keys, avals)
    ]
  if on_a_tuple and not any(known.split[k][0] for k in asked):
    return [0] * len(keys)  # (no probe splits: lamb's; a leaf of another rule stays whole)
  steps = known.steps
  prints = _fingerprints(inner, treedef, avals)
  if prints is None:
    return [0] * len(keys)

  def verdict(k, n):
    """A verdict probed under leaf n's rule (None if none was)."""
    if k in known.split and _alike(prints[n], known.split[k][1], k[0]):
      return known.split[k][0]
    return next((v for f, v in known.at.get(k, ()) if _alike(prints[n], f, k[0])), None)

  # The rest at their own paths: one leaf of each rule not probed yet, both axes.
  reps = []
  for n, k in enumerate(keys):
    if k is not None and verdict(k, n) is None:
      if not any(k == j and _alike(prints[n], prints[m], k[0]) for j, m in reps):
        reps.append((k, n))
  if reps:
    items = sorted({(j, n) for k, n in reps for j in _both_axes({k})}, key=repr)
    results, _ = _probe(inner, items, at=At(treedef, tuple(avals)))
    if known.steps != steps:
      # (an update that waits: the rules again over as many steps, rules that both wait look
      # alike over fewer)
      return _splittable(inner, avals, per_leaf, dims, min_size, axis, treedef)
    for (j, n), (v, _) in results.items():  # (one that failed: not split, not probed again)
      known.at.setdefault(j, []).append((prints[n], v))
  return [
    int(a.shape[axis]) if k is not None and verdict(k, n) else 0
    for n, (k, a) in enumerate(zip(keys, avals))
  ]


_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""For a transformation `tree_plan.offloaded_inner` returned with narrower moments, the same
without them: `compress.with_moment_dtype` narrows each leaf's moments on its own, so the two mix
leaves alike, and `check_separable` runs on the wider one, whose check compiles in a fraction of
the time (8-bit moments: 2.4 s instead of 6.7 s for a 4-layer decoder's miniature, measured
once); `same_rule_when_cut` too (the quantizer's jitted code traces differently per shape)."""


def register_twin(inner, wider) -> None:
  """Records `wider`, `inner` without its narrower moments (`twin`)."""
  _TWINS[inner.update] = wider


def twin(inner):
  """`inner` without its narrower moments where `register_twin` recorded one, else `inner`."""
  return _TWINS.get(inner.update, inner)


def same_rule_when_cut(inner, treedef, avals, lengths: Sequence[int], axis: int) -> list[int]:
  """`lengths` (`splittable`'s), 0 for each leaf whose update `inner` traces otherwise when the
  leaf is cut to one row (``axis`` 0) or column (1): a mask or labels chosen by a leaf's shape or
  size, which the split probes' miniatures cannot show, would give a slice another rule than its
  leaf's. One trace of the tree whole and one with every such leaf cut, compared without their
  shapes (`_signature`); where they differ, one more per leaf finds which. A warning names the
  leaves kept whole (for columns, an INFO record). Kept per transformation (`_learned`); not
  done for one built of optax's code alone (`closure_key`), which picks no rule by a leaf's size
  (its shape-dependent rules, adafactor's factoring, the split probes see).

  Examples:
    >>> import jax, optax
    >>> avals = [jax.ShapeDtypeStruct((8, 4), "float32")] * 2
    >>> treedef = jax.tree.structure({"a": 0, "b": 0})
    >>> same_rule_when_cut(optax.adam(1e-3), treedef, avals, [8, 8], 0)
    [8, 8]

  (A user's mask by size, ``lambda p: jax.tree.map(lambda x: x.size > 4, p)`` in
  ``optax.masked``, gives ``[0, 0]`` here, a row being 4 elements: tests/test_transform.py.)
  """
  cut = [n for n, length in enumerate(lengths) if length]
  if not cut:
    return list(lengths)
  learned, alike = _learned(inner)
  if alike:  # only optax's (and this package's) code: no rule picked by a leaf's shape or size
    return list(lengths)
  known = learned.cut
  asked = (treedef, tuple(avals), tuple(lengths), axis)
  if asked not in known:
    known[asked] = _same_rule_when_cut(inner, treedef, avals, lengths, axis, cut)
  return list(known[asked])


def _same_rule_when_cut(inner, treedef, avals, lengths, axis, cut) -> list[int]:

  def traced(leaves):
    def step(params):
      return inner.update(params, inner.init(params), params)

    try:
      return _signature(jax.make_jaxpr(step)(treedef.unflatten(list(leaves))))
    except Exception:  # (whole, the update traced; cut, it may refuse the shape: not cut)
      return None

  def with_cut(ns):
    return [
      jax.ShapeDtypeStruct(a.shape[:axis] + (1,) + a.shape[axis + 1 :], a.dtype) if n in ns else a
      for n, a in enumerate(avals)
    ]

  whole = traced(avals)
  if whole is None or traced(with_cut(set(cut))) == whole:
    return list(lengths)
  changed = [n for n in cut if traced(with_cut({n})) != whole]
  if changed:  # (a column chunk is rarely needed: said at the INFO level)
    (logger.warning if axis == 0 else logger.info)(
      "offload: the update of %d leaves changes when they are cut in %s (a mask or labels chosen "
      "by the leaf's shape or size?): they are updated whole (more of the window). Give such a "
      "mask as a pytree, e.g. mask=mask_fn(params), to let them be cut. Leaves: %s",
      len(changed),
      "row slices" if axis == 0 else "column chunks",
      ", ".join(jax.tree_util.keystr(p) for p in _paths(treedef, changed)),
    )
  return [0 if n in changed else length for n, length in enumerate(lengths)]


def _signature(closed) -> tuple:
  """A traced program without its shapes: its operations in order, calls walked into (a jitted
  function traced once per shape is printed once per shape), with their literal operands, and
  its scalar constants (a learning rate that a label picks)."""
  ops = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      literals = tuple(repr(v.val) for v in eqn.invars if type(v).__name__ == "Literal")
      ops.append((eqn.primitive.name, literals))
      for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # (a ClosedJaxpr's)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(closed.jaxpr)
  consts = tuple(repr(np.asarray(c).item()) for c in closed.consts if np.size(c) == 1)
  return tuple(ops), consts


def _paths(treedef, indices) -> list:
  paths = [
    p
    for p, _ in jax.tree_util.tree_flatten_with_path(treedef.unflatten([0] * treedef.num_leaves))[0]
  ]
  return [paths[n] for n in indices]


def _both_axes(keys: set[tuple]) -> set[tuple]:
  """The keys and their shapes' other axis (`offload` asks for the rows, then the columns)."""
  return keys | {
    k[:3] + (a,) + k[4:]
    for k in keys
    for a in (0, 1)
    if a <= len(k[1]) and min(k[2]) > a and (a == 0 or k[1][0] >= 2)
  }


@dataclasses.dataclass(frozen=True)
class At:
  """The params' own tree, for split probes at the leaves' own paths: each probed leaf takes its
  probe's values there, the other leaves are miniatures (`_miniatures`)."""

  treedef: object
  avals: tuple[jax.ShapeDtypeStruct, ...]


def _miniatures(avals) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Params and gradients of each leaf, at most 3 elements per axis."""
  rng = np.random.default_rng(0)
  shapes = [(_miniature(a.shape), a.dtype) for a in avals]
  params = [(rng.normal(size=s) + 0.5).astype(d) for s, d in shapes]
  return params, [(rng.normal(size=s) * 1e-2).astype(d) for s, d in shapes]


def _two_parts(
  rng, shape, dtype, axis: int = 0, steps: int = _FEW_STEPS
) -> tuple[np.ndarray, list[np.ndarray]]:
  """Params and each probe step's gradients, the first part along `axis` (row 0, or the first
  half of the columns) of very different scales from the rest. The params' factor is a power of
  two (exact in any dtype): a rule over the whole leaf's params (lamb's and lars's trust ratio,
  a param-RMS scale) then moves a split update by far more than a rounding."""
  part = (slice(None),) * axis + (slice(0, shape[1] // 2 if axis else 1),)
  params = rng.normal(size=shape) + 0.5
  params[part] *= _PARAM_SCALE
  grads = []
  for scale in map(_scale, range(steps)):
    g = rng.normal(size=shape) * 1e-2
    g[part] *= 1e2 * scale
    grads.append(g.astype(dtype))
  return params.astype(dtype), grads


def _canonical(dtype, trailing: Sequence[int], steps: int) -> tuple[np.ndarray, list[np.ndarray]]:
  """The values a rule is known by (`_fingerprints`): `_two_parts` of a leaf of `dtype` and these
  trailing axes (cut to 3)."""
  trailing = tuple(min(int(d), 3) for d in trailing)
  rng = np.random.default_rng(zlib.crc32(repr((jnp.dtype(dtype), trailing)).encode()))
  return _two_parts(rng, (4, *trailing), dtype, steps=steps)


def _steps(inner, treedef, params, grads):
  """Per leaf, `inner`'s updates at each step (a leading axis) and how each array of its state
  moved from its initial value (floating arrays; others as they are), the params held (traced)."""
  tree = treedef.unflatten(params)
  layout = StateLayout(inner, treedef)
  initial = inner.init(tree)

  def moved(state):
    return [
      [
        x - x0 if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x, x0 in zip(jax.tree.leaves(part), jax.tree.leaves(part0))
      ]
      for part, part0 in zip(layout.split(state)[1], layout.split(initial)[1])
    ]

  def step(state, g):
    updates, state = inner.update(treedef.unflatten(g), state, tree)
    return state, list(zip(treedef.flatten_up_to(updates), moved(state)))

  return _scan(step, initial, [jnp.stack(leaf) for leaf in zip(*grads)])


def _scan(step, init, xs):
  """The outputs of ``jax.lax.scan(step, init, xs)``, stacked; with the first step taken apart
  where the carry's dtypes change at it (adam's state of an integer leaf)."""
  try:
    return jax.lax.scan(step, init, xs)[1]
  except TypeError:
    carry, first = step(init, jax.tree.map(lambda x: x[0], xs))
    rest = jax.lax.scan(step, carry, jax.tree.map(lambda x: x[1:], xs))[1]
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def _moved(updates, last_state, treedef, params, i: int) -> bool:
  """Whether leaf i's update moved in a probe's steps (`updates`: its update at each step), or
  its master copy did (bfloat16 updates under a float32 master copy at a small learning rate
  round to 0 while the master moves). A state that moves alone (`optax.MultiSteps`' sum of the
  gradients) shows nothing of the update's rule."""
  if any(np.any(np.asarray(u) != 0) for u in updates):
    return True
  if not isinstance(last_state, master.MasterState):
    return False
  copy = treedef.flatten_up_to(last_state.master)[i]
  return copy is not None and bool(
    np.any(np.asarray(copy, np.float64) != np.asarray(params[i], np.float64))
  )


def _fingerprints(
  inner, treedef, avals: Sequence[jax.ShapeDtypeStruct], warn: bool = True
) -> list | None:
  """Per leaf of `treedef`, its rule: its updates at its own path over a few steps from its
  `_canonical` values (None for leaves that are not floating arrays of a rank >= 1; None for all
  when `inner` cannot run them: a warning with `warn`, and nothing is split).

  Leaves of one dtype and trailing shape get the same values, so that two of them, or one and a
  split probe's leaf (`_Probe`), updated alike by a few steps, have one rule: what `offload` can
  see of a rule picked by path. A rule picked by size is not seen (it sees these sizes).
  """
  learned = _learned(inner)[0]
  named = [_named(a) for a in avals]
  steps = learned.steps
  asked = (treedef, tuple(named), steps)
  if asked in learned.rules:
    return learned.rules[asked]
  params, grads = _miniatures(avals)
  grads = [list(grads) for _ in range(steps)]
  for n, name in enumerate(named):
    if name is not None:
      params[n], mine = _canonical(*name, steps)
      for step, g in zip(grads, mine):
        step[n] = g
  try:
    out = _run(lambda p, g: _steps(inner, treedef, p, g), params, grads)
  except Exception as e:  # a best effort: what cannot be checked is not split
    if warn:
      logger.warning(
        "offload: could not compare each leaf's update rule with its split probe's (%s: %s); no "
        "leaf is split in slices (slower streaming, same results).",
        type(e).__name__,
        e,
      )
    return None
  learned.rules[asked] = [None if name is None else x for name, x in zip(named, out)]
  return learned.rules[asked]


def _named(aval) -> tuple | None:
  """The name of a leaf's `_canonical` values (None: not a floating array of a rank >= 1)."""
  if len(aval.shape) < 1 or not jnp.issubdtype(aval.dtype, jnp.floating):
    return None
  return jnp.dtype(aval.dtype), tuple(min(int(d), _PROBE_CAP) for d in aval.shape[1:])


def rules_on_a_tuple(
  inner, treedef, avals: Sequence[jax.ShapeDtypeStruct], leaves: Sequence[int]
) -> list[bool] | None:
  """Per leaf of `leaves`: whether `inner` updates it on a tuple of these leaves as at its own
  path (`_fingerprints`); None when `inner` cannot run on such a tuple (a mask or labels given as
  a pytree). `value_and_update` updates a layer stack's leaves as a tuple of their own.
  """
  learned, alike = _learned(inner)
  steps = learned.steps
  mine = _fingerprints(
    inner, jax.tree.structure((0,) * len(leaves)), [avals[i] for i in leaves], warn=False
  )
  if mine is None:  # (the caller says what to do)
    return None
  if steps < _STEPS and any(x is not None and not np.any(np.asarray(x[0]) != 0) for x in mine):
    # (an update that waits: rules that both wait look alike over fewer steps)
    learned.steps = _STEPS
    return rules_on_a_tuple(inner, treedef, avals, leaves)
  if alike:  # (optax's own code picks no rule by path: `splittable`)
    return [True] * len(leaves)
  prints = _fingerprints(inner, treedef, avals)
  if prints is None:
    return None
  return [x is None or _alike(prints[i], x, avals[i].dtype) for i, x in zip(leaves, mine)]


def _alike(a, b, dtype) -> bool:
  """Whether two fingerprints (a leaf's updates and its state's moves) are of one rule: equal
  within the tolerance of each array's dtype (`dtype`'s for the updates)."""
  (updates, moves), (other_updates, other_moves) = a, b
  if np.shape(updates) != np.shape(other_updates):  # (rules learned over other steps)
    return False
  try:
    _compare("x", dtype, updates, other_updates)
    for x, y in zip(moves, other_moves, strict=True):
      own = np.asarray(x).dtype
      _compare("x", own if jnp.issubdtype(own, jnp.floating) else dtype, x, y)
    return True
  except ValueError:  # (another rule: other values, or a state of other shapes)
    return False


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


def _run(fn, *args):
  """`fn` on `args` as one probe program, traced, `_compiled` and run; its results in numpy.
  Compiled, not op by op, and one program for all: eager ops compile one small program each, per
  shape (for a 13B Llama's leaves, 5 s of the first compile's trace), and each program ~0.3 s.
  Run with ``jax_debug_nans`` off: the probes feed gradients that are not finite themselves."""
  with jax.ensure_compile_time_eval(), jax.debug_nans(False), jax.debug_infs(False):
    return jax.device_get(_compiled(jax.jit(fn).trace(*args))(*args))


@dataclasses.dataclass
class _Learned:
  """What the probes found of one transformation (`_learned`)."""

  split: dict = dataclasses.field(default_factory=dict)
  """Per split key (`splittable`), probed on a tuple tree: (verdict, fingerprint of its rule)."""
  no_tuple: set = dataclasses.field(default_factory=set)
  """The split keys whose probe on a tuple tree failed (a mask or labels given as a pytree)."""
  at: dict = dataclasses.field(default_factory=dict)
  """Per split key, (fingerprint, verdict) pairs probed at the params' own paths (`At`)."""
  rules: dict = dataclasses.field(default_factory=dict)
  """Per (tree structure, leaves' names, steps), the leaves' rules (`_fingerprints`)."""
  separable: set = dataclasses.field(default_factory=set)
  """(params' tree structure, miniature) of each passed `check_separable`."""
  cut: dict = dataclasses.field(default_factory=dict)
  """Per (tree structure, avals, lengths, axis), `same_rule_when_cut`'s lengths."""
  steps: int = _FEW_STEPS
  """The split probes' and rules' steps: `_STEPS` once one's update waited longer than fewer."""


_LEARNED: collections.OrderedDict[str, tuple[list, _Learned]] = collections.OrderedDict()
"""What the probes found (`_Learned`) of the last `_LEARNED_KEPT` transformations probed, with
the objects their key names by identity, by `closure_key` (a transformation built again alike,
e.g. ``optax.adamw(1e-2)`` in a new `offload`, is not traced, compiled nor run again)."""
_LEARNED_KEPT = 16


def _learned(inner) -> tuple[_Learned, bool]:
  """The verdicts of the probes of `inner`, or of a transformation built alike, kept as the latest
  used (new ones where there are none); and whether they are kept by `closure_key` (else by
  `inner`'s identity: code of another package, whose verdicts may change with what it reads)."""
  key, held = closure_key.closure_key(inner)
  alike = key is not None
  if not alike:  # (by its functions': `update_dtypes` wraps the same ones alike every time)
    functions = (update_dtypes.plain_init(inner), inner.update)
    key, held = f"id {tuple(map(id, functions))}", list(functions)
  config = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
  key = f"{jax.default_backend()} {config} {key}"
  if key not in _LEARNED:
    _LEARNED[key] = (held, _Learned())
    if len(_LEARNED) > _LEARNED_KEPT:
      _LEARNED.popitem(last=False)
  _LEARNED.move_to_end(key)
  return _LEARNED[key][1], alike


def _probe(inner, items: Sequence, at: At | None = None, warn: bool = True) -> tuple[dict, set]:
  """`_probe_steps` over `_Learned.steps`; all again over `_STEPS` where an item's update did not
  move in fewer (a transformation that waits: its rules are then learned over as many)."""
  learned = _learned(inner)[0]
  steps = learned.steps
  results, failed = _probe_steps(inner, items, at, warn, steps)
  if steps < _STEPS and any(v is None for v, _ in results.values()):
    learned.steps = _STEPS
    results, failed = _probe_steps(inner, items, at, warn, _STEPS)
  return {k: (bool(v), f) for k, (v, f) in results.items()}, failed


def _probe_steps(inner, items: Sequence, at: At | None, warn: bool, steps: int) -> tuple[dict, set]:
  """The split probes of ``(dtype, trailing axes, depth, axis, state structure)`` keys in one
  program, each key a leaf of one probe tree (the leaves' updates are independent:
  `check_separable`); one program an item if that fails, so that a key the probe cannot run stays
  whole alone. The items are keys (a tuple tree), or ``(key, leaf)`` with `at` (the key probed at
  that leaf's path).

  Returns:
    (each item's verdict (None where its update did not move in the `steps`) and, on a tuple
    tree, its fingerprint; the items whose probe failed: not split, which the caller keeps as
    such).
  """
  try:
    return _probe_program(inner, items, at, steps), set()
  except Exception as e:  # a best effort: find the items that fail
    if len(items) == 1:  # do not split what the probe cannot check
      if warn:
        key = items[0] if at is None else items[0][0]
        logger.warning(
          "offload: the probe that splits %s leaves of trailing axes %s (at most %d) in %s failed "
          "(%s: %s); such leaves stay whole (slower streaming, same results).",
          key[0],
          key[1],
          _PROBE_CAP,
          "columns" if key[3] else "rows",
          type(e).__name__,
          e,
        )
      return {items[0]: (False, None)}, {items[0]}
    results, failed = {}, set()
    for item in items:
      verdict, bad = _probe_steps(inner, [item], at, warn, steps)
      results.update(verdict)
      failed |= bad
    return results, failed


@dataclasses.dataclass
class _Probe:
  """The probe tree of the keys of one axis: params, gradients of each step, the split spec.

  The tree is a tuple of one leaf a key, with the `_canonical` values of each key's shape at the
  same paths (to learn the rule each path gets: `_fingerprints`), or the params' own tree (`At`),
  each key's leaf at the path of the leaf it is probed for."""

  keys: list[tuple]
  axis: int
  treedef: object
  index: list[int]  # each key's leaf in the tree
  layout: StateLayout
  params: list[np.ndarray]
  grads: list[list[np.ndarray]]
  canonical: tuple | None  # (params, grads) of the tuple's fingerprints
  spec: stream_spec.StreamSpec
  ok: list[bool]  # the state is the key's, sharing the split axes with the param as it says
  update_dtypes: list  # the dtype of each leaf's update (before it is applied)

  @classmethod
  def make(
    cls, inner, items: list, axis: int, at: At | None = None, steps: int = _FEW_STEPS
  ) -> _Probe:
    keys = list(items) if at is None else [k for k, _ in items]
    shapes = [(next(m for m in range(5, 64) if m not in k[1]), *k[1]) for k in keys]
    # Each key's values from its own seed: its verdict does not depend on the keys beside it.
    rngs = [np.random.default_rng(zlib.crc32(repr(k[:4]).encode())) for k in keys]
    values = [_two_parts(rng, s, k[0], axis, steps) for rng, s, k in zip(rngs, shapes, keys)]
    mine = [p for p, _ in values]
    grads = [[g[t] for _, g in values] for t in range(steps)]
    if at is None:
      treedef, index, params = jax.tree.structure((0,) * len(keys)), list(range(len(keys))), mine
      values = [_canonical(k[0], k[1], steps) for k in keys]
      canonical = ([p for p, _ in values], [list(g) for g in zip(*(g for _, g in values))])
    else:
      treedef, index, canonical = at.treedef, [n for _, n in items], None
      params, others = _miniatures(at.avals)
      steps = [list(others) for _ in grads]
      for n, i in enumerate(index):
        params[i] = mine[n]
        for step, g in zip(steps, grads):
          step[i] = g[n]
      grads = steps
    layout = StateLayout(inner, treedef)
    per_leaf = layout.split(jax.eval_shape(inner.init, treedef.unflatten(params)))[1]
    depths = [shared_dims(part, p.shape) for part, p in zip(per_leaf, params)]
    # A key whose state does not share the split axes is not split (and is not separable); nor one
    # whose probe leaf gets another rule's state than the leaf's (optax.multi_transform or masked
    # picking rules of different states by path run another rule on the probe's leaf); nor one
    # whose state holds an array along other axes than the param's leading ones (sm3's accumulator
    # of the columns; not adafactor's placeholder of one element), which no slice of the param's
    # rows or columns can slice.
    ok = [
      depths[i] == k[2]
      and jax.tree.structure(per_leaf[i]) == k[4]
      and not any(d == 0 and x.size > 1 for d, x in zip(depths[i], jax.tree.leaves(per_leaf[i])))
      for k, i in zip(keys, index)
    ]
    good = dict(zip(index, ok))
    if axis == 0:
      units = [(Piece(i, 0, 1),) if good.get(i) else (Piece(i),) for i in range(len(params))]
      units += [(Piece(i, 1, params[i].shape[0]),) for i in index if good[i]]
      chunks = None
    else:
      units = [(Piece(i),) for i in range(len(params))]
      chunks = tuple(((1, 2) if good.get(i) else (0, 1),) for i in range(len(params)))
    spec = _device_spec(tuple(units), per_leaf, tuple(depths), chunks)
    updates = jax.eval_shape(
      lambda p, g: inner.update(g, inner.init(p), p)[0],
      treedef.unflatten(params),
      treedef.unflatten(grads[0]),
    )
    update_dtypes = [u.dtype for u in treedef.flatten_up_to(updates)]
    return cls(
      keys, axis, treedef, index, layout, params, grads, canonical, spec, ok, update_dtypes
    )

  def run(self, inner, params, grads, canonical):
    """The joint and the split update over the steps (traced, one step a scan iteration), each
    stacked over the steps: (joint updates, split updates, joint state, split state); and the
    fingerprints of the tuple's paths (None at the params' own paths)."""
    tree = self.treedef.unflatten(params)

    def step(states, g):
      state, split_state = states
      joint, state = inner.update(self.treedef.unflatten(g), state, tree)
      shared, per = self.layout.split(split_state)
      # (columns: each chunk's updates, not applied: a bfloat16 step applied to the params may
      # round to nothing, hiding a rule over the leaf at a small learning rate)
      chunked = {i: True for i in range(len(params))} if self.axis == 1 else None
      split, new_shared, new_per, _ = stream.run(
        inner, self.layout, self.spec, list(g), shared, per, list(params), {}, chunk_updates=chunked
      )
      split_state = self.layout.merge(new_shared, new_per)
      joint = self.treedef.flatten_up_to(joint)
      return (state, split_state), (joint, split, state, split_state)

    state = inner.init(tree)
    stacked = jax.tree.map(lambda *g: jnp.stack(g), *grads)
    out = _scan(step, (state, state), stacked)
    return out, None if canonical is None else _steps(inner, self.treedef, *canonical)

  def nan_step(self) -> list[np.ndarray]:
    """A step after the probe's, its gradients the last step's but for each probed leaf's first
    element (in the first part), which is not finite."""
    step = [np.array(g) for g in self.grads[-1]]
    for i in self.index:
      step[i][(0,) * step[i].ndim] = np.nan
    return step

  def check(self, out) -> dict:
    """Each item's (verdict, fingerprint) from `run`'s results (the probe's steps, then
    `nan_step`'s)."""
    out, prints = out
    nan = jax.tree.map(lambda x: x[len(self.grads)], out)
    out = [jax.tree.map(lambda x, t=t: x[t], out) for t in range(len(self.grads))]  # (by step)
    other = (slice(None),) * self.axis + (slice(-1, None),)  # (in the part without the NaN)
    result = {}
    for n, (key, i) in enumerate(zip(self.keys, self.index)):
      dtype = key[0]
      params = np.asarray(self.params[i], np.float64)
      # Updates computed wider than low-precision params (master weights) may round either way:
      # 2 eps of the params is noise, not a dependence on the other part. Updates of the params'
      # own dtype get no such room (lamb's trust ratio on bfloat16 params moves an update by less
      # than a bfloat16 ulp of the params, far more than its own).
      wider = jnp.finfo(self.update_dtypes[i]).bits > jnp.finfo(dtype).bits
      ulp = 2 * float(jnp.finfo(dtype).eps) * np.abs(params) if wider else 0.0  # (each element's)
      item = key if self.canonical is not None else (key, i)
      try:
        if not self.ok[n]:
          raise _NotSeparable("the state is not the key's, or does not share the split axes")
        if not _moved([o[0][i] for o in out], out[-1][2], self.treedef, self.params, i):
          result[item] = (None, None if prints is None else prints[i])  # (nothing seen)
          continue
        for joint, split, state, split_state in out:
          _compare("x", dtype, joint[i], split[i], atol=ulp)
          (shared, per), (split_shared, split_per) = (
            self.layout.split(state),
            self.layout.split(split_state),
          )
          for a, b in zip(
            jax.tree.leaves((shared, per[i])), jax.tree.leaves((split_shared, split_per[i]))
          ):
            # (each state array at its own precision: a float32 master copy at float32's)
            own = np.asarray(a).dtype
            _compare("x", own if jnp.issubdtype(own, jnp.floating) else dtype, a, b)
          _compare_master(state, split_state, self.treedef, params, i)
        # A gradient that is not finite in one part may not change the other part's update
        # (optax.apply_if_finite skips the whole leaf's then).
        atol = ulp[other] if wider else 0.0
        _compare("x", dtype, np.asarray(nan[0][i])[other], np.asarray(nan[1][i])[other], atol)
        result[item] = (True, None if prints is None else prints[i])
      except _NotSeparable:
        result[item] = (False, None if prints is None else prints[i])
    return result


def _probe_program(inner, items: Sequence, at: At | None = None, steps: int = _FEW_STEPS) -> dict:
  """`_probe_steps`'s items in one program (see there)."""
  axis_of = (lambda item: item[3]) if at is None else (lambda item: item[0][3])
  probes = [
    _Probe.make(inner, [i for i in items if axis_of(i) == axis], axis, at, steps)
    for axis in (0, 1)
    if any(axis_of(i) == axis for i in items)
  ]
  args = [(p.params, [*p.grads, p.nan_step()], p.canonical) for p in probes]
  outs = _run(lambda args: [p.run(inner, *a) for p, a in zip(probes, args)], args)
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
  asked = (layout.params_treedef, tuple((jnp.dtype(a.dtype), _miniature(a.shape)) for a in avals))
  if asked in learned.separable:  # (only passes are kept, and only by `closure_key`)
    return
  rng = np.random.default_rng(0)
  groups = (tuple(range(0, n, 2)), tuple(range(1, n, 2)))
  params = [(rng.normal(size=_miniature(a.shape)) + 0.5).astype(a.dtype) for a in avals]
  treedef = layout.params_treedef

  def joint_and_grouped(params, grads):
    params_tree = treedef.unflatten(params)

    def step(states, g):
      joint_state, split_state = states
      joint, joint_state = inner.update(treedef.unflatten(g), joint_state, params_tree)
      split, split_state = run_grouped(inner, layout, groups, g, split_state, params)
      return (joint_state, split_state), (treedef.flatten_up_to(joint), split, joint_state)

    state = inner.init(params_tree)
    return _scan(step, (state, state), grads)

  nan_leaf = next((i for i, p in enumerate(params) if p.size), None)  # (not one of zero size)
  for steps in (_STEPS, _LONGEST_CHECK):  # (the longer only where no update moved in fewer)
    # (each leaf's gradients at every step, stacked; one more step, whose gradient of `nan_leaf`
    # is not finite, which may change no other leaf's update: optax.apply_if_finite skips every
    # leaf's update then)
    grads = [
      np.stack(
        [rng.normal(size=p.shape) * (1e-2 if i % 2 else _scale(t)) for t in range(steps + 1)]
      ).astype(p.dtype)
      for i, p in enumerate(params)
    ]
    if nan_leaf is not None:
      grads[nan_leaf][(-1,) + (0,) * (grads[nan_leaf].ndim - 1)] = np.nan
    try:
      out = _run(joint_and_grouped, params, grads)
    except Exception as e:  # the probe is a best effort; the real update reports real errors
      logger.warning(
        "offload: could not check that the inner transformation is separable (%s: %s); "
        "continuing without the check.",
        type(e).__name__,
        e,
      )
      return
    joint, split, states = out
    before_nan = jax.tree.map(lambda x: x[-2], states)
    if any(_moved([joint[i][:steps]], before_nan, treedef, params, i) for i in range(n)):
      break
  else:
    logger.warning(
      "offload: the inner transformation's updates did not move in the %d steps of the check that "
      "it is separable (optax.MultiSteps of more micro-steps inside offload, or a learning rate "
      "of 0 at first?), so it is not checked, and no leaf is split in slices. Put "
      "optax.MultiSteps around offload: optax.MultiSteps(oo.offload(...), k), which "
      "oo.update_and_apply recognises.",
      _LONGEST_CHECK,
    )
    return
  for t in range(steps):
    for i in range(n):
      _compare(paths[i], avals[i].dtype, joint[i][t], split[i][t])
  for i in range(n if nan_leaf is not None else 0):
    try:
      if i != nan_leaf:
        _compare(paths[i], avals[i].dtype, joint[i][-1], split[i][-1])
    except _NotSeparable:
      raise _NotSeparable(
        "offload: the inner transformation is not separable: a gradient of leaf "
        f"{paths[nan_leaf]} that is not finite changes the update of leaf {paths[i]} (as "
        "optax.apply_if_finite, which skips every leaf's update then, or a global norm do), and "
        "offload updates the leaves group by group. Put such a transformation around offload: "
        "optax.apply_if_finite(oo.offload(optax.adamw(1e-3)), max_consecutive_errors), "
        "optax.chain(optax.clip_by_global_norm(1.0), oo.offload(...)). If you are sure it is "
        "separable, pass check_separable=False."
      ) from None
  if alike:  # (by identity a pass may not hold: what the code reads may have changed)
    learned.separable.add(asked)


class _NotSeparable(ValueError):
  pass


def _compare_master(state, split_state, treedef, params: np.ndarray, i: int) -> None:
  """Leaf i's master copies (`with_master_weights`), if any, compared by how far they moved from
  the params: at a small learning rate a master moves by far less than the relative tolerance of
  its value, and a rule over the whole leaf (lamb's trust ratio) shows only in its moves. Over
  the leaf (the norm of the difference within 1e-3 of the moves' and 4 ulps an element): an 8-bit
  moment's code that rounds the other way moves a few elements by a few percent, such a rule
  moves them all."""
  if not isinstance(state, master.MasterState):
    return
  a, b = (treedef.flatten_up_to(s.master)[i] for s in (state, split_state))
  if a is None:
    return
  moves = np.asarray(a, np.float64) - params
  other = np.asarray(b, np.float64) - params
  finite = np.isfinite(moves)
  if not (  # (a norm would hide them)
    np.array_equal(finite, np.isfinite(other))
    and np.array_equal(moves[~finite], other[~finite], equal_nan=True)
  ):
    raise _NotSeparable("the master copies are not finite alike")
  moves, other = (np.where(finite, x, 0.0) for x in (moves, other))
  value = np.nan_to_num(np.asarray(a, np.float64), nan=0.0, posinf=0.0, neginf=0.0)
  ulps = 4 * float(jnp.finfo(np.asarray(a).dtype).eps) * np.abs(value)
  if np.linalg.norm(moves - other) > 1e-3 * np.linalg.norm(moves) + np.linalg.norm(ulps):
    raise _NotSeparable("the master copies moved apart")


def _compare(path: str, dtype, joint: jax.Array, split: jax.Array, atol: float = 0.0) -> None:
  a = np.asarray(joint, np.float64)
  b = np.asarray(split, np.float64)
  scale = np.max(np.abs(a[np.isfinite(a)]), initial=0.0)
  with np.errstate(invalid="ignore"):
    diff = np.abs(a - b)
  # (an update that is not finite in one group or several alike: the inner's own, e.g. fp16's
  # adam with its default eps)
  bad = ~(diff <= _tolerance(dtype) * np.abs(a) + 1e-6 * scale + atol) & ~(
    (np.isnan(a) & np.isnan(b)) | (a == b)
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
