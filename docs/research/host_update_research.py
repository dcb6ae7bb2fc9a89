"""Research: the fastest bit-exact optax AdamW update on XLA:CPU (the ``update_on="host"`` path).

Question: on XLA:CPU (jax 0.10.2), how fast can ``optax.adamw(1e-3)`` (``tx.update`` + ``optax.apply_updates``)
run on a ~48M-parameter fp32 pytree (16 leaves x 3M) while staying BIT-IDENTICAL to plain ``jax.jit`` of optax
(or to one jitted optax update per leaf, the library's grouped update)? Target was <= 0.6x of plain.

Run (from the repository root):
  .venv/bin/python docs/research/host_update_research.py             # in-process variants, ~1.5 min quiet
  .venv/bin/python docs/research/host_update_research.py --native    # + one-pass C reference kernel (needs gcc)
  .venv/bin/python docs/research/host_update_research.py --flags     # XLA_FLAGS sweep, a subprocess per flag set
  options: --leaves 16 --size 3000000 --reps 9 --chunks 16384,65536 --only plain,chunk16384

All variants donate params and state and are timed interleaved (shuffled order every round, first round is
warm-up). Reported: median and min wall time, the median over rounds of the PAIRED ratio to plain (same round),
min/min, cpu/wall (process CPU time over wall: ~2 = both cores busy) and bit-identity of new params, mu, nu and
count after 3 steps against (a) plain jit over all leaves and (b) one jitted update per leaf. The machine is
shared: look at the paired ratios and at cpu/wall of plain (below ~1.9 means other work held a core).

Findings and the recommendation: docs/research/host_update_notes.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# generic helpers: split an optax state into per-leaf sub-states (placeholder trick of tree_map_params)
# ----------------------------------------------------------------------------------------------------------


def _param_mask(tx, state):
  from optax.tree_utils import tree_map_params

  return tree_map_params(tx, lambda _: True, state, transform_non_params=lambda _: False)


_SUB_TD = {}  # (tx, shapes, treedef) -> treedef of tx.init(sub_params); cached: eval_shape costs ~ms


def sub_state(tx, state, n_params: int, idx: list[int], sub_params, copy_nonparam=False):
  """The inner state for the params subset ``idx`` (non-param leaves such as ``count`` are shared;
  ``copy_nonparam`` gives each group its own copy, needed when every group's call donates its state)."""
  import jax
  import jax.numpy as jnp

  mask = jax.tree.leaves(_param_mask(tx, state))
  leaves = jax.tree.leaves(state)
  key = (
    id(tx),
    tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(sub_params)),
    jax.tree.structure(sub_params),
  )
  if key not in _SUB_TD:
    _SUB_TD[key] = jax.tree.structure(jax.eval_shape(tx.init, sub_params))
  sub_td = _SUB_TD[key]
  want = set(idx)
  picked, j = [], 0
  for m, x in zip(mask, leaves):
    if m:
      if j % n_params in want:
        picked.append(x)
      j += 1
    else:
      picked.append(jnp.copy(x) if copy_nonparam else x)
  return jax.tree.unflatten(sub_td, picked)


def merge_states(tx, state, n_params: int, groups: list[list[int]], sub_states):
  """Inverse of sub_state: scatter per-group new states back; non-param leaves from the first group."""
  import jax

  mask = jax.tree.leaves(_param_mask(tx, state))
  td = jax.tree.structure(state)
  subs = [(jax.tree.leaves(_param_mask(tx, s)), jax.tree.leaves(s)) for s in sub_states]
  owner = {}
  for gi, g in enumerate(groups):
    for pos, k in enumerate(g):
      owner[k] = (gi, pos, len(g))
  # per sub-state: param leaves in order, grouped by sub-subtree
  sub_param = [[x for m, x in zip(sm, sl) if m] for sm, sl in subs]
  sub_nonparam = [x for m, x in zip(*subs[0]) if not m]
  out, j, nj = [], 0, 0
  for m in mask:
    if m:
      k, tree_i = j % n_params, j // n_params
      gi, pos, glen = owner[k]
      out.append(sub_param[gi][tree_i * glen + pos])
      j += 1
    else:
      out.append(sub_nonparam[nj])
      nj += 1
  return jax.tree.unflatten(td, out)


# ----------------------------------------------------------------------------------------------------------
# the in-place chunked update (the candidate fast route)
# ----------------------------------------------------------------------------------------------------------


def chunked_update(tx, chunk: int, mode: str = "twocall"):
  """(params, state, grads) -> (new_params, new_state), chunk by chunk, in place, per-element math unchanged.

  For ELEMENTWISE separable transformations (adam/adamw/lion/sgd/rmsprop...; not adafactor, whose update
  mixes the elements of a leaf). ``params``/``grads`` are lists of arrays and ``state`` is tx's state for
  that list. Each leaf is viewed as 1-D and walked by its own ``fori_loop`` over ``chunk``-element slices
  (plus one static tail), calling ``tx.update`` on the slices and writing the results back with
  ``dynamic_update_slice`` into the donated buffers (no copies: check ``compiled.as_text().count(' copy(')``).

  The XLA:CPU detail that makes or breaks this: the fused new-param kernel recomputes mu/nu from the OLD
  mu/nu chunks, so unless the mu/nu writes are ordered after it, copy insertion copies the WHOLE mu and nu
  buffers on every iteration (seconds per step). ``lax.optimization_barrier`` does not order anything here
  (XLA:CPU removes it before fusion). Two ways that work:

  * ``mode="select"``: ``mu_buf = dus(mu_buf, where(ok, mu_new, mu_old), off)`` with the always-true,
    unfoldable predicate ``ok = (bitcast_u32(p_buf_new[off]) | 1) != 0``; XLA then materialises mu_new/nu_new
    chunks once (5 kernels per chunk).
  * ``mode="twocall"`` (default, faster): after writing the new params, call ``tx.update`` a second time on
    the same chunk read at ``off2 = where(ok, off, 0)`` (always == off, but XLA cannot know) and write only the
    new state from it; XLA drops the unused halves of both calls, so each chunk costs 3 kernels: new params
    (reads p, mu, nu, g), new mu (re-reads mu, g from cache), new nu. The old param chunk is passed to the
    second call, so it is right even for a state that depends on params.

  Bits: equal to one jitted optax update PER LEAF (each loop body updates one leaf), not to one jit over a
  multi-leaf tree: XLA:CPU writes the bias correction as ``x * (1 / (1 - b**t))`` (scalar reciprocal) for a
  one-leaf update and as ``x / (1 - b**t)`` per element for several leaves (see host_update_notes.md).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax import lax

  def step(params, state, grads):
    L = len(params)
    mask = jax.tree.leaves(_param_mask(tx, state))
    flat = [p.reshape(-1) for p in params]
    gflat = [g.reshape(-1) for g in grads]
    sleaves = jax.tree.leaves(state)
    td = jax.tree.structure(state)
    sflat = [x.reshape(-1) if m else x for m, x in zip(mask, sleaves)]
    nonparam_in = [x for m, x in zip(mask, sflat) if not m]
    out_p = list(flat)
    out_s = list(sflat)
    new_nonparam = None
    n_sub_trees = sum(mask) // L  # param-shaped subtrees in the state (adam: mu, nu)

    def upd(k, s_bufs, off, size, pc):
      """optax on `size` elements at `off` of leaf k -> (new param chunk, new state chunks, non-param leaves)."""
      gc = lax.dynamic_slice_in_dim(gflat[k], off, size)
      chunks = [lax.dynamic_slice_in_dim(b, off, size) for b in s_bufs]
      ps, gs = [pc], [gc]
      per_tree = [[c] for c in chunks]
      sub_struct = jax.eval_shape(tx.init, ps)
      sub_mask = jax.tree.leaves(_param_mask(tx, sub_struct))
      it_np = iter(nonparam_in)
      it_p = iter([x for tree in per_tree for x in tree])
      sub = jax.tree.unflatten(
        jax.tree.structure(sub_struct), [next(it_p) if m else next(it_np) for m in sub_mask]
      )
      u, ns = tx.update(gs, sub, ps)
      npc = optax.apply_updates(ps, u)[0]
      nsl = jax.tree.leaves(ns)
      nmask = jax.tree.leaves(_param_mask(tx, ns))
      new_p = [x for m, x in zip(nmask, nsl) if m]
      width = len(ps)
      return (
        npc,
        [new_p[t * width] for t in range(n_sub_trees)],
        [x for m, x in zip(nmask, nsl) if not m],
      )

    for k in range(L):
      n = flat[k].shape[0]
      j, pidx = 0, []
      for i, m in enumerate(mask):
        if m:
          if j % L == k:
            pidx.append(i)
          j += 1

      def one(p_buf, s_bufs, off, size, k=k):
        old_pc = lax.dynamic_slice_in_dim(p_buf, off, size)
        npc, new_state, nonparam = upd(k, s_bufs, off, size, old_pc)
        p_buf = lax.dynamic_update_slice_in_dim(p_buf, npc, off, 0)
        # always true, but depends on the param write: orders the state writes after it
        ok = (
          lax.bitcast_convert_type(lax.dynamic_slice_in_dim(p_buf, off, 1)[0], jnp.uint32)
          | jnp.uint32(1)
        ) != 0
        if mode == "select":
          s_bufs = [
            lax.dynamic_update_slice_in_dim(
              b, jnp.where(ok, y, lax.dynamic_slice_in_dim(b, off, size)), off, 0
            )
            for b, y in zip(s_bufs, new_state)
          ]
        else:
          off2 = jnp.where(ok, off, 0).astype(jnp.asarray(off).dtype)
          _, new_state2, _ = upd(k, s_bufs, off2, size, old_pc)
          s_bufs = [
            lax.dynamic_update_slice_in_dim(b, y, off2, 0) for b, y in zip(s_bufs, new_state2)
          ]
        return p_buf, s_bufs, nonparam

      s_bufs = [sflat[i] for i in pidx]
      p_buf = flat[k]
      K = n // chunk
      if K > 0:

        def body(c, carry, one=one):
          pb, sb = carry
          pb, sb, _ = one(pb, sb, c * chunk, chunk)
          return pb, sb

        p_buf, s_bufs = lax.fori_loop(0, K, body, (p_buf, s_bufs))
      if n - K * chunk:
        p_buf, s_bufs, _ = one(p_buf, s_bufs, K * chunk, n - K * chunk)
      if new_nonparam is None:  # count etc.: the same scalar math as any chunk
        _, _, new_nonparam = upd(k, [sflat[i][:1] for i in pidx], 0, 1, flat[k][:1])
      out_p[k] = p_buf.reshape(params[k].shape)
      for i, b in zip(pidx, s_bufs):
        out_s[i] = b.reshape(sleaves[i].shape)
    it = iter(new_nonparam)
    out_s = [x if m else next(it) for m, x in zip(mask, out_s)]
    return out_p, jax.tree.unflatten(td, out_s)

  return step


# ----------------------------------------------------------------------------------------------------------
# optional native reference (not a candidate for the library: it needs a C compiler; calibration only)
# ----------------------------------------------------------------------------------------------------------

_NATIVE_SRC = r"""
#include <math.h>
#include <stdint.h>
/* One pass, in place, OpenMP. Written to reproduce the bits of XLA:CPU's code for optax.adamw over a
   multi-leaf tree (jax 0.10.2): XLA's LLVM backend contracts mul+add into FMAs, and only this placement of
   fmaf matches (found by trying all 16 placements against XLA, 3 steps, every leaf). */
void adamw(int64_t n, float* p, float* mu, float* nu, const float* g, float b1, float omb1, float b2,
           float omb2, float bc1, float bc2, float eps, float wd, float nlr) {
  #pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i];
    float m = fmaf(gi, omb1, mu[i] * b1);
    float v = fmaf(gi * gi, omb2, nu[i] * b2);
    mu[i] = m; nu[i] = v;
    float d = bc1 * (sqrtf(v / bc2) + eps);
    float u = fmaf(p[i], wd, m / d);
    p[i] = fmaf(u, nlr, p[i]);
  }
}
"""


def native_runner(L):
  """Compile the C kernel into a temp dir; returns step(p_np, mu_np, nu_np, g_np, t) or None."""
  import ctypes
  import shutil
  import tempfile

  if not shutil.which("gcc"):
    return None
  d = tempfile.mkdtemp(prefix="oo_native_")
  src, so = os.path.join(d, "adamw.c"), os.path.join(d, "adamw.so")
  open(src, "w").write(_NATIVE_SRC)
  r = subprocess.run(
    [
      "gcc",
      "-O3",
      "-march=native",
      "-ffp-contract=off",
      "-fno-math-errno",
      "-fopenmp",
      "-shared",
      "-fPIC",
      src,
      "-o",
      so,
    ],
    capture_output=True,
  )
  if r.returncode:
    return None
  lib = ctypes.CDLL(so)
  fp = ctypes.POINTER(ctypes.c_float)
  lib.adamw.argtypes = [ctypes.c_int64, fp, fp, fp, fp] + [ctypes.c_float] * 9

  import jax
  import jax.numpy as jnp

  # b**t exactly as XLA computes it inside the optax program (f32 pow of the incremented count)
  powj = jax.jit(
    lambda c: (
      jnp.float32(0.9) ** c.astype(jnp.float32),
      jnp.float32(0.999) ** c.astype(jnp.float32),
    )
  )

  def step(p, mu, nu, g, t):
    b1t, b2t = (np.float32(x) for x in powj(jnp.int32(t)))
    bc1, bc2 = float(np.float32(1) - b1t), float(np.float32(1) - b2t)

    def ptr(a):
      return a.ctypes.data_as(fp)

    for k in range(L):
      lib.adamw(
        p[k].size,
        ptr(p[k]),
        ptr(mu[k]),
        ptr(nu[k]),
        ptr(g[k]),
        0.9,
        float(np.float32(1 - 0.9)),
        0.999,
        float(np.float32(1 - 0.999)),
        bc1,
        bc2,
        1e-8,
        1e-4,
        -1e-3,
      )

  return step


# ----------------------------------------------------------------------------------------------------------
# benchmark driver
# ----------------------------------------------------------------------------------------------------------


def build(args):
  import jax
  import jax.numpy as jnp
  import optax

  L, n = args.leaves, args.size
  key = jax.random.PRNGKey(0)
  P0 = [jax.random.normal(jax.random.fold_in(key, i), (n,), jnp.float32) for i in range(L)]
  G = [
    jax.random.normal(jax.random.fold_in(key, 1000 + i), (n,), jnp.float32) * 0.01 for i in range(L)
  ]
  tx = optax.adamw(1e-3)
  S0 = tx.init(P0)

  def plain(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def updates_only(p, s, g):
    return tx.update(g, s, p)

  jplain = jax.jit(plain, donate_argnums=(0, 1))
  jupd = jax.jit(updates_only, donate_argnums=(1,))
  jone = jax.jit(plain, donate_argnums=(0, 1))  # reused for every single-leaf group (same shapes)

  def grouped_runner(groups, fn, threads=0):
    """Run fn on each group of leaves (sub-state per group); optionally from a thread pool."""
    pool = cf.ThreadPoolExecutor(threads) if threads else None

    def run(p, s, g):
      subs = [
        (
          [p[k] for k in grp],
          sub_state(tx, s, L, grp, [p[k] for k in grp], True),
          [g[k] for k in grp],
        )
        for grp in groups
      ]
      outs = list(pool.map(lambda a: fn(*a), subs)) if pool else [fn(*a) for a in subs]
      newp = list(p)
      for grp, (gp, _) in zip(groups, outs):
        for k, x in zip(grp, gp):
          newp[k] = x
      return newp, merge_states(tx, s, L, groups, [o[1] for o in outs])

    return run

  per_leaf = [[k] for k in range(L)]
  halves = [list(range(0, L, 2)), list(range(1, L, 2))]
  variants = {
    "plain": ("plain jit(update+apply_updates), params+state donated", jplain),
    "updates_only": (
      "plain jit(update) only, state donated, no apply (fresh output buffers)",
      None,
    ),
    "grouped1": (
      "one jit call per leaf, sequential (the library's grouped reference)",
      grouped_runner(per_leaf, jone),
    ),
    "threads2_halves": (
      "2 Python threads, each a plain jit over 8 leaves",
      grouped_runner(halves, jax.jit(plain, donate_argnums=(0, 1)), threads=2),
    ),
    "threads2_grouped1": (
      "2 Python threads, one jit call per leaf",
      grouped_runner(per_leaf, jone, threads=2),
    ),
  }
  for c in args.chunks:
    variants[f"chunk{c}"] = (
      f"one jit; per leaf an in-place fori_loop over {c}-element chunks (twocall)",
      jax.jit(chunked_update(tx, c), donate_argnums=(0, 1)),
    )
    if c == args.chunks[0]:
      variants[f"chunk{c}_select"] = (
        f"as chunk{c}, state written through an always-true select",
        jax.jit(chunked_update(tx, c, "select"), donate_argnums=(0, 1)),
      )
    variants[f"chunk{c}_thr2"] = (
      f"chunk{c} on 8 leaves per jit, 2 Python threads",
      grouped_runner(halves, jax.jit(chunked_update(tx, c), donate_argnums=(0, 1)), threads=2),
    )
  if args.only:
    keep = set(args.only.split(","))
    variants = {k: v for k, v in variants.items() if k in keep or k == "plain"}
  return tx, P0, S0, G, variants, jupd, grouped_runner(per_leaf, jone)


def bits(tree):
  import jax

  return [np.asarray(x).ravel().view(np.uint32).copy() for x in jax.tree.leaves(tree)]


def main_inprocess(args):
  import random

  import jax
  import jax.numpy as jnp

  tx, P0, S0, G, variants, jupd, grouped_ref = build(args)
  L = args.leaves
  native = native_runner(L) if args.native else None

  def run3(fn):
    p, s = jax.tree.map(jnp.copy, (P0, S0))
    for _ in range(3):
      p, s = fn(p, s, G)
    jax.block_until_ready((p, s))
    return p, s

  ref_plain = bits(run3(variants["plain"][1]))
  ref_group = bits(run3(grouped_ref))

  def same(b, ref):
    return all(np.array_equal(x, y) for x, y in zip(b, ref))

  results, states = {}, {}
  for name, (desc, fn) in variants.items():
    if name == "updates_only":
      s = jax.tree.map(jnp.copy, S0)
      for _ in range(2):
        _, s = jupd(P0, s, G)
      states[name] = (None, s)
      results[name] = dict(desc=desc, exact_plain="n/a", exact_grouped="n/a", t=[], r=[])
      continue
    t0 = time.perf_counter()
    b = bits(run3(fn))
    first = time.perf_counter() - t0
    results[name] = dict(
      desc=desc, exact_plain=same(b, ref_plain), exact_grouped=same(b, ref_group), t=[], r=[]
    )
    states[name] = jax.tree.map(jnp.copy, (P0, S0))
    print(
      f"  checked {name:20s} exact: vs plain={results[name]['exact_plain']!s:5s} "
      f"vs grouped={results[name]['exact_grouped']!s:5s} (3 steps incl. compile {first:.1f}s)",
      flush=True,
    )
  if native is not None:
    nat = (
      [np.array(x) for x in P0],
      [np.zeros(x.shape, np.float32) for x in P0],
      [np.zeros(x.shape, np.float32) for x in P0],
      [np.array(x) for x in G],
    )
    for t in (1, 2, 3):
      native(*nat, t)
    b = [x.view(np.uint32).ravel() for x in nat[0]] + [
      np.zeros(1, np.uint32)
    ]  # count: not produced
    ok = all(
      np.array_equal(x.view(np.uint32).ravel(), y)
      for x, y in zip(nat[0] + nat[1] + nat[2], ref_plain[:L] + ref_plain[L + 1 :])
    )
    results["native_c_ref"] = dict(
      desc="reference only: one-pass OpenMP C kernel (FMA placement matched to XLA)",
      exact_plain=ok,
      exact_grouped="-",
      t=[],
      r=[],
    )
    states["native_c_ref"] = nat
    print(f"  checked native_c_ref         exact: vs plain={ok}", flush=True)

  names = list(results)
  step_t = 3
  for rnd in range(args.reps):
    order = names[:]
    random.Random(rnd).shuffle(order)  # interleaved, in a different order every round
    round_t = {}
    step_t += 1
    for name in order:
      t0, c0 = time.perf_counter(), time.process_time()
      if name == "updates_only":
        u, s = jupd(P0, states[name][1], G)
        jax.block_until_ready((u, s))
        states[name] = (None, s)
      elif name == "native_c_ref":
        native(*states[name], step_t)
      else:
        p, s = variants[name][1](*states[name], G)
        jax.block_until_ready((p, s))
        states[name] = (p, s)
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      round_t[name] = wall
      if rnd > 0:  # first round: warm-up
        results[name]["t"].append((wall, cpu))
    if rnd > 0:
      for name in names:
        results[name]["r"].append(round_t[name] / round_t["plain"])

  base = statistics.median(w for w, _ in results["plain"]["t"])
  base_min = min(w for w, _ in results["plain"]["t"])
  print()
  print(
    f"{L} leaves x {args.size} fp32 = {L * args.size / 1e6:.0f}M params; {args.reps - 1} timed rounds, "
    f"interleaved in shuffled order; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
    f"loadavg at end {os.getloadavg()[0]:.1f}"
  )
  print(
    "ratio = median over rounds of (variant time / plain time in the same round); min-ratio = min/min"
  )
  hdr = (
    f"{'variant':20s} {'median ms':>9s} {'min ms':>7s} {'ratio':>6s} {'min-ratio':>9s} {'cpu/wall':>8s}"
    f"  {'exact vs plain':14s} exact vs grouped"
  )
  print(hdr)
  print("-" * len(hdr))
  for name, r in results.items():
    ws = [w for w, _ in r["t"]]
    cw = statistics.median(c / w for w, c in r["t"])
    print(
      f"{name:20s} {statistics.median(ws) * 1e3:9.1f} {min(ws) * 1e3:7.1f} {statistics.median(r['r']):6.2f} "
      f"{min(ws) / base_min:9.2f} {cw:8.2f}  {str(r['exact_plain']):14s} {r['exact_grouped']}"
    )
  print()
  for name, r in results.items():
    print(f"  {name}: {r['desc']}")
  del base


FLAG_SETS = [
  "",
  "--xla_cpu_enable_fast_math=true",
  "--xla_cpu_use_thunk_runtime=false",
  "--xla_cpu_use_fusion_emitters=false",
  "--xla_cpu_prefer_vector_width=512",
  "--xla_cpu_use_xnnpack=true",
  "--xla_cpu_enable_concurrency_optimized_scheduler=true",
]


def main_child(args):
  """One flag setting: time plain optax adamw and print a digest of the result bits after 3 steps."""
  import hashlib

  import jax
  import jax.numpy as jnp

  tx, P0, S0, G, variants, _, _ = build(
    argparse.Namespace(**{**vars(args), "chunks": [], "only": "plain"})
  )
  jplain = variants["plain"][1]
  txt = jplain.lower(P0, S0, G).compile().as_text()
  p, s = jax.tree.map(jnp.copy, (P0, S0))
  for _ in range(3):
    p, s = jplain(p, s, G)
  h = hashlib.sha256(b"".join(x.tobytes() for x in bits((p, s)))).hexdigest()[:12]
  ts = []
  for _ in range(args.reps):
    t0, c0 = time.perf_counter(), time.process_time()
    p, s = jplain(p, s, G)
    jax.block_until_ready((p, s))
    ts.append((time.perf_counter() - t0, time.process_time() - c0))
  ts = ts[1:]
  print(
    "RESULT",
    statistics.median(w for w, _ in ts),
    min(w for w, _ in ts),
    statistics.median(c / w for w, c in ts),
    h,
    txt.count(" fusion("),
  )


def main_flags(args):
  """Each flag set in its own subprocess; rounds interleave the flag sets; ratio vs the no-flag runs."""
  rounds = 2
  rows = {f: [] for f in FLAG_SETS}
  info = {}
  for _ in range(rounds):
    for f in FLAG_SETS:
      env = dict(os.environ, XLA_FLAGS=f)
      cmd = [
        sys.executable,
        __file__,
        "--child",
        "--leaves",
        str(args.leaves),
        "--size",
        str(args.flags_size),
        "--reps",
        "5",
      ]
      try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
      except subprocess.TimeoutExpired:
        info[f] = "timeout"
        continue
      line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
      if not line:
        info[f] = "failed: " + ((out.stderr.strip().splitlines() or ["?"])[-1])[:90]
        continue
      _, med, mn, cw, h, nf = line[0].split()
      rows[f].append((float(med), float(mn), float(cw)))
      info[f] = (h, int(nf))
  base = statistics.median(m for m, _, _ in rows[""])
  base_min = min(m for _, m, _ in rows[""])
  base_h = info[""][0]
  print(
    f"XLA_FLAGS sweep, plain optax adamw, {args.leaves}x{args.flags_size}; {rounds} interleaved subprocess rounds; "
    f"loadavg at end {os.getloadavg()[0]:.1f}"
  )
  print(
    f"{'XLA_FLAGS':55s} {'median ms':>9s} {'ratio':>6s} {'min-ratio':>9s} {'cpu/wall':>8s} {'fusions':>7s} bit-exact"
  )
  for f in FLAG_SETS:
    if not rows[f]:
      print(f"{f or '(none)':55s} {info.get(f)}")
      continue
    med = statistics.median(m for m, _, _ in rows[f])
    mn = min(m for _, m, _ in rows[f])
    cw = statistics.median(c for _, _, c in rows[f])
    h, nf = info[f]
    print(
      f"{f or '(none)':55s} {med * 1e3:9.1f} {med / base:6.2f} {mn / base_min:9.2f} {cw:8.2f} {nf:7d} {h == base_h}"
    )


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--leaves", type=int, default=16)
  ap.add_argument("--size", type=int, default=3_000_000)
  ap.add_argument("--reps", type=int, default=9, help="rounds (the first is warm-up)")
  ap.add_argument(
    "--chunks", type=lambda s: [int(x) for x in s.split(",") if x], default=[16384, 65536]
  )
  ap.add_argument("--only", default="", help="comma-separated variant names (plain always runs)")
  ap.add_argument("--native", action="store_true", help="add the C reference kernel (needs gcc)")
  ap.add_argument("--flags", action="store_true", help="XLA_FLAGS sweep (subprocesses)")
  ap.add_argument(
    "--flags-size",
    type=int,
    default=1_000_000,
    help="leaf size for the flag sweep (keeps it short)",
  )
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    main_child(args)
  elif args.flags:
    main_flags(args)
  else:
    main_inprocess(args)


if __name__ == "__main__":
  main()
