"""GPU check of `offload(adamw)`: device memory, step-time overhead and link bandwidth, one short run.

1. Device memory, nothing allocated: ``jax.jit(step).lower(...).compile().memory_analysis()`` for a
   ~1B-parameter pytree given as `jax.ShapeDtypeStruct`s whose shardings carry memory kinds (the
   offloaded Adam moments in ``pinned_host``, as `offload`'s init puts them), plain optax AdamW
   against `offload(adamw)`.
2. Step time: real arrays (``--time-params``), plain and offloaded steps interleaved, params and state
   donated; the ratio is the cost of offloading.
3. Link bandwidth: eager `jax.device_put` between ``device`` and ``pinned_host`` of ``--bw-bytes``, a
   jitted transfer (``out_shardings`` in the other memory kind, as `offload` moves state), and what the
   offloaded step achieves (2 x host-tier bytes per step / step time, a lower bound).

On a machine without a GPU it prints one line and exits 0; ``--allow-cpu`` runs it on the CPU at small
sizes (a smoke test: CPU transfers are memory copies).

    python benchmarks/gpu.py                       # ~1-3 minutes on one GPU
    python benchmarks/gpu.py --allow-cpu --params 2e6 --time-params 2e6 --bw-bytes 8MiB
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optax_offload as oo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import write_json  # noqa: E402

_COLS = 4096
_MEMORY_FIELDS = (
  "argument_size_in_bytes",
  "output_size_in_bytes",
  "alias_size_in_bytes",
  "temp_size_in_bytes",
  "peak_memory_in_bytes",
  "host_argument_size_in_bytes",
  "host_output_size_in_bytes",
  "host_alias_size_in_bytes",
  "host_temp_size_in_bytes",
)


def shapes(total: float, leaves: int, dtype) -> dict:
  rows = max(int(total / leaves / _COLS), 1)
  return {f"layer_{i:02d}": jax.ShapeDtypeStruct((rows, _COLS), dtype) for i in range(leaves)}


def make_step(tx, apply: bool = False):
  def step(params, state, grads):
    if apply:  # offload: the updates applied group by group, never whole on the device
      return oo.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def memory(tx, params, device, *, offloaded: bool, min_size: int) -> dict:
  """memory_analysis of one jitted, donated step on abstract arrays (nothing allocated).

  The params are on a one-device mesh (NamedSharding); an offloaded state comes from
  `oo.abstract_state`, whose shardings carry the memory kinds (in jax 0.10 a ShapeDtypeStruct with
  a SingleDeviceSharding does not carry its memory kind into tracing).
  """
  del min_size
  mesh = jax.sharding.Mesh([device], ("d",))
  on_device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device), params
  )
  if offloaded:
    state = oo.abstract_state(tx, params)
  else:
    state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device),
      jax.eval_shape(tx.init, params),
    )
  t0 = time.perf_counter()
  compiled = make_step(tx, apply=offloaded).lower(params, state, params).compile()
  stats = compiled.memory_analysis()
  out = {f: int(getattr(stats, f, 0) or 0) for f in _MEMORY_FIELDS}
  out["device_bytes"] = (
    out["argument_size_in_bytes"]
    + out["output_size_in_bytes"]
    - out["alias_size_in_bytes"]
    + out["temp_size_in_bytes"]
  )
  out["compile_s"] = time.perf_counter() - t0
  return out


def _time(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return min(times)


def bandwidth(nbytes: int, device, reps: int) -> dict:
  """Bytes per second device->pinned_host and back: eager device_put and a jitted transfer."""
  x = jax.device_put(jnp.ones(max(nbytes // 4, 1), jnp.float32), device)
  on_device = x.sharding.with_memory_kind("device")
  on_host = x.sharding.with_memory_kind("pinned_host")
  h = jax.device_put(x, on_host)
  to_host = jax.jit(lambda a: a, out_shardings=on_host)
  to_device = jax.jit(lambda a: a, out_shardings=on_device)
  jax.block_until_ready((to_host(x), to_device(h)))  # compile
  n = x.nbytes
  return {
    "bytes": n,
    "device_put_d2h_Bps": n / _time(lambda: jax.device_put(x, on_host), reps),
    "device_put_h2d_Bps": n / _time(lambda: jax.device_put(h, on_device), reps),
    "jit_d2h_Bps": n / _time(lambda: to_host(x), reps),
    "jit_h2d_Bps": n / _time(lambda: to_device(h), reps),
  }


def step_times(num_params: float, leaves: int, dtype, groups: int, reps: int) -> dict:
  """Median step time of plain AdamW and offload(AdamW), interleaved, same params and grads."""
  params = {
    k: jnp.full(s.shape, 0.02, s.dtype) for k, s in shapes(num_params, leaves, dtype).items()
  }
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n = sum(p.size for p in jax.tree.leaves(params))
  state_bytes = 2 * 4 * n
  window = max(2 * state_bytes // groups, 1)
  variants = {
    "plain": optax.adamw(1e-3),
    "offload": oo.offload(optax.adamw(1e-3), window_bytes=window),
  }
  runs = {}
  # The offloaded run goes first so that the device's peak after it is its own (peak_bytes_in_use
  # only grows); the plain run's peak is read after it.
  peaks = {}
  for name, tx in reversed(variants.items()):
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    step = make_step(tx, apply=name == "offload")
    p, s = step(p, s, grads)
    jax.block_until_ready((p, s))
    runs[name] = [step, p, s, []]
    peaks[name] = _peak_bytes()
  for _ in range(reps):
    for run in runs.values():
      step, p, s, times = run
      t0 = time.perf_counter()
      p, s = step(p, s, grads)
      jax.block_until_ready((p, s))
      times.append(time.perf_counter() - t0)
      run[1], run[2] = p, s
  med = {name: statistics.median(run[3]) for name, run in runs.items()}
  fp = oo.footprint(runs["offload"][2])
  return {
    "params": n,
    "window_bytes": window,
    "median_s": med,
    "ratio_offload_vs_plain": med["offload"] / med["plain"],
    "footprint_offload": fp,
    "achieved_link_Bps": 2 * fp["host"] / med["offload"],
    "device_peak_bytes_after": peaks,
  }


def _peak_bytes() -> int | None:
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # not every backend reports memory stats
    stats = {}
  return stats.get("peak_bytes_in_use")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=1e9, help="params for memory_analysis")
  parser.add_argument("--time-params", type=float, default=1e9, help="params for step timing")
  parser.add_argument("--leaves", type=int, default=32)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--groups", type=int, default=8, help="window sized for this many groups")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--bw-bytes", default="1GiB", help="bytes per bandwidth transfer")
  parser.add_argument("--min-size", type=int, default=4096)
  parser.add_argument("--allow-cpu", action="store_true", help="run on CPU (smoke test)")
  parser.add_argument("--out", default="bench_out/gpu.json")
  args = parser.parse_args(argv)

  backend = jax.default_backend()
  if backend != "gpu" and not args.allow_cpu:
    print(f"benchmarks/gpu.py: skipped, no GPU (JAX backend is {backend!r}).")
    return {"benchmark": "gpu", "skipped": f"no GPU (JAX backend is {backend!r})"}
  device = jax.local_devices()[0]
  dtype = jnp.dtype(args.dtype)
  abstract = shapes(args.params, args.leaves, dtype)
  n = sum(s.size for s in abstract.values())
  tx_plain = optax.adamw(1e-3)
  tx_offload = oo.offload(optax.adamw(1e-3), min_size=args.min_size)
  mem = {
    "plain": memory(tx_plain, abstract, device, offloaded=False, min_size=args.min_size),
    "offload": memory(tx_offload, abstract, device, offloaded=True, min_size=args.min_size),
  }
  for name, m in mem.items():
    print(
      f"{name:>8} ({n:,} params): device {m['device_bytes'] / 2**30:.2f} GiB"
      f" (args {m['argument_size_in_bytes'] / 2**30:.2f}, temp {m['temp_size_in_bytes'] / 2**30:.2f}),"
      f" host args {m['host_argument_size_in_bytes'] / 2**30:.2f} GiB"
    )
  ratio_mem = mem["offload"]["device_bytes"] / max(mem["plain"]["device_bytes"], 1)
  print(f"device bytes, offload / plain = {ratio_mem:.3f}")

  bw = bandwidth(oo.parse_bytes(args.bw_bytes, "--bw-bytes"), device, args.reps)
  print(
    "device_put: d2h {:.1f} GB/s, h2d {:.1f} GB/s; jit: d2h {:.1f} GB/s, h2d {:.1f} GB/s".format(
      *(
        bw[k] / 1e9
        for k in ("device_put_d2h_Bps", "device_put_h2d_Bps", "jit_d2h_Bps", "jit_h2d_Bps")
      )
    )
  )
  steps = step_times(args.time_params, args.leaves, dtype, args.groups, args.reps)
  link = steps["achieved_link_Bps"]
  plain_link = 2 / (1 / bw["device_put_d2h_Bps"] + 1 / bw["device_put_h2d_Bps"])
  print(
    f"step: plain {steps['median_s']['plain'] * 1e3:.1f} ms, offload "
    f"{steps['median_s']['offload'] * 1e3:.1f} ms, ratio {steps['ratio_offload_vs_plain']:.2f};"
    f" offloaded step moves {link / 1e9:.1f} GB/s = {link / plain_link:.2f} x device_put"
  )
  result = {
    "benchmark": "gpu",
    "backend": backend,
    "device": str(device.device_kind),
    "jax": jax.__version__,
    "params_memory_analysis": n,
    "dtype": args.dtype,
    "memory_analysis": mem,
    "ratio_device_peak_offload_vs_plain": ratio_mem,
    "bandwidth": bw,
    "steps": steps,
    "median_s": steps["median_s"],
    "ratio_offload_vs_plain": steps["ratio_offload_vs_plain"],
    "footprint_offload": steps["footprint_offload"],
    "ratio_link_offload_vs_device_put": link / plain_link,
  }
  return write_json(result, args.out)


if __name__ == "__main__":
  main()
