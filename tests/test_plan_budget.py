"""`plan --host-memory`: one host budget for weights, gradients, state and buffers, the rest on NVMe.

Numbers checked by hand; the consumer machine of issue 22 (a 24 GB card, 64 GB of RAM of which
48 GiB for the run, a 2 TB NVMe drive) is the main case.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import one_device_bf16

import optax_offload as oo
from optax_offload._src import cli
from optax_offload._src import estimate as estimate_lib
from optax_offload._src import host_budget
from optax_offload._src import report as report_lib

GiB = 2**30
TWO_TB_FREE = 1_900_000_000_000  # a 2 TB drive, mostly free

# 13B bf16 in a stack of 40 layers, AdamW with an fp32 master copy, by hand:
#   card 24 GiB, JAX takes 75%: int(0.75 * 24 GiB) = 19_327_352_832 B; window 10% of that,
#     int(1_932_735_283.2) = 1_932_735_283 B
#   stack weights 2 B x 13e9 = 26e9 B in host memory; no whole gradients (update in the backward
#     pass); per layer 650e6 B, on the device 7 layers of weights + 4 of grads = 7.15e9 B
#   device: 7.15e9 + window = 9_082_735_283 B
#   state 12 B x 13e9 = 156e9 B. With the update in the backward pass the NVMe tier holds a pair of
#     layers' NVMe state in host memory, and on a GPU the copy its callbacks take of one piece of
#     the pair's rows, which a count without shapes bounds by the larger of a group's state
#     (window / 2.25 = 858_993_459 B) and one layer's rows of the NVMe state (about 3.6e9 B: one
#     layer more), one group
#     read ahead and one written behind (groups of half the window, 966_367_641 B), and 4
#     write-staging buffers of 4 MiB:
#     buffers = 3 * ceil(nvme / 40) + 2 * 966_367_641 + 16_777_216
#   the state in host memory h fills the rest: 26e9 + h + buffers(156e9 - h) = 48 GiB, so
#     h * 37 / 40 = 51_539_607_552 - 26e9 - 1_932_735_282 - 16_777_216 - 3 * 156e9 / 40
#     = 11_890_095_054, h = 12_854_156_815.1 B (the planner lands within a few KiB below: the
#     buffers round up)
GOAL = [
  "plan",
  "13B",
  "--param-dtype",
  "bf16",
  "--master-dtype",
  "fp32",
  "--weights-on",
  "host",
  "--layers",
  "40",
  "--device-memory",
  "24GiB",
  "--host-memory",
  "48GiB",
]
HAND_DEVICE_JAX = 19_327_352_832
HAND_WINDOW = 1_932_735_283
HAND_GROUP = 966_367_641
HAND_STAGING = 4 * 4 * 2**20  # NvmeOptions' 4 I/O threads, a 4 MiB write request each
# The update after the backward pass: one group read ahead, one read from, one written behind, the
# put's copy.
HAND_BUFFERS = 4 * HAND_GROUP + HAND_STAGING
HAND_STATE_HOST = 12_854_156_815.1
STATE = 156_000_000_000
ONE_IO_THREAD = oo.NvmeOptions(io_threads=1)


def fused_buffers(nvme: int) -> int:
  """The NVMe tier's host buffers with the update in the backward pass (by hand, above)."""
  return 3 * -(-nvme // 40) + 2 * HAND_GROUP + HAND_STAGING


@pytest.fixture(autouse=True)
def _jax_defaults(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)


@pytest.fixture
def two_tb(monkeypatch):
  monkeypatch.setattr(estimate_lib, "free_disk", lambda path: TWO_TB_FREE)


def _json(argv, capsys, status=0):
  assert cli.main([*argv, "--json"]) == status
  return json.loads(capsys.readouterr().out)


def test_13b_on_a_24gb_card_with_48gib_of_host_fits(tmp_path, two_tb, capsys):
  d = _json([*GOAL, "--nvme-dir", str(tmp_path / "run1")], capsys)
  assert d["fits"] and d["shortfalls"] == []
  assert d["update_in_backward"] and "do not fit in --host-memory" in d["update_in_backward_reason"]
  assert d["device_memory"] == HAND_DEVICE_JAX and d["device_card_memory"] == 24 * GiB
  assert d["window_bytes"] == HAND_WINDOW
  host, nvme = d["host_bytes"], d["nvme_bytes"]
  assert (
    d["host_weight_bytes"] == 26_000_000_000 and HAND_STATE_HOST - 8192 < host <= HAND_STATE_HOST
  )
  assert nvme == STATE - host and d["nvme_buffer_bytes"] == fused_buffers(nvme)
  assert 48 * GiB - 8192 < d["bytes_per_tier"]["host"] <= 48 * GiB
  assert d["bytes_per_tier"]["device"] == 7_150_000_000 + HAND_WINDOW <= HAND_DEVICE_JAX
  assert d["pinned_pool"]["setting"] is None  # 26e9 + 16.6e9 B of pinned arrays < 64 GiB
  tiers = {p["what"]: (p["tier"], p["nbytes"]) for p in d["placements"]}
  assert tiers["layer stack's weights (bf16)"] == ("host", 26_000_000_000)
  assert tiers["layer stack's gradients"] == ("none", 0)
  assert tiers["optimizer state and master copy on NVMe"] == ("nvme", nvme)
  assert sum(p["nbytes"] for p in d["placements"] if p["tier"] == "host") == d["host_total_bytes"]
  # The same plan as text says where each item went and why, and how to run it.
  assert cli.main([*GOAL, "--nvme-dir", str(tmp_path / "run1")]) == 0
  out = capsys.readouterr().out
  assert "fits: yes" in out and "update in the backward pass (oo.value_and_update)" in out
  assert "18.00 GiB that JAX may take: 0.75 of the 24.00 GiB card" in out
  assert "host: 48.00 GiB of --host-memory 48.00 GiB" in out
  assert "no setting needed" in out
  assert f"oo.offload(..., host_limit={host}, nvme_dir=DIR)" in out
  # offload(host_memory=) plans at init from the shapes, which a count only approximates.
  assert f"or: oo.offload(..., host_memory={48 * GiB}, nvme_dir=DIR) (offload plans at init " in out
  assert "which this count approximates" in out
  assert "kept in host memory first (on NVMe when they do not fit" in out  # why they are in RAM


def test_the_consumer_story_from_help_alone(tmp_path, two_tb, capsys):
  # "a 24 GB GPU, 64 GB of RAM, a 2 TB drive": the help's first example, as a user types it.
  help_text = cli._parser()._subparsers._group_actions[0].choices["plan"].format_help()
  assert "--host-memory 48GiB" in help_text and "the GPU card's memory" in help_text
  argv = [*GOAL[:10], "--device-memory", "24GB", "--host-memory", "48GiB"]
  d = _json([*argv, "--nvme-dir", str(tmp_path)], capsys)
  assert d["fits"] and d["bytes_per_tier"]["host"] <= 48 * GiB
  assert d["bytes_per_tier"]["device"] <= int(0.75 * 24e9)
  assert d["pinned_pool"]["setting"] is None


def test_weights_and_grads_stay_in_host_memory_when_they_fit(two_tb):
  # 128 GiB: the stack's weights and gradients (52e9 B) fit, so the update runs after the
  # backward pass (auto) and the state takes what is left.
  e = oo.estimate(
    "13B", param_dtype="bf16", master_dtype="fp32", weights_on="host", layers=40,
    device_memory="24GiB", memory_fraction=0.75, host_memory="128GiB", nvme_dir="/tmp",
  )  # fmt: skip
  assert not e.update_in_backward and e.host_weight_bytes == 52_000_000_000
  assert e.nvme_buffer_bytes == HAND_BUFFERS
  assert "or: oo.offload(..., host_memory=" in report_lib.report(e)
  # Told to update in the backward pass: offload(host_memory=...) would not choose so itself.
  told = oo.estimate(
    "13B", param_dtype="bf16", master_dtype="fp32", weights_on="host", layers=40,
    device_memory="24GiB", memory_fraction=0.75, host_memory="128GiB", nvme_dir="/tmp",
    update_in_backward=True,
  )  # fmt: skip
  assert told.fits and "or: oo.offload(..., host_memory=" not in report_lib.report(told)
  assert e.host_bytes == 128 * GiB - 52_000_000_000 - HAND_BUFFERS
  assert e.host_total_bytes == 128 * GiB and e.fits


def test_whole_gradients_that_fit_only_without_the_buffers_go_into_the_backward_pass(two_tb):
  # 50 GiB: the stack's weights and gradients (52e9 B) fit, but not with the NVMe buffers beside
  # them; the update in the backward pass (auto) needs no whole gradients, and the plan fits.
  kwargs = dict(
    param_dtype="bf16", master_dtype="fp32", weights_on="host", layers=40,
    device_memory="24GiB", memory_fraction=0.75, host_memory="50GiB", nvme_dir="/tmp",
  )  # fmt: skip
  assert 52_000_000_000 < 50 * GiB < 52_000_000_000 + HAND_BUFFERS
  whole = oo.estimate("13B", update_in_backward=False, **kwargs)
  (short,) = whole.shortfalls
  assert short.tier == "host" and short.needed == 52_000_000_000 + HAND_BUFFERS
  e = oo.estimate("13B", **kwargs)
  assert e.update_in_backward and "beside its weights and the NVMe buffers" in (
    e.update_in_backward_reason
  )
  assert e.fits and e.host_weight_bytes == 26_000_000_000
  assert e.host_total_bytes <= 50 * GiB and e.host_bytes > 0
  # Not where it would trade the host's shortfall for the device's: the window beside the
  # streamed layers needs more of the device (8 GiB with 1 GiB of activations: 8.46 GiB).
  small = dict(kwargs, device_memory="8GiB", memory_fraction=1.0, activation_bytes="1GiB")
  assert any(
    f.tier == "device" for f in oo.estimate("13B", update_in_backward=True, **small).shortfalls
  )
  e = oo.estimate("13B", **small)
  assert not e.update_in_backward and [f.tier for f in e.shortfalls] == ["host"]
  # Without NVMe what the gradients do not fit beside is the state.
  e = oo.estimate("1B", param_dtype="bf16", master_dtype="fp32", weights_on="host", layers=16,
                  host_memory="15GB")  # fmt: skip
  assert e.fits and e.update_in_backward
  assert "beside its weights and the offloaded state" in e.update_in_backward_reason


def test_weights_that_do_not_fit_the_host_budget_go_to_nvme(two_tb, capsys):
  # 20 GiB holds the NVMe buffers, not the 26e9 B of weights beside them: the weights go to NVMe
  # (oo.write_nvme_stack, trained by value_and_update), read twice a step and written once.
  d = _json([*GOAL[:13], "20GiB", "--nvme-size", "2TB"], capsys)
  assert d["fits"] and d["weights_on"] == "nvme" and d["host_weight_bytes"] == 0
  assert d["nvme_weight_bytes"] == 26_000_000_000 and d["host_total_bytes"] <= 20 * GiB
  assert d["bytes_per_tier"]["nvme"] == d["nvme_bytes"] + 26_000_000_000
  assert d["nvme_disk_bytes"] == 4 * d["bytes_per_tier"]["nvme"]
  bw = oo.Bandwidths()
  assert d["step_times"]["nvme_read"] == (d["nvme_bytes"] + 2 * 26e9) / bw.nvme_read
  assert d["step_times"]["nvme_write"] == (d["nvme_bytes"] + 26e9) / bw.nvme_write
  weights = [
    p
    for p in oo.estimate(
      "13B",
      param_dtype="bf16",
      master_dtype="fp32",
      weights_on="host",
      layers=40,
      device_memory="24GiB",
      memory_fraction=0.75,
      host_memory="20GiB",
      nvme_size="2TB",
    ).placements
    if p.what.startswith("layer stack's weights")
  ]
  assert [(p.tier, p.nbytes) for p in weights] == [("nvme", 26_000_000_000)]
  assert weights[0].reason.startswith("the stack's weights (24.21 GiB) do not fit in --host-memory")
  # Asked for: the same plan, as asked.
  d_asked = _json([*GOAL[:13], "20GiB", "--nvme-size", "2TB", "--weights-on", "nvme"], capsys)
  assert d_asked["weights_on_reason"] == "as asked (--weights-on nvme)"
  assert d_asked["bytes_per_tier"] == d["bytes_per_tier"]
  with pytest.raises(ValueError, match='weights_on="nvme" needs the update in the backward pass'):
    oo.estimate("13B", weights_on="nvme", layers=40, update_in_backward=False)


def test_weights_that_do_not_fit_beside_the_buffers_never_fit(two_tb, capsys):
  # 16 GiB holds not even the NVMe buffers that the weights on NVMe would leave: they stay in
  # host memory and the plan does not fit.
  argv = [*GOAL[:13], "16GiB", "--nvme-size", "2TB"]
  assert cli.main(argv) == 1
  out = capsys.readouterr().out
  assert "fits: NO" in out and "fits: yes" not in out
  assert "or: oo.offload(..., host_memory=" not in out  # offload would refuse it
  assert "gradients and accumulators on NVMe are not implemented; the stack's weights go to" in out
  # All the state on NVMe: 26e9 B of weights + buffers 3 * 3.9e9 + 2 * 966_367_641 + 16_777_216
  # = 39.65e9 B.
  assert fused_buffers(STATE) == 13_649_512_498
  # (the budget that keeps them in RAM; first, the one from which the plan puts them on NVMe:
  # test_the_host_advice_names_the_budget_that_puts_the_weights_on_nvme)
  assert "or to at least 36.93 GiB to keep them in RAM" in out


def test_buffers_short_without_a_stack_name_only_the_buffers(tmp_path):
  # No layer stack in host memory: the advice neither names one nor the update in the backward
  # pass (what the multi-process refusal printed before).
  e = oo.estimate(10_000_000, param_dtype="fp32", host_memory="1MiB", nvme_dir=str(tmp_path))
  (short,) = e.shortfalls
  assert short.tier == "host"
  assert short.advice.startswith("NVMe staging buffers ")
  assert "stack" not in short.advice and "backward" not in short.advice
  assert "not implemented" not in short.advice
  assert f"at least {oo.format_bytes(e.nvme_buffer_bytes)}" in short.advice


def test_refusing_the_update_in_backward_leaves_no_room_for_the_grads(capsys):
  d = _json([*GOAL, "--nvme-size", "2TB", "--update-in-backward", "no"], capsys, status=1)
  assert not d["update_in_backward"]
  assert d["update_in_backward_reason"] == "as asked (--update-in-backward no)"
  (short,) = d["shortfalls"]
  assert short["tier"] == "host" and short["needed"] == 52_000_000_000 + HAND_BUFFERS
  assert "--update-in-backward yes" in short["advice"]


def test_accumulators_count_against_the_host_budget(capsys):
  # fp32 accumulators, 4 B x 13e9 = 52e9 B: they do not fit beside the weights in 48 GiB.
  d = _json([*GOAL, "--nvme-size", "2TB", "--accumulate", "8"], capsys, status=1)
  assert d["update_in_backward"] and d["accumulator_bytes"] == 52_000_000_000
  assert "--accumulate 1" in d["shortfalls"][0]["advice"]
  # With 128 GiB they do; accumulating chose the update in the backward pass.
  d = _json([*GOAL[:13], "128GiB", "--nvme-size", "2TB", "--accumulate", "8"], capsys)
  assert d["fits"] and "accumulate=8" in d["update_in_backward_reason"]
  assert d["nvme_buffer_bytes"] == fused_buffers(d["nvme_bytes"])
  assert 128 * GiB - 8192 < d["host_total_bytes"] <= 128 * GiB
  assert d["host_total_bytes"] == (
    26_000_000_000 + 52_000_000_000 + d["host_bytes"] + d["nvme_buffer_bytes"]
  )
  # On the device: 7 + 4 layers of bf16 weights and grads, 3 layers of fp32 accumulator rows
  # (325e6 params a layer), and the window.
  assert d["bytes_per_tier"]["device"] == 11 * 650_000_000 + 3 * 4 * 325_000_000 + HAND_WINDOW
  # Per step the weights cross the link 2 x 8 + 1 times, the accumulators 2 x 7, the state twice.
  assert d["link_bytes"] == 2 * 156_000_000_000 + 17 * 26_000_000_000 + 14 * 52_000_000_000


def test_bf16_accumulators_take_half_the_bytes(capsys):
  # bf16 accumulators, 2 B x 13e9 = 26e9 B: beside the weights (26e9 B) they still exceed 48 GiB
  # (51.54e9 B) with the NVMe buffers, and the shortfall names them. (The weights stay: on NVMe
  # the drive would read them 16 times a step.)
  bf16 = ["--accumulate", "8", "--accumulator-dtype", "bf16"]
  d = _json([*GOAL, "--nvme-size", "2TB", *bf16], capsys, status=1)
  assert d["accumulator_bytes"] == 26_000_000_000 and d["accumulator_dtype"] == "bf16"
  assert "gradient accumulators" in d["shortfalls"][0]["advice"]
  assert d["weights_on"] == "host"
  # Asked for, the weights go to NVMe, read twice a micro-batch.
  d = _json([*GOAL, "--nvme-size", "2TB", *bf16, "--weights-on", "nvme"], capsys)
  assert d["weights_on"] == "nvme" and d["host_total_bytes"] <= 48 * GiB
  assert d["step_times"]["nvme_read"] == (d["nvme_bytes"] + 16 * 26e9) / oo.Bandwidths().nvme_read
  # 72 GiB holds them: weights + accumulators + state + buffers fill it; on the device 3 layers of
  # bf16 accumulator rows (325e6 params a layer) beside 7 + 4 layers and the window.
  d = _json([*GOAL[:13], "72GiB", "--nvme-size", "2TB", *bf16], capsys)
  assert d["fits"] and 72 * GiB - 8192 < d["host_total_bytes"] <= 72 * GiB
  assert d["host_total_bytes"] == (
    26_000_000_000 + 26_000_000_000 + d["host_bytes"] + d["nvme_buffer_bytes"]
  )
  assert d["bytes_per_tier"]["device"] == 11 * 650_000_000 + 3 * 2 * 325_000_000 + HAND_WINDOW


def test_integer_accumulators_are_refused():
  with pytest.raises(ValueError, match="accumulator_dtype must be a floating dtype"):
    oo.estimate(
      13e9, param_dtype="bf16", weights_on="host", layers=40, accumulate=2, accumulator_dtype="int8"
    )


def test_the_pinned_pool_setting_is_named(monkeypatch, capsys):
  # 7B bf16 with an fp32 master copy: 12 B x 7e9 = 84e9 B of state, all in host memory, more
  # than JAX's 64 GiB pool, so the plan names the setting: ceil(84e9 / 2**30) = 79.
  argv = ["plan", "7B", "--param-dtype", "bf16", "--master-dtype", "fp32", "--host-memory", "96GiB"]
  d = _json(argv, capsys)
  assert d["pinned_bytes"] == 84_000_000_000
  assert d["pinned_pool"]["setting"] == "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=79"
  assert cli.main(argv) == 0
  assert (
    "set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=79 (or more) before JAX starts"
    in capsys.readouterr().out
  )
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "80")
  assert _json(argv, capsys)["pinned_pool"]["setting"] is None


def test_device_memory_is_the_card_and_jax_takes_its_fraction(monkeypatch, capsys):
  argv = ["plan", "1B", "--device-memory", "24GiB"]
  assert _json(argv, capsys)["device_memory"] == int(0.75 * 24 * GiB)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
  d = _json(argv, capsys)
  assert (d["device_memory"], d["memory_fraction"]) == (int(0.95 * 24 * GiB), 0.95)
  assert cli.main(argv) == 0
  assert (
    "0.95 of the 24.00 GiB card (XLA_PYTHON_CLIENT_MEM_FRACTION=.95)" in capsys.readouterr().out
  )
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "most")
  with pytest.raises(SystemExit) as exc:
    cli.main(argv)
  assert exc.value.code == 2 and "XLA_PYTHON_CLIENT_MEM_FRACTION" in capsys.readouterr().err
  # The Python API keeps device_memory as what JAX may take unless a fraction is given.
  assert oo.estimate("1B", device_memory="24GiB").device_memory == 24 * GiB


def test_nvme_dir_is_checked(tmp_path, capsys, monkeypatch):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for bad, message in (
    (a_file, "exists and is not a directory"),
    (a_file / "run1", "cannot be created"),
  ):
    with pytest.raises(SystemExit) as exc:
      cli.main(["plan", "1B", "--nvme-dir", str(bad)])
    assert exc.value.code == 2 and message in capsys.readouterr().err
  # A directory still to be created is fine, and is not created by planning.
  assert cli.main(["plan", "1B", "--nvme-dir", str(tmp_path / "new" / "run1")]) == 0
  assert not (tmp_path / "new").exists()
  capsys.readouterr()
  # Its free space bounds --nvme-size.
  monkeypatch.setattr(estimate_lib, "free_disk", lambda path: 100 * GiB)
  d = _json([*GOAL, "--nvme-dir", str(tmp_path), "--nvme-size", "2TB"], capsys, status=1)
  (short,) = d["shortfalls"]
  assert short["tier"] == "nvme" and short["available"] == 100 * GiB
  assert short["needed"] == 4 * d["nvme_bytes"] and d["nvme_bytes"] > 139e9


def test_host_memory_with_shapes_places_the_stack_weights_first(tmp_path):
  # A stack of 8 layers of 512 x 512 bf16 in pinned host memory and a head on the device; the
  # budget holds the weights, the buffers and part of the state (one I/O thread: one write
  # request's staging, which at this size would otherwise take most of the budget).
  params = {
    "layers": one_device_bf16((8, 512, 512), "pinned_host"),
    "head": jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
  }
  weights = 8 * 512 * 512 * 2  # 4 MiB; the state, 12 B/param, is 30 MiB with the head's
  budget = weights + (28 << 20)
  e = oo.estimate(
    params, master_dtype="fp32", window_bytes="16MiB", host_memory=budget, nvme_size="1GB",
    update_in_backward=True, nvme_options=ONE_IO_THREAD,
  )  # fmt: skip
  assert e.update_in_backward and e.host_weight_bytes == weights
  assert e.nvme_bytes > 0 and e.host_bytes > 0
  assert e.host_total_bytes <= budget and e.fits
  assert e.host_bytes + e.nvme_bytes == e.offloaded_bytes


def test_bad_budget_options(capsys):
  for argv, message in (
    ([*GOAL, "--host-memory", "lots"], "Could not parse host_memory"),
    (["plan", "7B", "--update-in-backward", "yes"], "needs a layer stack"),
    (["plan", "7B", "--accumulate", "4"], "--weights-on host --layers N"),
    (["plan", "7B", "--accumulate", "0"], "accumulate must be an int >= 1"),
    (["plan", "7B", "--host-memory-band", "5GB"], "unrecognized arguments: --host-memory-band"),
  ):
    with pytest.raises(SystemExit) as exc:
      cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err, argv


def test_fused_nvme_buffers_from_shapes_hold_two_row_slices():
  # A stack of 8 rows of 512 x 512 bf16, its state on NVMe: 3 MiB of fp32 master and moments per
  # row, 1 MiB of bf16 weights and gradients moving with it. A 9.5 MiB window holds groups of
  # 9.5 / 2.25 = 4.2 MiB: one row each (4 MiB with its weights and gradients; the store group holds
  # the row's 3 MiB of state). The update in the backward pass holds the groups of a pair of rows
  # (2 x 3 MiB) and a GPU callback's copy of one row (3 MiB: the pair's streamed update moves one
  # row a group, 2 x 3 MiB of state exceeding a group), beside one group read ahead and one
  # written behind (2 x 3 MiB) and one I/O thread's write staging (a request of at most a group,
  # 3 MiB): 18 MiB; weights 4 MiB; 22 MiB.
  params = {"layers": one_device_bf16((8, 512, 512), "pinned_host")}
  kwargs = dict(
    master_dtype="fp32", host_memory="25MiB", nvme_size="1GB", nvme_options=ONE_IO_THREAD
  )
  e = oo.estimate(params, window_bytes="9.5MiB", update_in_backward=True, **kwargs)
  MiB = 2**20
  assert len(e.plan.units) == 8 and e.nvme_bytes == 24 * MiB and e.host_bytes == 0
  assert e.nvme_group_bytes == 3 * MiB
  assert e.nvme_buffer_bytes == 18 * MiB and e.host_total_bytes == 22 * MiB and e.fits
  # After the backward pass instead: 4 groups of 3 MiB (one read ahead, one read from, one written
  # behind, the put's copy) and the staging, and the gradients (4 MiB) in host memory.
  e = oo.estimate(params, window_bytes="9.5MiB", update_in_backward=False, **kwargs)
  assert e.nvme_buffer_bytes == 15 * MiB and e.host_total_bytes == 4 * MiB + 4 * MiB + 15 * MiB


def test_accumulator_dtype_without_accumulation_is_refused(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main([*GOAL, "--nvme-size", "2TB", "--accumulator-dtype", "bf16"])
  assert exit_.value.code == 2
  assert "give --accumulate K (K >= 2)" in capsys.readouterr().err
  # Without accumulators an estimate names no accumulator dtype.
  e = oo.estimate(13e9, param_dtype="bf16", weights_on="host", layers=40, accumulator_dtype="bf16")
  assert e.accumulator_bytes == 0 and e.accumulator_dtype is None


def test_stack_leaves_kept_on_the_device_hold_their_nvme_state_with_the_pair():
  # As above, with a second leaf of the stack ("v", 8 rows of 512 x 512 bf16) kept on the device:
  # its weights leave the host budget, its state (3 MiB a row) streams with the stack's, and the
  # pair being updated holds 2 rows of each leaf (12 MiB) and a GPU callback's copy of one row of
  # one leaf (3 MiB: one callback a group of the pair's streamed update) beside the 2 groups
  # (2 x 3 MiB) and the staging (3 MiB).
  layer = (8, 512, 512)
  params = {
    "layers": {
      "w": one_device_bf16(layer, "pinned_host"),
      "v": one_device_bf16(layer),
    }
  }
  e = oo.estimate(
    params, window_bytes="9.5MiB", update_in_backward=True, master_dtype="fp32",
    host_memory="37MiB", nvme_size="1GB", nvme_options=ONE_IO_THREAD,
  )  # fmt: skip
  MiB = 2**20
  assert e.host_weight_bytes == 4 * MiB and e.stack_device_bytes == 4 * MiB
  assert e.nvme_bytes == 48 * MiB and e.host_bytes == 0
  assert e.nvme_buffer_bytes == 24 * MiB and e.host_total_bytes == 28 * MiB and e.fits
  kept = [p for p in e.placements if p.what == "layer stack's leaves kept on the device"]
  assert [(p.tier, p.nbytes) for p in kept] == [("device", 4 * MiB)]  # no whole gradients
  for tier in ("device", "host"):  # the placements add up to the tiers
    assert sum(p.nbytes for p in e.placements if p.tier == tier) == e.bytes_per_tier[tier], tier


def test_stack_on_device_takes_weights_and_accumulators_out_of_the_host_budget(capsys):
  # 4 GB of the 26 GB of bf16 weights kept on the card: 2e9 params. The host holds 22e9 B of
  # weights and 22e9 B of bf16 accumulators (8 micro-batches), the card those 4e9 B and their 4e9 B
  # of gradients beside the streamed layers; the state (all 13e9 params') is as before.
  argv = [*GOAL[:13], "128GiB", "--nvme-size", "2TB", "--accumulate", "8"]
  argv += ["--accumulator-dtype", "bf16"]
  whole = _json(argv, capsys)
  d = _json([*argv, "--stack-on-device", "4GB"], capsys)
  assert d["fits"] and d["stack_device_bytes"] == 4_000_000_000
  assert d["accumulator_bytes"] == 22_000_000_000
  assert d["host_total_bytes"] == (
    22_000_000_000 + 22_000_000_000 + d["host_bytes"] + d["nvme_buffer_bytes"]
  )
  assert d["bytes_per_tier"]["device"] == whole["bytes_per_tier"]["device"] + 8_000_000_000 - (
    11 * 100_000_000 + 3 * 2 * 50_000_000  # the streamed layers' share of the kept weights
  )
  assert d["host_bytes"] + d["nvme_bytes"] == whole["host_bytes"] + whole["nvme_bytes"]
  kept = [p for p in d["placements"] if p["what"] == "layer stack's leaves kept on the device"]
  assert [(p["tier"], p["nbytes"]) for p in kept] == [("device", 8_000_000_000)]  # + accumulators
  for tier in ("device", "host"):  # the placements add up to the tiers
    placed = sum(p["nbytes"] for p in d["placements"] if p["tier"] == tier)
    assert placed == d["bytes_per_tier"][tier], tier


def test_stack_on_device_is_refused_where_it_cannot_apply(capsys):
  for argv, message in (
    ([*GOAL, "--stack-on-device", "26GB"], "must be less than the stack's"),
    ([*GOAL, "--stack-on-device", "lots"], "Could not parse stack_on_device"),
    (["plan", "7B", "--stack-on-device", "1GB"], 'needs weights_on="host"'),
  ):
    with pytest.raises(SystemExit) as exc:
      cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err, argv
  shapes = {"w": one_device_bf16((4, 8, 8), "pinned_host")}
  with pytest.raises(ValueError, match="with shapes, give the stack's leaves kept on the device"):
    oo.estimate(shapes, stack_on_device="1KiB")


def test_the_leaves_outside_the_stack_count_their_own_nvme_buffers():
  # With the update in the backward pass, leaves outside the stack (here a head of 12 MiB of fp32
  # state, one store group) are updated after it as `update_and_apply` updates its groups: one
  # read ahead, one read from, one written behind, the put's copy (4 x 12 MiB) and the staging
  # (one 4 MiB request). The stack's pair of rows is far smaller; the plan counts the larger.
  from optax_offload._src import plan as plan_lib

  params = {
    "layers": one_device_bf16((4, 128, 128), "pinned_host"),
    "head": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16),
  }
  e = oo.estimate(
    params, master_dtype="fp32", window_bytes="64MiB", host_limit=0, nvme_size="1GB",
    update_in_backward=True, nvme_options=ONE_IO_THREAD,
  )  # fmt: skip
  MiB = 2**20
  assert e.update_in_backward and e.nvme_group_bytes == 12 * MiB
  assert e.nvme_buffer_bytes == 4 * 12 * MiB + 4 * MiB
  assert e.nvme_buffer_bytes == plan_lib.nvme_buffer_bytes(12 * MiB, ONE_IO_THREAD)


def test_stacks_of_different_depths_hold_their_own_rows():
  # Two stacks in pinned host memory, of 8 and 4 rows of 512 x 512 bf16 (3 MiB of fp32 master and
  # moments a row), their state on NVMe in one-row slices (a 9.5 MiB window). The update in the
  # backward pass holds a pair of rows of each (2 x 3 MiB each: 12 MiB), a GPU callback's copy of
  # one row (3 MiB), a group read ahead and one written behind (6 MiB) and the staging (3 MiB):
  # 24 MiB. Each leaf counts by its own rows: the 4-row stack's by 8 would count 9 MiB held.
  params = {
    "deep": one_device_bf16((8, 512, 512), "pinned_host"),
    "shallow": one_device_bf16((4, 512, 512), "pinned_host"),
  }
  e = oo.estimate(
    params, window_bytes="9.5MiB", update_in_backward=True, master_dtype="fp32",
    host_memory="30MiB", nvme_size="1GB", nvme_options=ONE_IO_THREAD,
  )  # fmt: skip
  MiB = 2**20
  assert e.nvme_bytes == 36 * MiB and e.host_bytes == 0 and e.nvme_group_bytes == 3 * MiB
  assert e.nvme_buffer_bytes == 24 * MiB, e


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize(
  "window, kept",
  [("2.5GiB", ()), ("8GiB", ()), ("20GiB", ()), ("1GiB", ("w_gate", "w_up", "w_down"))],
)
def test_a_count_without_shapes_bounds_the_callbacks_copy(moments, window, kept):
  # The bare count cannot see the leaves: its bound on a GPU callback's copy (the larger of a
  # group's state and one layer's rows of all the NVMe state, at most the pair's rows) must hold
  # the largest piece that the plan from the shapes cuts: Llama-2-13B's layer stack, all its state
  # on NVMe, for windows whose groups hold one row of w_down up to pairs of every leaf; and with
  # the MLP's leaves kept on the device, whose rows (not streamed) may exceed a group (1 GiB).
  d, f, layers = 5120, 13824, 40
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f)}
  shapes.update(w_up=(d, f), w_down=(f, d), norm=(d,))
  params = {
    k: one_device_bf16((layers, *s), None if k in kept else "pinned_host")
    for k, s in shapes.items()
  }
  kwargs = dict(master_dtype="fp32", moment_dtype=None if moments == "fp32" else moments)
  e = oo.estimate(
    params, window_bytes=window, update_in_backward=True, host_limit=0, nvme_size="2TB", **kwargs
  )
  assert e.host_bytes == 0 and e.nvme_bytes > 0
  stack = [
    host_budget.StackLeaf(x.size * 2, layers, x.size, x.size * 2)
    for k, x in params.items()
    if k not in kept
  ]
  on_device = estimate_lib._stack_leaves_on_device(params)
  assert len(on_device) == len(kept)
  from_shapes = host_budget.fused_nvme_block(e, stack, on_device)
  bare = host_budget.fused_nvme_block(dataclasses.replace(e, plan=None), stack, on_device)
  pair = 2 * -(-e.nvme_bytes // layers)
  assert from_shapes <= bare <= pair, (from_shapes, bare, pair)


def test_update_in_backward_given_as_a_numpy_bool_or_an_int_is_taken_as_given():
  # Where the planner would choose the update in the backward pass (the whole gradients do not fit
  # beside the state), a "no" given as numpy's False or 0 is a no, as False is; and a "yes" given
  # as numpy's True or 1 a yes where it would not, as True is.
  import numpy as np

  kwargs = dict(weights_on="host", layers=16, host_memory="15GB")
  assert oo.estimate("1B", **kwargs).update_in_backward
  for no in (False, np.False_, 0):
    e = oo.estimate("1B", update_in_backward=no, **kwargs)
    assert e.update_in_backward is False and "as asked" in e.update_in_backward_reason, repr(no)
  roomy = dict(kwargs, host_memory="100GB")  # where the planner says no
  assert not oo.estimate("1B", **roomy).update_in_backward
  for yes in (True, np.True_, 1):
    e = oo.estimate("1B", update_in_backward=yes, **roomy)
    assert e.update_in_backward is True and "as asked" in e.update_in_backward_reason, repr(yes)
    with pytest.raises(ValueError, match="update_in_backward needs a layer stack"):
      oo.estimate("1B", update_in_backward=yes)


def test_a_stack_in_pinned_host_memory_counts_its_host_copies_and_its_device_bytes_whole():
  # Host memory: what this process holds (a replicated stack, a copy per device); the device
  # figures count the params whole, as for every param.
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

  def estimate(stack_sharding, head_sharding):
    params = {
      "layers": jax.ShapeDtypeStruct((4, 256, 256), jnp.float32, sharding=stack_sharding),
      "head": jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=head_sharding),
    }
    return oo.estimate(params, optimizer=optax.adam(1e-3))

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  one = estimate(device.with_memory_kind("pinned_host"), device)
  pinned = lambda spec: jax.NamedSharding(mesh, spec, memory_kind="pinned_host")  # noqa: E731
  sharded = estimate(pinned(jax.P("x")), jax.NamedSharding(mesh, jax.P()))
  replicated = estimate(pinned(jax.P()), jax.NamedSharding(mesh, jax.P()))
  stack = 4 * 256 * 256 * 4
  for e in (one, sharded, replicated):
    assert (e.param_bytes, e.grad_bytes) == (256 * 256 * 4,) * 2
    assert e.stack_layer_bytes == one.stack_layer_bytes > 0
  assert one.host_weight_bytes == sharded.host_weight_bytes == 2 * stack  # weights, gradients
  assert replicated.host_weight_bytes == 2 * one.host_weight_bytes


def _stack_plan(model: str, layers: int, tmp_path, *extra: str) -> list[str]:
  """`plan` of a bf16 model with an fp32 master copy and its layer stack in host memory, on a
  24 GiB card with an NVMe directory under `tmp_path`."""
  return [
    "plan", model, "--param-dtype", "bf16", "--master-dtype", "fp32", "--weights-on", "host",
    "--layers", str(layers), "--device-memory", "24GiB", "--nvme-dir", str(tmp_path / "run1"),
    *extra,
  ]  # fmt: skip


def test_the_host_advice_names_the_budget_that_puts_the_weights_on_nvme(tmp_path, two_tb, capsys):
  # 13B's weights fit in 16 GiB of host memory neither in RAM nor on NVMe (whose buffers need
  # RAM too): the advice named 37.63 GiB (the weights kept in RAM), twice what a plan with them on
  # NVMe needs, which the planner picks itself from that budget on (helper review /tmp/revA).
  argv = _stack_plan("13B", 40, tmp_path, "--window-bytes", "2.5GiB")
  d = _json([*argv, "--host-memory", "16GiB"], capsys, status=1)
  (short,) = d["shortfalls"]
  floor = d["host_memory_with_weights_on_nvme"]
  assert short["tier"] == "host" and 16 * GiB < floor < d["host_total_bytes"] / 2
  given = re.search(r"at least ([0-9.]+ GiB), where the plan puts", short["advice"]).group(1)
  assert given.replace(" ", "") != "16.00GiB"
  fits = _json([*argv, "--host-memory", given.replace(" ", "")], capsys)
  assert fits["fits"] and fits["weights_on"] == "nvme" and fits["host_total_bytes"] >= floor
  assert (
    _json([*argv, "--host-memory", str(floor - 2**20) + "B"], capsys, status=1)["weights_on"]
    == "host"
  )


def test_a_plan_keeping_the_gradients_whole_names_the_faster_one(tmp_path, two_tb, capsys):
  # 7B at 48 GiB: the whole gradients fit, so the planner keeps them, though the update in the
  # backward pass moves fewer bytes (helper review /tmp/revA: 53.6 s against 44.5 s, unsaid).
  argv = _stack_plan("7B", 32, tmp_path, "--host-memory", "48GiB")
  d = _json(argv, capsys)
  assert not d["update_in_backward"] and d["fits"]
  fused = _json([*argv, "--update-in-backward", "yes"], capsys)
  assert fused["fits"] and d["step_s_in_backward"] == fused["step_time_lower_bound"]
  assert fused["step_time_lower_bound"] < 0.95 * d["step_time_lower_bound"]
  assert cli.main(argv) == 0
  assert (
    f"bounds a step at {fused['step_time_lower_bound']:.1f} s instead of "
    f"{d['step_time_lower_bound']:.1f} s" in capsys.readouterr().out
  )
  assert fused["step_s_in_backward"] is None


def test_weights_beyond_the_budget_without_an_nvme_tier_name_the_budget_that_fits(capsys):
  # Without an NVMe tier the state stays in host memory too: the advice named only the weights'
  # 24.21 GiB, and a plan at that budget gave the same advice again (helper review /tmp/revI).
  argv = [*GOAL[:13], "16GiB"]
  d = _json(argv, capsys, status=1)
  (short,) = d["shortfalls"]
  assert d["bytes_per_tier"]["nvme"] == 0
  assert "no NVMe tier" in short["advice"] and "give an NVMe tier (--nvme-dir)" in short["advice"]
  at_least = re.search(r"raise --host-memory to at least (\S+ GiB)", short["advice"]).group(1)
  # Following the advice, the host fits (the size is rounded up, not to the nearest).
  assert cli.main([*GOAL[:13], at_least.replace(" ", "")]) == 0
  assert "fits: yes" in capsys.readouterr().out
  # The host line says the state is all there, not "what --host-memory leaves".
  assert cli.main(argv) == 1
  assert "(all of it: no NVMe tier)" in capsys.readouterr().out


def test_a_small_disk_under_nvme_dir_is_not_told_to_pass_a_larger_nvme_size(
  tmp_path, monkeypatch, capsys
):
  # --nvme-size only lowers the free space of --nvme-dir's disk: the advice said to pass a larger
  # one, which changed nothing (helper review /tmp/revK).
  monkeypatch.setattr(estimate_lib, "free_disk", lambda path: 80 * GiB)
  d = _json([*GOAL, "--nvme-dir", str(tmp_path), "--nvme-size", "2TB"], capsys, status=1)
  (short,) = [s for s in d["shortfalls"] if s["tier"] == "nvme"]
  assert (
    "--nvme-size only lowers it" in short["advice"]
    and "larger --nvme-size" not in (short["advice"])
  )
  # Without a directory the size given is the disk: a larger one is the fix.
  d = _json([*GOAL, "--nvme-size", "80GiB"], capsys, status=1)
  (short,) = [s for s in d["shortfalls"] if s["tier"] == "nvme"]
  assert "or pass a larger --nvme-size" in short["advice"]
