"""examples/consumer_13b.py (docs/consumer.md) at a CPU size: the plan's bytes and the run's agree."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
from helpers import gpu_compile_or_skip

import optax_offload as oo

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--steps", "3", "--lr", "1e-2"]


def _example():
  if "consumer_13b" in sys.modules:
    return sys.modules["consumer_13b"]
  spec = importlib.util.spec_from_file_location("consumer_13b", ROOT / "examples/consumer_13b.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules["consumer_13b"] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def host_run():
  """The script with its state in host memory only (--no-nvme)."""
  return _example().main([*TINY, "--no-nvme"])


def test_the_script_trains_with_the_state_in_host_memory(host_run):
  losses = host_run["losses"]
  assert len(losses) == 3 and np.all(np.isfinite(losses))
  assert losses[-1] < losses[0]  # byte statistics are learnt within a few steps at lr 1e-2
  # The runtime holds what the plan said: the optimizer state and master copy in host memory
  # (the plan's host bytes less the stack's bf16 weights), small leaves' state on the device.
  module = _example()
  cfg = module.SIZES["tiny"]
  stack = cfg.layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d) * 2
  assert host_run["footprint"]["nvme"] == 0
  assert host_run["footprint"]["host"] == host_run["plan"]["host"] - stack
  assert host_run["params"]["layers"]["wq"].sharding.memory_kind == "pinned_host"


def test_the_script_trains_with_the_state_on_nvme(host_run, tmp_path):
  run = _example().main([*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB"])
  try:
    assert run["footprint"]["nvme"] > 0 and run["footprint"]["host"] <= 64 * 1024
    assert any((tmp_path / "run1").iterdir())
    # The tier holding the state does not change the numbers (DESIGN.md, numerics rule 1).
    np.testing.assert_allclose(run["losses"], host_run["losses"], rtol=1e-6)
  finally:
    oo.close_nvme(run["state"])


def test_the_script_accumulates_with_8bit_moments_and_leaves_kept_on_the_card(tmp_path):
  # The page's 48 GiB configuration at the CPU size: micro-batches accumulated in bf16, 8-bit
  # moments on the drive, wq and wo kept on the device beside the streamed stack.
  run = _example().main(
    [*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB", "--accumulate", "2",
     "--accumulator-dtype", "bf16", "--moment-dtype", "int8", "--device-leaves", "wq,wo"]
  )  # fmt: skip
  try:
    assert np.all(np.isfinite(run["losses"])) and run["footprint"]["nvme"] > 0
    memory = {k: x.sharding.memory_kind for k, x in run["params"]["layers"].items()}
    assert memory["wq"] == memory["wo"] == "device" and memory["w_gate"] == "pinned_host"
  finally:
    oo.close_nvme(run["state"])


def test_the_script_compiles_its_step_for_a_gpu_without_allocating(tmp_path):
  # --compile-for: the step with its NVMe callbacks, compiled for the 4090 from the shapes alone
  # (docs/consumer.md cites the 13B figure); the drive gets no state.
  gpu_compile_or_skip()
  run = _example().main(
    [*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB", "--accumulate", "2",
     "--moment-dtype", "int8", "--device-leaves", "wq,wo", "--compile-for", "rtx4090_24gb"]
  )  # fmt: skip
  assert run["device_bytes"] > 0 and run["callbacks"] > 0
  assert "losses" not in run
  written = [p for p in (tmp_path / "run1").rglob("*") if p.is_file() and p.name != "LOCK"]
  assert not written, written
