"""Step time of `offload(adamw)` (host tier) against plain optax AdamW, in one process.

On the CPU backend the in-jit transfers compile to nothing, so the ratio measures what the grouping
itself costs (barriers, split and merge of the state). On a GPU the same script measures the real
transfers. Runs are interleaved (plain, offloaded, plain, ...) so drift hits both alike.

    python benchmarks/host_tier.py --params 50e6 --leaves 16 --reps 15 --out bench_out/host_tier.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import optax_offload as oo


def make_tree(total: float, leaves: int, dtype=jnp.float32) -> dict:
  cols = 2048
  rows = max(int(total / leaves / cols), 1)
  keys = jax.random.split(jax.random.key(0), leaves)
  return {
    f"layer_{i:02d}": jax.random.normal(k, (rows, cols), dtype) * 0.02 for i, k in enumerate(keys)
  }


def make_step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=50e6, help="total parameters")
  parser.add_argument("--leaves", type=int, default=16)
  parser.add_argument("--reps", type=int, default=15, help="timed steps per variant")
  parser.add_argument("--groups", type=int, default=8, help="window sized for this many groups")
  parser.add_argument("--out", default="bench_out/host_tier.json")
  args = parser.parse_args(argv)

  params = make_tree(args.params, args.leaves)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n = sum(p.size for p in jax.tree.leaves(params))
  state_bytes = 2 * 4 * n
  window = 2 * state_bytes // args.groups  # each group holds window/2
  variants = {
    "plain": optax.adamw(1e-3),
    "offload": oo.offload(optax.adamw(1e-3), window_bytes=window),
    "offload_one_group": oo.offload(optax.adamw(1e-3), window_bytes=4 * state_bytes),
  }
  runs = {}
  for name, tx in variants.items():
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    step = make_step(tx)
    p, s = step(p, s, grads)  # compile and warm up
    jax.block_until_ready((p, s))
    runs[name] = [step, p, s, []]
  for _ in range(args.reps):
    for run in runs.values():
      step, p, s, times = run
      t0 = time.perf_counter()
      p, s = step(p, s, grads)
      jax.block_until_ready((p, s))
      times.append(time.perf_counter() - t0)
      run[1], run[2] = p, s
  medians = {name: statistics.median(run[3]) for name, run in runs.items()}
  result = {
    "benchmark": "host_tier",
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "machine": platform.machine(),
    "params": n,
    "leaves": args.leaves,
    "groups": args.groups,
    "window_bytes": window,
    "reps": args.reps,
    "median_s": medians,
    "ratio_offload_vs_plain": medians["offload"] / medians["plain"],
    "ratio_one_group_vs_plain": medians["offload_one_group"] / medians["plain"],
    "footprint_offload": oo.footprint(runs["offload"][2]),
  }
  for name, m in medians.items():
    print(f"{name:>18}: median {m * 1e3:8.2f} ms")
  print(
    f"offload / plain          = {result['ratio_offload_vs_plain']:.3f}  ({args.groups} groups)"
  )
  print(f"offload(1 group) / plain = {result['ratio_one_group_vs_plain']:.3f}")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
