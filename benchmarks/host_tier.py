"""Step time of `offload(adamw)` (host tier) against plain optax AdamW, in one process.

On the CPU backend the in-jit transfers compile to nothing, so the ratio measures what the grouping
itself costs (barriers, split and merge of the state). On a GPU the same script measures the real
transfers. Runs are interleaved (plain, offloaded, plain, ...) so drift hits both alike.

    python benchmarks/host_tier.py --params 50e6 --leaves 16 --reps 15 --out bench_out/host_tier.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import optax

import optax_offload as oo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=50e6, help="total parameters")
  parser.add_argument("--leaves", type=int, default=16)
  parser.add_argument("--reps", type=int, default=15, help="timed steps per variant")
  parser.add_argument(
    "--groups",
    type=int,
    default=8,
    help="window sized for this many groups of whole leaves (the plan's count is reported)",
  )
  parser.add_argument("--out", default="bench_out/host_tier.json")
  args = parser.parse_args(argv)

  params = _common.make_tree(args.params, args.leaves)
  grads = _common.fixed_grads(params)
  n = _common.num_params(params)
  state_bytes = 2 * 4 * n
  # A group holds window / 2.25, whole leaves grouped up to a quarter of that (`plan`): a window of
  # 9 x state / groups (a little more, for rounding) makes `groups` groups of whole leaves where
  # the leaves divide evenly, and 9 x the state one group.
  window = int(9 * state_bytes / args.groups) + 64
  one_group = 9 * state_bytes + 64
  planned = {
    name: len(oo.estimate(params, optimizer=optax.adamw(1e-3), window_bytes=w).plan.groups)
    for name, w in (("offload", window), ("offload_one_group", one_group))
  }
  variants = {
    "plain": optax.adamw(1e-3),
    "offload": oo.offload(optax.adamw(1e-3), window_bytes=window),
    "offload_one_group": oo.offload(optax.adamw(1e-3), window_bytes=one_group),
  }
  runs = _common.time_variants(variants, params, grads, args.reps)
  medians = {name: run.median() for name, run in runs.items()}
  result = {
    "benchmark": "host_tier",
    "backend": jax.default_backend(),
    "device": str(jax.devices()[0].device_kind),
    "machine": platform.machine(),
    "params": n,
    "leaves": args.leaves,
    "groups": planned["offload"],
    "groups_asked": args.groups,
    "groups_one_group": planned["offload_one_group"],
    "window_bytes": window,
    "reps": args.reps,
    "median_s": medians,
    "ratio_offload_vs_plain": medians["offload"] / medians["plain"],
    "ratio_one_group_vs_plain": medians["offload_one_group"] / medians["plain"],
    "footprint_offload": oo.footprint(runs["offload"].state),
  }
  for name, m in medians.items():
    print(f"{name:>18}: median {m * 1e3:8.2f} ms")
  print(
    f"offload / plain          = {result['ratio_offload_vs_plain']:.3f}  "
    f"({planned['offload']} groups)"
  )
  print(
    f"offload(1 group) / plain = {result['ratio_one_group_vs_plain']:.3f}  "
    f"({planned['offload_one_group']} group)"
  )
  return _common.write_json(result, args.out)


if __name__ == "__main__":
  main()
