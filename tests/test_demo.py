"""End-to-end: the user-facing demo trains, writes its outputs, and offloading does not change the numbers."""

import json
import os
import subprocess
import sys

try:
  import optax_offload

  HAS_OFFLOAD = hasattr(optax_offload, "offload")
except ImportError:
  HAS_OFFLOAD = False

DEMO = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "demo.py")
# heads 4 x head_dim 16 x d_model 64 = 4096: attention kernels sit exactly at the default min_size,
# the MLP and embeddings above it, LayerNorms and biases below it.
TINY = ["--layers", "1", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--batch", "8"]


def test_demo_trains_and_matches_plain_optax(tmp_path):
  offload = "host" if HAS_OFFLOAD else "none"
  out = tmp_path / "out"
  cmd = [sys.executable, DEMO, *TINY, "--steps", "20", "--offload", offload, "--out", str(out)]
  # conftest asks XLA for 4 CPU devices; the demo should run as a user runs it, on one.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert (out / "loss.png").stat().st_size > 0
  summary = json.loads((out / "summary.json").read_text())

  losses = summary["runs"][offload if HAS_OFFLOAD else "plain"]["losses"]
  assert len(losses) == 20
  assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # starts near ln(256) = 5.5 and drops fast
  assert summary["val_loss"] < losses[0]

  if HAS_OFFLOAD:
    assert summary["max_loss_diff_rel"] <= 1e-4
    assert summary["max_param_diff"] <= 1e-4, summary["max_param_diff_leaf"]
    offloaded, plain = summary["runs"]["host"]["tiers"], summary["runs"]["plain"]["tiers"]
    assert offloaded["host"] > 0
    assert offloaded["device"] < plain["device"]


def test_demo_streams_the_block_stack_and_matches_plain_optax(tmp_path):
  # --stream-layers: the blocks' weights stacked in pinned host memory and streamed through
  # oo.offloaded_scan; two layers (the last --layers wins), so the scan runs more than once.
  out = tmp_path / "out"
  args = [*TINY, "--layers", "2", "--steps", "10", "--stream-layers", "--out", str(out)]
  cmd = [sys.executable, DEMO, *args]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["loss_check"] in ("bit-identical", "within 1e-4 relative")
  assert summary["max_param_diff"] <= 1e-4, summary["max_param_diff_leaf"]
  assert summary["runs"]["stream"]["tiers"]["host"] > 0
