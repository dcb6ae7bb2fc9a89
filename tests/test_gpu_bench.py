"""benchmarks/gpu.py, the run prepared for a lent GPU, smoke-tested on the CPU so that it cannot rot.

`--smoke` runs every section at tiny sizes; the JSON must hold every section with numbers, each
timed program beside its model with the ratio computed, and say that it ran on the CPU. One run
times all five step variants (a run of two, the plain step and the fused path, was a separate test
before: its checks are a subset of these, and the sections besides the steps ran twice).
"""

import json
import math
import os
import zipfile

import jax
import pytest

from benchmarks import gpu
from benchmarks import report


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_smoke_writes_every_section_with_numbers_for_every_variant(tmp_path):
  check_smoke(tmp_path / "gpu.json", gpu.VARIANTS)


def check_smoke(out, variants):
  result = gpu.main(["--smoke", "--out", str(out), "--variants", ",".join(variants)])
  on_disk = json.loads(out.read_text())
  assert on_disk["backend"] == jax.default_backend() == "cpu"  # no GPU numbers faked
  assert "say nothing about a GPU" in on_disk["note"]
  sections = on_disk["sections"]
  assert set(sections) == set(gpu.SECTIONS)
  assert on_disk["errors"] == [], on_disk["errors"]

  device = sections["device"]
  assert device["target"] == gpu.DEFAULT_TARGET and _number(device["hardware"]["tensor_flops"])

  bw = sections["bandwidth"]
  assert len(bw["rows"]) == len(gpu.SMOKE_SIZES.bw_bytes) and not bw["skipped"]
  for row in bw["rows"]:
    for kind in ("device_put_h2d", "device_put_d2h", "jit_h2d", "jit_d2h", "jit_both_directions"):
      assert _number(row[kind]["best_Bps"]), (kind, row)
  assert _number(bw["ratio_measured_vs_model_h2d"]) and _number(bw["ratio_measured_vs_model_d2h"])
  assert ("bandwidth.h2d" in " ".join(on_disk["flags"])) == (
    abs(bw["ratio_measured_vs_model_h2d"] - 1) > gpu.OFF_BY
  )

  steps = sections["steps"]
  assert set(steps["rows"]) == set(variants) and not steps["skipped"]
  pieces = sections["pieces"]
  timed = {
    **steps["rows"],
    "nvme_tier": pieces["nvme_tier"],
    "update_on_host": pieces["update_on_host"],
  }
  for name, row in timed.items():
    for key in ("measured_s", "modelled_s", "ratio", "modelled_measured_link_s"):
      assert _number(row[key]), (name, key, row.get("error"))
    assert row["ratio"] == pytest.approx(row["measured_s"] / row["modelled_s"])
    assert row["off_by_more_than_20pct"] == (abs(row["ratio"] - 1) > gpu.OFF_BY)
  flagged = {f.split(":")[0] for f in on_disk["flags"] if not f.startswith("bandwidth.")}
  assert flagged == {
    f"{'steps' if n in steps['rows'] else 'pieces'}.{n}"
    for n, r in timed.items()
    if r["off_by_more_than_20pct"]
  }

  nvme = pieces["nvme_tier"]
  assert nvme["footprint"]["nvme"] > 0 and nvme["footprint"]["host"] > 0 and nvme["nvme_files"] > 0
  assert nvme["bits_equal_host_tier"] and nvme["max_rel_vs_plain_optax"] < 1e-5
  assert pieces["update_on_host"]["max_rel_vs_plain_optax"] < 1e-5
  pool = pieces["pinned_pool"]
  for which in ("limited", "default"):
    assert pool[which]["backend"] == "cpu" and _number(pool[which]["allocated_bytes"]), pool[which]
  assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in pool["plan"]["warning"]

  # `python -m benchmarks` reads this JSON into its report (it read an older layout and failed).
  rows = report.rows_for("gpu", on_disk)
  assert {r[1].split(",")[1].split("(")[0].strip() for r in rows if r[1].startswith("step,")} == (
    set(variants)
  )
  assert all("CPU smoke run" in r[1] for r in rows if "measured" in r[1] or "link" in r[1])
  assert report.markdown({"gpu": on_disk}, [], [], "test").count("| gpu |") == len(rows)

  with zipfile.ZipFile(os.path.splitext(out)[0] + "_hlo.zip") as z:
    names = set(z.namelist())
  assert {f"step_{v}.hlo.txt" for v in variants} | {"nvme.hlo.txt"} <= names
  assert result["sections"]["steps"]["rows"].keys() == steps["rows"].keys()


def test_time_box_skips_and_says_so(tmp_path):
  out = tmp_path / "gpu.json"
  gpu.main(["--smoke", "--budget-s", "0", "--out", str(out)])
  sections = json.loads(out.read_text())["sections"]
  assert sections["device"]["target"] == gpu.DEFAULT_TARGET
  assert sections["bandwidth"]["rows"] == [] and len(sections["bandwidth"]["skipped"]) == 2
  assert all(p == {"skipped": "time box"} for p in sections["pieces"].values())
  assert sections["steps"]["rows"] == {}
  assert [s["variant"] for s in sections["steps"]["skipped"]] == list(gpu.VARIANTS)


def test_without_gpu_refuses_unless_smoke(capsys):
  with pytest.raises(SystemExit):
    gpu.main([])
  assert "--smoke" in capsys.readouterr().err


def test_help_says_the_command_and_what_to_send_back(capsys):
  with pytest.raises(SystemExit):
    gpu.main(["--help"])
  text = capsys.readouterr().out
  assert "python3 -m benchmarks.gpu --out $OUT/gpu.json" in text
  assert "Send back" in text and "--smoke" in text


@pytest.mark.parametrize(
  "kind, memory, backend, target",
  [
    ("NVIDIA H200", 150e9, "gpu", "h200_141gb"),
    ("NVIDIA H100 80GB HBM3", 80e9, "gpu", "h100_80gb"),
    ("NVIDIA GeForce RTX 4090", 24e9, "gpu", "rtx4090_24gb"),
    ("NVIDIA A100-SXM4-80GB", 80e9, "gpu", "h100_80gb"),  # unknown kind: nearest in memory
    ("cpu", None, "cpu", gpu.DEFAULT_TARGET),
  ],
)
def test_nearest_target(kind, memory, backend, target):
  assert gpu.nearest_target(kind, memory, backend)[0] == target


def test_the_report_skips_the_gpu_run_without_a_gpu(tmp_path):
  results, notes = report.run(["gpu"], "quick", str(tmp_path), str(tmp_path / "nvme"))
  assert results == {} and len(notes) == 1 and "skipped, no GPU" in notes[0], notes


def test_the_report_gives_each_benchmark_its_baseline():
  # host_update names plain optax "plain_optax" and multiprocess compares with one process: their
  # rows had no ratio (the report looked for "plain" only).
  rows = report.step_rows("host_update", {"median_s": {"plain_optax": 0.02, "offload": 0.03}})
  assert [r[3] for r in rows] == ["1.00 x plain", "1.50 x plain"]
  rows = report.step_rows("multiprocess", {"median_s": {"one_process": 0.01, "two": 0.012}})
  assert [r[3] for r in rows] == ["1.00 x one process", "1.20 x one process"]


def test_a_rebuilt_report_says_when_its_results_were_written():
  # --report-only gave the rebuild's date and load average as the measurement's.
  results = {"host_tier": {"median_s": {"plain": 0.01, "offload": 0.011}, "device": "cpu"}}
  text = report.markdown(
    results, [], [], "python -m benchmarks --report-only", "2026-12-01 10:00 UTC"
  )
  assert "from the results written 2026-12-01 10:00 UTC" in text and "load average" not in text
  assert "load average" in report.markdown(results, [], [], "python -m benchmarks")
