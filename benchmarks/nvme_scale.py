"""Scale demonstration (opt-in; not part of the test suite): the Adam state of a large model on NVMe.

The optimizer update of a model of ``--params`` parameters runs with all of its AdamW moments on NVMe
(``host_limit=0``); only the params and grads are held in memory. The run reports the process's peak RSS
against the bound that should hold whatever the size of the state,

    host_limit (0) + params + grads + the store's host_buffer_bound,

and the step time, so the time for a larger model can be projected (step time grows linearly with the
state: see ``benchmarks/nvme_tier.py``).

Configuration, stated honestly: params and grads are ``--dtype`` (bf16 by default) on the "device";
on a CPU-only machine the device *is* host RAM, so they count in the RSS. ``optax.adamw(mu_dtype=fp32)``
keeps mu in fp32 and nu in the params' dtype (optax has no ``nu_dtype``), so the state is 6 bytes per
parameter with bf16 params (2B params: 12 GB of moments, 4 GB of params, 4 GB of grads), 12 with
``--master`` (``offload(master_dtype=fp32)``: fp32 master, mu and nu, the mixed-precision layout of the
mission; 2.2B params: 26 GB of state) and 8 with fp32 params (2B: 16 GB of moments, 8 GB of params, 8 GB of grads: more than a 24 GiB machine should hold).
The groups are at most ``--group-mb`` of state each, independent of the model size, so the store's
buffers stay bounded as the model grows.

Before writing anything it checks that the disk has room for ~3 generations of the state and that the
memory bound fits in the available RAM, and refuses otherwise (``--dry-run`` only prints the plan).

    python benchmarks/nvme_scale.py --params 2e9 --dry-run
    python benchmarks/nvme_scale.py --params 2.2e9 --master --steps 1   # 26 GB of state > 24 GiB RAM
    python benchmarks/nvme_scale.py --params 0.25e9 --steps 2 --out bench_out/nvme_scale.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402
from benchmarks._common import COLS  # noqa: E402
from benchmarks._common import GB  # noqa: E402
from benchmarks._common import GIB  # noqa: E402

_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
_RUNTIME_BYTES = 512 << 20  # the JAX runtime and compiled programs: ~0.25 GiB measured, with margin
_GENERATIONS = 3  # the store keeps the committed and previous generations and writes the next


def _meminfo(field: str) -> int:
  return _common.proc_status(field, "/proc/meminfo") * 1024


def plan(args) -> dict:
  """Sizes of everything, from the flags alone (nothing is allocated)."""
  itemsize = 4 if args.dtype == "fp32" else 2
  rows = max(int(args.params / args.leaves / COLS), 1)
  n = rows * COLS * args.leaves
  # mu fp32 + nu in the params' dtype; with --master, an fp32 master copy and nu in fp32 as well.
  state_per_param = 12 if args.master else 4 + itemsize
  leaf_state = rows * COLS * state_per_param
  group_budget = max(args.group_mb << 20, leaf_state)
  leaves_per_group = max(group_budget // leaf_state, 1)
  group_bytes = leaves_per_group * leaf_state
  buffer_bound = 3 * group_bytes  # (prefetch_depth 1 + write_depth 1 + 1) x largest group
  p = {
    "params": n,
    "leaves": args.leaves,
    "rows": rows,
    "dtype": args.dtype,
    "params_bytes": n * itemsize,
    "grads_bytes": n * itemsize,
    "master": bool(args.master),
    "state_bytes": n * state_per_param,
    "group_bytes": group_bytes,
    "groups": -(-args.leaves // leaves_per_group),
    "window_bytes": 2 * (args.group_mb << 20),
    "host_buffer_bound": buffer_bound,
  }
  p["rss_bound"] = p["params_bytes"] + p["grads_bytes"] + buffer_bound
  # What this process really needs on a CPU machine: the device window is host RAM too.
  p["ram_needed"] = p["rss_bound"] + p["window_bytes"] + _RUNTIME_BYTES
  p["disk_needed"] = _GENERATIONS * p["state_bytes"]
  p["ram_total"] = _meminfo("MemTotal")
  p["ram_available"] = _meminfo("MemAvailable")
  p["disk_free"] = _common.disk_free_bytes(args.dir)
  p["state_exceeds_ram"] = p["state_bytes"] > p["ram_total"]
  p["model_exceeds_ram"] = p["state_bytes"] + p["params_bytes"] + p["grads_bytes"] > p["ram_total"]
  return p


def check(p: dict) -> list[str]:
  """Reasons to refuse the run (empty when it may go ahead)."""
  problems = []
  if p["disk_free"] < p["disk_needed"]:
    problems.append(
      f"not enough disk: {_GENERATIONS} generations of {p['state_bytes'] / GB:.1f} GB of state need "
      f"{p['disk_needed'] / GB:.1f} GB, {p['disk_free'] / GB:.1f} GB free. Free space, point --dir "
      "at a bigger disk, or lower --params."
    )
  if p["ram_needed"] > 0.8 * p["ram_available"]:
    problems.append(
      f"not enough memory: params + grads + buffers + window + runtime need "
      f"{p['ram_needed'] / GIB:.1f} GiB, {p['ram_available'] / GIB:.1f} GiB available (refusing above "
      "80%). Lower --params, use --dtype bf16, or lower --group-mb."
    )
  return problems


def _print_plan(p: dict) -> None:
  print(
    f"{p['params'] / 1e9:.2f}B params ({p['dtype']}), {p['leaves']} leaves, {p['groups']} groups of "
    f"<= {p['group_bytes'] / GB:.2f} GB: state {p['state_bytes'] / GB:.1f} GB on NVMe, params "
    f"{p['params_bytes'] / GB:.1f} GB + grads {p['grads_bytes'] / GB:.1f} GB in memory; RSS bound "
    f"{p['rss_bound'] / GIB:.2f} GiB; RAM {p['ram_total'] / GIB:.1f} GiB (state exceeds RAM: "
    f"{p['state_exceeds_ram']}, model exceeds RAM: {p['model_exceeds_ram']}); disk needs "
    f"{p['disk_needed'] / GB:.1f} GB, {p['disk_free'] / GB:.1f} GB free"
  )


def run(args, p: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import optax

  import optax_offload as oo

  jax.block_until_ready(jnp.zeros(8) + 1)
  rss_runtime = _common.rss_bytes()
  params = _common.make_tree(args.params, args.leaves, jnp.dtype(_DTYPES[args.dtype]), random=False)
  grads = _common.fixed_grads(params)
  jax.block_until_ready((params, grads))
  directory = os.path.join(args.dir, "store")
  shutil.rmtree(args.dir, ignore_errors=True)
  os.makedirs(args.dir)
  tx = oo.offload(
    optax.adamw(1e-4, mu_dtype=jnp.float32),
    host_limit=0,
    nvme_dir=directory,
    window_bytes=p["window_bytes"],
    master_dtype=jnp.float32 if args.master else None,
  )
  state = None
  try:
    state, store, init_s = _common.init_nvme(tx, params)
    fp = oo.footprint(state)
    peak_init = _common.peak_rss_bytes()
    print(f"init: {init_s:.1f} s, footprint {fp}, peak RSS {peak_init / GIB:.2f} GiB", flush=True)
    with _common.RssSampler() as sampler:
      state, steps = _steps(_common.make_step(tx), params, state, grads, directory, args)
    peak = _common.peak_rss_bytes()  # whole process: init, compilation and every step
    stats = store.stats
    bound = store.host_buffer_bound
    generation = int(state.nvme_generation)
  finally:
    if state is not None:
      oo.close_nvme(state)
    if not args.keep:
      shutil.rmtree(args.dir, ignore_errors=True)

  timed = steps[1:] or steps
  step_s = statistics.median(s["step_s"] for s in timed)
  rss_bound = p["params_bytes"] + p["grads_bytes"] + bound
  seconds_per_state_byte = step_s / fp["nvme"]
  target_state = 2e9 * p["state_bytes"] / p["params"]
  return {
    "benchmark": "nvme_scale",
    "plan": p,
    "footprint": fp,
    "generation": generation,
    "init_s": init_s,
    "steps": steps,
    "step_s": step_s,
    "rss": {
      "runtime": rss_runtime,
      "peak_process": peak,
      "peak_init": peak_init,
      "peak_sampled_steps": sampler.peak,
      "host_buffer_bound": bound,
      "bound": rss_bound,
    },
    "rss_over_bound": peak / rss_bound,
    "rss_over_bound_plus_runtime_and_window": peak / (rss_bound + rss_runtime + p["window_bytes"]),
    "store_stats": stats,
    "projection_2b": {
      "state_bytes": target_state,
      "step_s": seconds_per_state_byte * target_state,
      "init_s": init_s / fp["nvme"] * target_state,
      "assumes": "step time linear in NVMe state bytes (same disk, load and group size)",
    },
    "cache": args.cache,
    "load": _common.load(),
    "malloc_env": _common.malloc_env(),
  }


def _steps(step, params, state, grads, directory: str, args):
  """`args.steps` + 1 steps (the first compiles), each from a cold page cache and made durable."""
  import optax_offload as oo

  steps = []
  for i in range(args.steps + 1):
    oo.sync_nvme(state)
    _common.evict_cache(directory, args.cache)
    params, state, rec = _common.timed_step(step, params, state, grads, oo.sync_nvme)
    steps.append({**rec, "rss_now": _common.rss_bytes()})
    print(
      f"step {i}{' (compiles)' if i == 0 else ''}: {rec['step_s']:.1f} s (returns after "
      f"{rec['step_return_s']:.1f} s), CPU {rec['cpu_s']:.1f} s, RSS "
      f"{steps[-1]['rss_now'] / GIB:.2f} GiB",
      flush=True,
    )
  return state, steps


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=2e9, help="total parameters")
  parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="params and grads")
  parser.add_argument(
    "--master", action="store_true", help="fp32 master weights in the state (12 bytes/param)"
  )
  parser.add_argument("--leaves", type=int, default=64)
  parser.add_argument("--group-mb", type=int, default=256, help="most state bytes (MiB) per group")
  parser.add_argument("--steps", type=int, default=2, help="timed steps after the compiling one")
  parser.add_argument("--cache", choices=("fadvise", "drop", "none"), default="fadvise")
  parser.add_argument("--dir", default="bench_out/nvme_scale_data", help="on the disk under test")
  parser.add_argument("--keep", action="store_true", help="keep the store afterwards")
  parser.add_argument("--dry-run", action="store_true", help="print the plan and the checks only")
  parser.add_argument("--out", default="bench_out/nvme_scale.json")
  args = parser.parse_args(argv)

  p = plan(args)
  _print_plan(p)
  problems = check(p)
  if args.dry_run:
    print("checks: " + ("; ".join(problems) if problems else "ok"))
    return {"plan": p, "problems": problems}
  if problems:
    raise SystemExit("refusing to run: " + " ".join(problems))
  result = run(args, p)
  proj = result["projection_2b"]
  print(
    f"peak RSS {result['rss']['peak_process'] / GIB:.2f} GiB / bound {result['rss']['bound'] / GIB:.2f} "
    f"GiB = {result['rss_over_bound']:.2f} (<= 1.10; with runtime and window: "
    f"{result['rss_over_bound_plus_runtime_and_window']:.2f}); step {result['step_s']:.1f} s; projected "
    f"for 2B params: step {proj['step_s'] / 60:.1f} min, init {proj['init_s'] / 60:.1f} min; load "
    f"{result['load']['loadavg']}"
  )
  return _common.write_json(result, args.out)


if __name__ == "__main__":
  main()
