"""The host-side AdamW update (`update_on="host"`) against plain optax AdamW and memory bandwidth.

In one process, on a ~50M-parameter fp32 pytree: the median step time of plain jitted optax AdamW
(update + apply, state donated), of `offload(adamw, update_on="host")`, and a memory-bandwidth
lower bound: AdamW reads params, grads and two moments and writes params and two moments (28 bytes
per fp32 parameter), timed against a large array copy measured in the same run.

    python benchmarks/host_update.py --params 50e6 --reps 10 --out bench_out/host_update.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_offload as oo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

BYTES_PER_PARAM = 28  # read p, g, mu, nu; write p, mu, nu (fp32)


def copy_bandwidth(nbytes: int, reps: int = 5) -> float:
  """Bytes per second of a jitted in-place pass (read + write) over a large fp32 array.

  The buffer is donated so the pass reuses it: no fresh pages to fault in, as in a donated step.
  """
  x = jnp.ones(nbytes // 4, jnp.float32)
  copy = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  x = jax.block_until_ready(copy(x))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    x = jax.block_until_ready(copy(x))
    times.append(time.perf_counter() - t0)
  return 2 * nbytes / statistics.median(times)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=50e6)
  parser.add_argument("--leaves", type=int, default=16)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--out", default="bench_out/host_update.json")
  args = parser.parse_args(argv)

  params = _common.make_tree(args.params, args.leaves)
  grads = _common.fixed_grads(params)
  n = _common.num_params(params)
  variants = {
    "plain_optax": optax.adamw(1e-3),
    "offload_host_update": oo.offload(optax.adamw(1e-3), update_on="host"),
    "offload_device_update": oo.offload(optax.adamw(1e-3)),
  }
  runs = _common.time_variants(variants, params, grads, args.reps)
  bandwidth = copy_bandwidth(min(n * 4, 1 << 30))
  bound = n * BYTES_PER_PARAM / bandwidth
  med = {name: run.median() for name, run in runs.items()}
  result = {
    "benchmark": "host_update",
    "backend": jax.default_backend(),
    "cpu_count": os.cpu_count(),
    "params": n,
    "reps": args.reps,
    "median_s": med,
    "cpu_over_wall": {name: run.total("cpu_s") / run.total("step_s") for name, run in runs.items()},
    "copy_bandwidth_GBps": bandwidth / 1e9,
    "bandwidth_bound_s": bound,
    "ratio_host_update_vs_plain": med["offload_host_update"] / med["plain_optax"],
    "ratio_device_update_vs_plain": med["offload_device_update"] / med["plain_optax"],
    "ratio_plain_vs_bound": med["plain_optax"] / bound,
    "ratio_host_update_vs_bound": med["offload_host_update"] / bound,
    "max_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  }
  for name, m in med.items():
    print(f"{name:>22}: {m * 1e3:8.2f} ms  (cpu/wall {result['cpu_over_wall'][name]:.2f})")
  print(f"{'bandwidth bound':>22}: {bound * 1e3:8.2f} ms  ({bandwidth / 1e9:.1f} GB/s copy)")
  print(f"host update / plain optax = {result['ratio_host_update_vs_plain']:.3f}")
  print(f"plain optax / bound       = {result['ratio_plain_vs_bound']:.2f}")
  return _common.write_json(result, args.out)


if __name__ == "__main__":
  main()
