"""Host and NVMe tiers in 2 processes x 2 CPU devices on loopback against 1 process x 4 devices.

Runs `tests/multiprocess_child.py` (the run `tests/test_multiprocess.py` checks bit for bit) in both
setups and records what each process holds per tier (`oo.footprint`, per process) and the median
step time of each setup. By default the run has host and NVMe tiers (the child's ``--nvme``: a
per-process ``host_limit`` that sends the largest leaf's state to ``nvme_dir/process_{i}``);
``--host-only`` keeps everything in pinned host memory. Setups alternate per round (1 process, 2 processes, 1 process, ...) so
drift hits both alike. On one machine the two processes share its cores and talk over loopback
(gloo), so the ratio shows the cost of the multi-controller runtime here, not a cluster's scaling.

    python benchmarks/multiprocess.py --steps 100 --rounds 2 --out bench_out/multiprocess.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import _common  # noqa: E402

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")
CHILD = os.path.join(TESTS, "multiprocess_child.py")

# Steps take milliseconds at this size; each run's start (jax.distributed, compile) takes 10-25 s.
QUICK_ARGS = ["--steps", "50", "--rounds", "1"]
DEFAULT_ARGS = ["--steps", "100", "--rounds", "2"]
FULL_ARGS = ["--steps", "200", "--rounds", "3"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_setup(num_processes: int, steps: int, timeout: float, flags=()) -> list[dict]:
  """One run of the child in `num_processes` processes; each process's footprint and step times."""
  port = str(_free_port())
  env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)  # the child sets its device count
  with tempfile.TemporaryDirectory(prefix="oo_multiprocess_") as out:
    argv = [str(num_processes), port, out, "--steps", str(steps), *flags]
    procs = [
      subprocess.Popen(
        [sys.executable, CHILD, str(i), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
      for i in range(num_processes)
    ]
    try:
      outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
      for p in procs:
        p.kill()
        p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
      if p.returncode != 0:
        raise RuntimeError(
          f"process {i} of {num_processes} failed ({p.returncode}):\n{err[-3000:]}"
        )
    results = []
    for i in range(num_processes):
      with open(os.path.join(out, f"footprint_{i}.json")) as f:
        results.append(json.load(f))
  return results


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100, help="steps per run (the first is compile)")
  parser.add_argument("--rounds", type=int, default=2, help="runs of each setup, alternating")
  parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
  parser.add_argument("--host-only", action="store_true", help="no NVMe tier")
  parser.add_argument("--out", default="bench_out/multiprocess.json")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error("--steps must be >= 2 (the first step compiles)")

  runs: dict[str, list[list[dict]]] = {"one_process": [], "two_processes": []}
  walls: dict[str, list[float]] = {"one_process": [], "two_processes": []}
  for r in range(args.rounds):
    for name, n in (("one_process", 1), ("two_processes", 2)):
      t0 = time.perf_counter()
      flags = () if args.host_only else ("--nvme",)
      runs[name].append(run_setup(n, args.steps, args.timeout, flags))
      walls[name].append(time.perf_counter() - t0)
      print(f"round {r}: {name} done in {walls[name][-1]:.1f} s", flush=True)

  # A step of the 2-process run ends when both processes finish it: take the slower process.
  per_run = {
    name: [max(p["median_step_s"] for p in run) for run in rs] for name, rs in runs.items()
  }
  medians = {name: statistics.median(v) for name, v in per_run.items()}
  one, two = runs["one_process"][-1], runs["two_processes"][-1]
  result = {
    "benchmark": "multiprocess",
    "backend": one[0]["backend"],
    "device": "4 devices: 1 process x 4, or 2 processes x 2 on loopback (gloo)",
    "machine": platform.machine(),
    "cpus": os.cpu_count(),
    "steps": args.steps,
    "rounds": args.rounds,
    "median_s": medians,
    "ratio_two_vs_one_process": medians["two_processes"] / medians["one_process"],
    "per_run_median_s": per_run,
    "run_wall_s": walls,
    "footprint_one_process": one[0]["footprint"],
    **{f"footprint_two_processes_p{i}": p["footprint"] for i, p in enumerate(two)},
    "tiers": "host" if args.host_only else "host+nvme",
    "host_bytes_two_processes_sum": sum(p["footprint"]["host"] for p in two),
    "nvme_bytes_two_processes_sum": sum(p["footprint"]["nvme"] for p in two),
    "nvme_files_two_processes": [p.get("nvme_files", []) for p in two],
    "memory_kinds": sorted({k for run in (one, two) for p in run for k in p["memory_kinds"]}),
  }
  for name, m in medians.items():
    print(f"{name:>14}: median step {m * 1e3:8.2f} ms")
  print(f"2 processes / 1 process = {result['ratio_two_vs_one_process']:.3f}")
  print(f"footprint, 1 process:   {result['footprint_one_process']}")
  for i, p in enumerate(two):
    print(f"footprint, process {i}/2: {p['footprint']}")
  return _common.write_json(result, args.out)


if __name__ == "__main__":
  main()
