"""``python -m benchmarks``: runs the project's benchmarks and writes one Markdown report with plots.

Runs, in this order, each benchmark module of this folder that exists (a missing one is skipped with a
line saying so): ``host_tier`` (step time of the host tier against plain optax), ``host_update``
(the CPU-side update), ``nvme_tier`` (the NVMe tier against the raw disk), ``gpu`` (the step-time
model against a real GPU, link bandwidth, device bytes; skipped without a GPU) and ``multiprocess`` (2 processes on loopback against
1 process: bytes per tier per process, step time). Each has ``main(argv) -> dict`` and writes its JSON to
``--out``; this script then writes ``REPORT.md`` and PNG plots next to them. Every ratio in the report
compares runs measured in the same invocation (interleaved by the benchmark itself), so machine load
hits both sides alike.

Sizes: ``--quick`` (about 2 minutes on 2 CPU cores), the default (a few minutes), ``--full`` (each
benchmark's own defaults: the real sizes). A module may define ``QUICK_ARGS``, ``DEFAULT_ARGS`` and
``FULL_ARGS`` (argv lists) to choose its own sizes; otherwise the table `SIZES` below applies, and a
module it does not know runs with its defaults.

    python -m benchmarks --quick                  # -> bench_out/REPORT.md, bench_out/*.png
    python -m benchmarks --only host_tier,gpu --out /tmp/bench
    python -m benchmarks --report-only            # rebuild REPORT.md from the JSON already there
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback

from benchmarks._common import GB

BENCHMARKS = ("host_tier", "host_update", "nvme_tier", "gpu", "multiprocess")
"""Benchmark modules in `benchmarks/`, in the order they run."""

SIZES = {
  "host_tier": {
    "quick": ["--params", "8e6", "--leaves", "8", "--reps", "7"],
    "default": ["--params", "16e6", "--reps", "9"],
    "full": [],
  },
  "nvme_tier": {
    "quick": ["--state-gb", "0.2", "--sizes", "", "--reps", "2", "--warm-steps", "0"],
    "default": ["--state-gb", "0.5", "--sizes", "0.25,0.5", "--reps", "3", "--warm-steps", "1"],
    "full": [],
  },
  "gpu": {
    # Run only on a GPU (`gpu.unavailable`); the whole run is time-boxed by --budget-s.
    "quick": ["--budget-s", "150"],
    "default": [],
    "full": [],
  },
}
"""argv per benchmark and mode (`--out` and, for ``nvme_tier``, ``--dir`` are added)."""

TIERS = ("device", "host", "nvme")
MiB = 2**20


def _argv(name: str, module, mode: str, out: str, nvme_dir: str) -> list[str]:
  attr = {"quick": "QUICK_ARGS", "default": "DEFAULT_ARGS", "full": "FULL_ARGS"}[mode]
  argv = list(getattr(module, attr, SIZES.get(name, {}).get(mode, [])))
  argv += ["--out", os.path.join(out, f"{name}.json")]
  if name == "nvme_tier":
    argv += ["--dir", nvme_dir]
  return argv


def run(names, mode: str, out: str, nvme_dir: str) -> tuple[dict, list[str]]:
  """Runs the benchmarks that exist; returns their results and one line per skipped or failed one."""
  results, notes = {}, []
  for name in names:
    if importlib.util.find_spec(f"benchmarks.{name}") is None:
      notes.append(f"`benchmarks/{name}.py`: not present, skipped.")
      print(f"== {name}: benchmarks/{name}.py not present, skipped", flush=True)
      continue
    module = importlib.import_module(f"benchmarks.{name}")
    why_not = getattr(module, "unavailable", lambda: None)()
    if why_not:
      notes.append(f"`benchmarks/{name}.py`: skipped, {why_not}.")
      print(f"== {name}: skipped, {why_not}", flush=True)
      continue
    argv = _argv(name, module, mode, out, nvme_dir)
    print(f"== {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    try:
      result = module.main(argv)
    except (Exception, SystemExit) as e:  # one failure must not lose the others' results
      traceback.print_exc()
      notes.append(f"`benchmarks/{name}.py` failed: {type(e).__name__}: {e}")
      continue
    wall = time.perf_counter() - t0
    if result.get("skipped"):
      notes.append(f"`benchmarks/{name}.py`: skipped, {result['skipped']}.")
      continue
    result["_wall_s"] = wall
    results[name] = result
    print(f"== {name}: done in {wall:.0f} s", flush=True)
  return results, notes


def load(names, out: str) -> tuple[dict, list[str]]:
  """The results already in `out` (``--report-only``)."""
  results, notes = {}, []
  for name in names:
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
      notes.append(f"`{name}.json`: not in {out}, left out.")
      continue
    with open(path) as f:
      result = json.load(f)
    if result.get("skipped"):
      notes.append(f"`benchmarks/{name}.py`: skipped, {result['skipped']}.")
    else:
      results[name] = result
  return results, notes


# -- rows of the report --------------------------------------------------------------------------------


def _ms(s: float) -> str:
  return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _gib(b: float) -> str:
  from optax_offload import format_bytes

  return format_bytes(int(b))


def _gbps(b: float) -> str:
  return f"{b / GB:.2f} GB/s"


_VARIANTS = {
  "plain": "plain optax AdamW",
  "plain_optax": "plain optax AdamW",
  "offload": "offload(adamw)",
  "offload_one_group": "offload(adamw), one group",
  "one_process": "one process",
}
_BASELINES = ("plain", "plain_optax", "one_process")
"""The variant each benchmark's ratios are against, the first of these it has (host_update names
plain optax `plain_optax`; multiprocess compares two processes with one)."""


def _baseline(r: dict) -> str | None:
  """The key of `r`'s baseline variant in ``median_s``, or None."""
  med = r.get("median_s") or {}
  return next((k for k in _BASELINES if k in med), None)


def _against(key: str) -> str:
  """How a ratio names its baseline: "plain" for plain optax."""
  return "plain" if key.startswith("plain") else _VARIANTS.get(key, key)


def step_rows(name: str, r: dict) -> list[tuple[str, str, str, str]]:
  """(benchmark, measurement, value, ratio) rows for a result with ``median_s`` per variant."""
  med = r.get("median_s") or {}
  key = _baseline(r)
  base = med.get(key) if key else None
  rows = []
  for variant, s in sorted(med.items(), key=lambda kv: kv[0] != key):
    what = _VARIANTS.get(variant, variant)
    if name == "host_tier" and variant == "offload":
      what += f", {r.get('groups', '?')} groups"
    ratio = f"{s / base:.2f} x {_against(key)}" if base else ""
    rows.append((name, f"step time, {what}", _ms(s), ratio))
  return rows


def nvme_rows(r: dict) -> list[tuple[str, str, str, str]]:
  targets = r.get("targets", {})
  rows = []
  for size in r.get("sizes", []):
    gb = size["footprint"]["nvme"] / GB
    rows.append(
      (
        "nvme_tier",
        f"step time, {gb:.2f} GB of Adam state on NVMe, vs disk I/O bound "
        f"({size['io_lower_bound_s']:.2f} s)",
        _ms(size["step_s"]),
        f"{size['step_over_io_bound']:.2f} x bound (target {targets.get('step_over_io_bound', '')})",
      )
    )
    moved = 2 * size["footprint"]["nvme"] / size["step_s"]
    rows.append(
      (
        "nvme_tier",
        f"NVMe state moved per second vs raw disk (read {size['raw_read_GBps']:.2f}, write "
        f"{size['raw_write_GBps']:.2f} GB/s)",
        _gbps(moved),
        f"{size['moved_over_raw']:.2f} x raw (target {targets.get('moved_over_raw', '')})",
      )
    )
    rows.append(
      (
        "nvme_tier",
        "peak RSS vs host_limit + params + grads + NVMe buffers",
        _gib(size["rss"]["peak_steps"]),
        f"{size['rss_over_bound']:.2f} x bound (target {targets.get('rss_over_bound', '')})",
      )
    )
  return rows


def gpu_rows(r: dict) -> list[tuple[str, str, str, str]]:
  """Rows of `benchmarks/gpu.py`'s JSON: each step measured against its model, its device bytes
  against the plain step's, and the link against the model's."""
  sections = r["sections"]
  cpu = "" if r.get("backend") == "gpu" else " (CPU smoke run: says nothing about a GPU)"
  steps = sections.get("steps", {}).get("rows", {})
  plain = steps.get("plain_bf16", {}).get("memory_analysis", {}).get("device_bytes")
  rows = []
  for variant, row in steps.items():
    if "measured_s" not in row:
      continue
    rows.append(
      (
        "gpu",
        f"step, {variant} ({row['params']:,} params), measured{cpu}",
        _ms(row["measured_s"]),
        f"{row['ratio']:.2f} x modelled ({_ms(row['modelled_s'])})",
      )
    )
    device = row["memory_analysis"]["device_bytes"]
    rows.append(
      (
        "gpu",
        f"device bytes (memory_analysis), {variant}",
        _gib(device),
        f"{device / plain:.2f} x plain_bf16" if plain else "",
      )
    )
  bandwidth = sections.get("bandwidth", {})
  if bandwidth.get("rows"):
    largest = max(bandwidth["rows"], key=lambda row: row["bytes"])
    for way in ("h2d", "d2h"):
      best = largest[f"jit_{way}"]["best_Bps"]
      rows.append(
        (
          "gpu",
          f"link {way}, jitted transfer of {_gib(largest['bytes'])} between memory kinds{cpu}",
          _gbps(best),
          f"{bandwidth[f'ratio_measured_vs_model_{way}']:.2f} x modelled",
        )
      )
  return rows


def rows_for(name: str, r: dict) -> list[tuple[str, str, str, str]]:
  if name == "nvme_tier":
    return nvme_rows(r)
  if name == "gpu":
    return gpu_rows(r)
  rows = step_rows(name, r)
  for key, value in r.items():  # other benchmarks: their top-level ratios
    if key.startswith("ratio_") and isinstance(value, int | float) and name != "host_tier":
      rows.append((name, key.removeprefix("ratio_").replace("_", " "), "", f"{value:.3f}"))
  return rows


def tier_rows(results: dict) -> list[tuple[str, dict]]:
  """(label, bytes per tier) for every footprint the results carry."""
  out = []
  for name, r in results.items():
    if name == "nvme_tier":
      for size in r.get("sizes", []):
        out.append((f"nvme_tier, {size['state_gb']:g} GB state", size["footprint"]))
      continue
    for key, fp in r.items():
      if key.startswith("footprint") and isinstance(fp, dict):
        variant = key.removeprefix("footprint").strip("_") or "offload"
        out.append((f"{name}, {_VARIANTS.get(variant, variant)}", fp))
        if "plain" in (r.get("median_s") or {}):
          # Plain optax holds the same state, all of it on the device.
          total = sum(fp.get(t, 0) for t in TIERS)
          out.append((f"{name}, plain optax AdamW", {"device": total, "host": 0, "nvme": 0}))
  return out


# -- plots ---------------------------------------------------------------------------------------------


def plot(results: dict, out: str) -> list[str]:
  """Writes the PNGs; returns their file names."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  for name, draw in (
    ("step_time.png", _plot_steps),
    ("bytes_per_tier.png", _plot_tiers),
    ("nvme_bandwidth.png", _plot_nvme),
    ("gpu_memory.png", _plot_gpu),
  ):
    fig = draw(plt, results)
    if fig is None:
      continue
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    files.append(name)
  return files


def _plot_steps(plt, results: dict):
  """Median step time of each variant over its benchmark's baseline (plain optax; one process for
  multiprocess), in the same run."""
  steps = [
    (f"{name}\n{_VARIANTS.get(v, v)}", s / r["median_s"][_baseline(r)], s)
    for name, r in results.items()
    if _baseline(r) is not None
    for v, s in r["median_s"].items()
  ]
  if not steps:
    return None
  fig, ax = plt.subplots(figsize=(7, 0.6 * len(steps) + 1.2))
  labels, ratios, secs = zip(*steps)
  bars = ax.barh(range(len(steps)), ratios, color=["#999" if r == 1 else "#3a7" for r in ratios])
  ax.set_yticks(range(len(steps)), labels, fontsize=8)
  ax.invert_yaxis()
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_xlim(0, max(ratios) * 1.25)
  for bar, s in zip(bars, secs):
    ax.text(
      bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {_ms(s)}", va="center", fontsize=8
    )
  ax.set_xlabel("median step time / baseline: plain optax, or one process (same run)")
  ax.set_title("Step time per tier vs its baseline")
  return fig


def _plot_tiers(plt, results: dict):
  """Optimizer-state bytes per tier of every footprint in the results."""
  tiers = tier_rows(results)
  if not tiers:
    return None
  fig, ax = plt.subplots(figsize=(7, 0.5 * len(tiers) + 1.2))
  left = [0.0] * len(tiers)
  for tier, color in zip(TIERS, ("#c44", "#48c", "#aa4")):
    widths = [fp.get(tier, 0) / MiB for _, fp in tiers]
    ax.barh(range(len(tiers)), widths, left=left, color=color, label=tier)
    left = [a + b for a, b in zip(left, widths)]
  ax.set_yticks(range(len(tiers)), [label for label, _ in tiers], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("optimizer state, MiB")
  ax.set_title("Bytes per tier")
  ax.legend(fontsize=8)
  return fig


def _plot_nvme(plt, results: dict):
  """The NVMe tier's state moved per second against the raw disk, per size."""
  sizes = results.get("nvme_tier", {}).get("sizes", [])
  if not sizes:
    return None
  fig, ax = plt.subplots(figsize=(7, 3.5))
  width = 0.25
  for j, (label, values) in enumerate(
    (
      ("raw disk read", [s["raw_read_GBps"] for s in sizes]),
      ("raw disk write", [s["raw_write_GBps"] for s in sizes]),
      ("NVMe tier, state moved", [2 * s["footprint"]["nvme"] / s["step_s"] / GB for s in sizes]),
    )
  ):
    ax.bar([i + (j - 1) * width for i in range(len(sizes))], values, width, label=label)
  for i, s in enumerate(sizes):
    ax.annotate(
      f"{s['moved_over_raw']:.2f} x raw",
      (i + width, 0),
      xytext=(0, 3),
      textcoords="offset points",
      ha="center",
      fontsize=8,
    )
  ax.set_xticks(range(len(sizes)), [f"{s['footprint']['nvme'] / GB:.2f} GB on NVMe" for s in sizes])
  ax.set_ylabel("GB/s")
  ax.set_title("NVMe tier vs raw disk (same run, alternating)")
  ax.legend(fontsize=8)
  return fig


def _plot_gpu(plt, results: dict):
  """Device bytes of each step variant (memory_analysis), as `benchmarks/gpu.py` compiled them."""
  steps = results.get("gpu", {}).get("sections", {}).get("steps", {}).get("rows", {})
  steps = {k: v for k, v in steps.items() if "memory_analysis" in v}
  if not steps:
    return None
  fig, ax = plt.subplots(figsize=(6, 2.5))
  names = list(steps)
  ax.barh(names, [steps[k]["memory_analysis"]["device_bytes"] / 2**30 for k in names])
  ax.set_xlabel("GiB on the device (memory_analysis)")
  params = next(iter(steps.values()))["params"]
  ax.set_title(f"Device memory of a step, {params:,} params ({results['gpu'].get('backend')})")
  return fig


# -- the report ----------------------------------------------------------------------------------------


def _machine(results: dict, load: bool = True) -> str:
  """The machine, and its load average now (`load`: a report of results measured now)."""
  import jax

  first = next(iter(results.values()), {})
  device = first.get("device") or str(jax.devices()[0].device_kind)
  now = f", load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}" if load else ""
  return (
    f"JAX {jax.__version__}, backend {jax.default_backend()} ({device}), {platform.machine()}, "
    f"{os.cpu_count()} CPUs{now}"
  )


def markdown(
  results: dict, notes: list[str], figures: list[str], command: str, written: str | None = None
) -> str:
  """The report. `written`: when the results were written, for a report rebuilt from them
  (``--report-only``); None for results measured by this run."""
  now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  rows = [row for name, r in results.items() for row in rows_for(name, r)]
  when = f"on {now}" if written is None else f"on {now}, from the results written {written}"
  lines = [
    "# Benchmark report",
    "",
    f"`{command}` {when}; {_machine(results, load=written is None)}.",
    "",
    "Every ratio compares measurements taken in one run of its benchmark, interleaved by the "
    "benchmark where it runs both sides in one process (plain, offloaded, plain, ...), so machine "
    "load hits both sides alike (multiprocess runs each setup in processes of its own, in turn). "
    "On the CPU backend the "
    "host<->device transfers compile to nothing: CPU ratios show the cost of the grouping and the "
    "NVMe tier, not of a PCIe link.",
    "",
    "<!-- --8<-- [start:table] -->",
    "| benchmark | measurement | value | ratio (same run) |",
    "| --- | --- | --- | --- |",
  ]
  lines += [f"| {' | '.join(row)} |" for row in rows] or ["| (none) | | | |"]
  tiers = tier_rows(results)
  if tiers:
    lines += [
      "",
      "| optimizer state | device | host | nvme |",
      "| --- | --- | --- | --- |",
    ]
    lines += [
      f"| {label} | {' | '.join(_gib(fp.get(t, 0)) for t in TIERS)} |" for label, fp in tiers
    ]
  lines.append("<!-- --8<-- [end:table] -->")
  if notes:
    lines += ["", *[f"- {n}" for n in notes]]
  if figures:
    lines += ["", "## Figures", ""]
    lines += [f"![{f.removesuffix('.png').replace('_', ' ')}]({f})" for f in figures]
  files = ", ".join(f"`{name}.json`" for name in results)
  if files:
    lines += ["", f"Raw results: {files} (this folder)."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--quick", action="store_true", help="small sizes, about 2 minutes on 2 cores")
  size.add_argument("--full", action="store_true", help="each benchmark's real sizes")
  parser.add_argument("--out", default="bench_out", help="folder for JSON, REPORT.md and PNGs")
  parser.add_argument(
    "--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {','.join(BENCHMARKS)}"
  )
  parser.add_argument(
    "--nvme-dir", default=None, help="nvme_tier's data directory (default OUT/nvme_data)"
  )
  parser.add_argument(
    "--report-only", action="store_true", help="rebuild the report from the JSON in --out"
  )
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()]
  unknown = [n for n in names if n not in BENCHMARKS]
  if unknown:
    parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
  mode = "quick" if args.quick else "full" if args.full else "default"
  os.makedirs(args.out, exist_ok=True)
  nvme_dir = os.path.abspath(args.nvme_dir or os.path.join(args.out, "nvme_data"))
  written = None
  if args.report_only:
    results, notes = load(names, args.out)
    times = [os.path.getmtime(os.path.join(args.out, f"{n}.json")) for n in results]
    if times:
      stamp = datetime.datetime.fromtimestamp(max(times), datetime.UTC)
      written = stamp.strftime("%Y-%m-%d %H:%M UTC")
  else:
    results, notes = run(names, mode, args.out, nvme_dir)
  figures = plot(results, args.out)
  command = "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv)
  report = markdown(results, notes, figures, command.strip(), written)
  path = os.path.join(args.out, "REPORT.md")
  with open(path, "w") as f:
    f.write(report)
  print(report)
  print(f"wrote {path} and {len(figures)} figure(s)")
  failed = [n for n in notes if " failed: " in n]
  return 1 if failed else 0
