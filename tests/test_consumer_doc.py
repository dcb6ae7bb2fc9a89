"""docs/consumer.md: every `plan` output it shows is the command's output today, and every size its
prose states is in one of those outputs; docs/tiers.md's `plan` outputs too."""

import contextlib
import io
import os
import pathlib
import re
import shlex

import pytest

from optax_offload._src import cli
from optax_offload._src import estimate as estimate_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "consumer.md"
TWO_TB = 2_000_000_000_000  # the page's drive: 2 TB, empty
WINDOW_FIGURES = ("1.05 GiB", "2.37 GiB", "1.80 GiB")  # test_the_window_the_page_asks_for
SPEED_PAGE_FIGURES = (
  "18.6 GiB",
  "15.8 GiB",
  "17.5 GiB",
  "15.6 GiB",
)  # test_the_speed_page_figures_it_cites
NVME_PLAN_FIGURES = (
  "130.08 GiB",
  "47.91 GiB",
  "78.91 GiB",
  "47.77 GiB",
  "59.49 GiB",
  "42.81 GiB",
)  # test_the_nvme_plan_...
# The --host-memory of speed.md's accumulation rows (modelled once, by the commands there).
ACCUMULATION_FIGURES = ("60 GiB",)
# speed.md's 48 GiB rows with wq and wo on the card: plan bytes pinned by
# test_the_rows_with_leaves_kept_on_the_card, the card's bytes compiled once (in speed.md); the
# card's bytes of the program with one callback a block (21.4 GiB), as the page says.
KEPT_FIGURES = ("47.44 GiB", "47.32 GiB", "21.0 GiB", "21.4 GiB", "39.45 GiB", "6.14 GiB")
# The --head-moment-dtype paragraph: plan bytes pinned by test_the_heads_fp32_moments_plan; the
# card's bytes (both runs) compiled once by hand, as the page says.
HEAD_FIGURES = ("46.52 GiB", "71.27 GiB", "73.10 GiB", "20.99 GiB")
# docs/layers.md's modelled rows of a LoRA step on a frozen base on NVMe (benchmarks/nvme_stack.py
# gpu), cited by section 5: test_the_frozen_base_figures_it_cites.
NVME_STACK_FIGURES = ("120.63 GiB", "7.99 GiB", "23.63 GiB", "45 tokens/s", "1,296 tokens/s")
_PAIR = re.compile(r"```sh\n(python -m optax_offload plan .*?)```\n\n```text\n(.*?)```", re.S)


def plan_blocks(text: str) -> list[tuple[list[str], str]]:
  """(argv, shown output) for each `plan` command of the page followed by its output block."""
  out = []
  for command, shown in _PAIR.findall(text):
    argv = shlex.split(command.replace("\\\n", " "))[3:]
    out.append((argv, shown))
  return out


def run_plan(argv: list[str], nvme_dir: str) -> str:
  argv = [nvme_dir if a == "/nvme/run1" else a for a in argv]
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(argv)
  return buf.getvalue()


def segments(shown: str) -> list[str]:
  """The parts of a shown output between ``...`` lines (each must appear whole, in order)."""
  return [s.strip("\n") for s in re.split(r"^\.\.\.\n", shown, flags=re.M) if s.strip()]


@pytest.fixture
def page_machine(monkeypatch, tmp_path):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
  monkeypatch.setattr(estimate_lib, "free_disk", lambda path: TWO_TB)
  # (the page's /nvme is mounted: the disk line names no other folder)
  monkeypatch.setattr(estimate_lib, "nearest_existing", os.path.abspath)
  return str(tmp_path / "run1")


def test_the_page_shows_each_plan_as_printed(page_machine):
  text = PAGE.read_text()
  blocks = plan_blocks(text)
  assert len(blocks) == 6
  outputs = []
  for argv, shown in blocks:
    printed = run_plan(argv, page_machine)
    outputs.append(printed)
    at = 0
    for seg in segments(shown):
      found = printed.find(seg, at)
      assert found >= 0, f"{argv}: not printed (in this order):\n{seg}"
      at = found + len(seg)
  # The first is shown whole, and fits.
  assert segments(blocks[0][1]) == [outputs[0].strip("\n")] and "fits: yes" in outputs[0]
  # Every size and rate the prose states comes from those outputs.
  prose = _PAIR.sub("", text)
  for figure in re.findall(r"\d+(?:\.\d+)? GiB|\d[\d,]* tokens/s", prose):
    cited = figure in (
      WINDOW_FIGURES
      + SPEED_PAGE_FIGURES
      + NVME_PLAN_FIGURES
      + ACCUMULATION_FIGURES
      + KEPT_FIGURES
      + NVME_STACK_FIGURES
      + HEAD_FIGURES
    )
    assert cited or any(figure in o for o in outputs), figure


def test_the_tiers_page_shows_each_plan_as_printed(page_machine):
  """docs/tiers.md's `plan` outputs (a 7B on a 24 GiB card, the state, then the weights too), each
  printed whole; and its prose: on an 80 GiB card the first fits, with the same bound."""
  text = (ROOT / "docs" / "tiers.md").read_text()
  blocks = plan_blocks(text)
  assert len(blocks) == 2
  for argv, shown in blocks:
    assert segments(shown) == [run_plan(argv, page_machine).strip("\n")], argv
  argv = [("80GiB" if a == "24GiB" else a) for a in blocks[0][0]]
  printed = run_plan(argv, page_machine)
  assert "fits: yes" in printed and "step time lower bound: 12.734 s" in printed
  assert (
    "On an 80 GiB card the same command prints\n`fits: yes`, with the same 12.7 s bound" in text
  )


def test_the_frozen_base_figures_it_cites():
  layers = (ROOT / "docs" / "layers.md").read_text()
  for row in (
    "| 70B (base 120.63 GiB) | 1 x 2048 | 7.99 GiB | 35.16 s | 5.80 s | 39.37 s | 45.17 s | 45 |",
    "| 70B | 2 x 2048 | 12.09 GiB | 35.16 s | 11.53 s | 33.65 s | 45.17 s | 91 |",
    "| 13B | 8 x 2048 | 17.82 GiB | 6.97 s | 10.10 s | 2.53 s | 12.64 s | 1,296 |",
    "| 13B (base 23.63 GiB) | 1 x 2048 | 3.44 GiB | 6.97 s | 1.27 s | 7.69 s | 8.96 s | 229 |",
  ):
    assert row in layers, row
  section = PAGE.read_text().split("## 5. Adapters on a base larger than RAM")[1]
  for figure in ("35.16 s", "45.17 s", "6.97 s", "10.10 s", "(45 tokens/s; 91 at batch 2)"):
    assert figure in section, figure


def test_the_speed_page_figures_it_cites():
  speed = (ROOT / "docs" / "speed.md").read_text()
  assert (
    "| 13B, `rtx4090_24gb` | `fused_all` | 524,288 | 391 s | 367 s | 1.07 | 1,340 | **104.7** "
    "| 18.6 GiB | yes |" in speed
  )


NVME_ROWS = (  # speed.md's fused_nvme rows that this page's table cites (modelled once each)
  "| `fused_nvme`, fp32 moments, 7 x 2,048 | 14,336 | 116.1 s | 10.6 s | 111.8 s | 91.9 s | 124 "
  "| **9.6** | 15.8 GiB | 47.91 GiB | 130.08 GiB | yes |",
  "| `fused_nvme`, bf16 moments, 7 x 2,048 | 14,336 | 76.3 s | 10.7 s | 67.8 s | 58.0 s | 188 "
  "| **14.7** | 17.5 GiB | 47.77 GiB | 78.91 GiB | yes |",
  "| `fused_nvme`, 8-bit moments, 7 x 2,048 | 14,336 | 57.9 s | 11.6 s | 51.1 s | 39.0 s | 247 "
  "| **19.3** | 15.6 GiB | 42.81 GiB | 59.49 GiB | yes |",
)
MOMENTS = {"fp32": "fp32 moments", "bf16": "bf16 moments", "int8": "8-bit moments"}


def test_the_nvme_rows_it_cites():
  speed = (ROOT / "docs" / "speed.md").read_text()
  page = PAGE.read_text()
  for row, moments in zip(
    NVME_ROWS, ("fp32 moments (exact AdamW)", "bf16 moments", "8-bit moments")
  ):
    assert row in speed
    cells = [c.strip(" *") for c in row.strip("|").split("|")]
    tokens, step, _, disk, _, _, tflops, device, host, nvme, _ = cells[1:]
    cited = f"| {moments} | {tokens} | {step} | {disk} | {tflops} | {device} | {host} | {nvme} |"
    assert cited in page


@pytest.mark.parametrize(
  "moments, nvme, host, disk_s",
  [
    ("fp32", "130.08 GiB", "47.91 GiB", "111.8 s"),
    ("bf16", "78.91 GiB", "47.77 GiB", "67.8 s"),
    ("int8", "59.49 GiB", "42.81 GiB", "51.1 s"),
  ],
)
def test_the_nvme_plan_and_disk_seconds_the_pages_state(moments, nvme, host, disk_s, page_machine):
  # The placement gpu_speed's fused_nvme compiles (the plan from Llama-2-13B's shapes for 48 GiB
  # of host memory), and the drive's seconds a step at hosts.toml's rates: the state read once
  # and written once.
  import argparse

  import optax_offload as oo
  from benchmarks import gpu_speed
  from benchmarks import llama
  from optax_offload._src.units import format_bytes

  args = argparse.Namespace(host_memory=48 << 30, moment_dtype=moments, nvme_dir=page_machine)
  window = int(0.1 * gpu_speed.MEMORY["rtx4090_24gb"])  # gpu_speed's default window
  e = gpu_speed.nvme_plan(llama.CONFIGS["13B"], "rtx4090_24gb", args, window)
  assert (format_bytes(e.nvme_bytes), format_bytes(e.host_total_bytes)) == (nvme, host)
  assert e.host_total_bytes <= args.host_memory and e.fits
  hw = oo.hardware("rtx4090_24gb", "desktop")
  seconds = e.nvme_bytes / hw.nvme_read + e.nvme_bytes / hw.nvme_write
  assert f"{seconds:.1f} s" == disk_s
  for row in NVME_ROWS:  # in speed.md: test_the_nvme_rows_it_cites
    if f"{MOMENTS[moments]}," in row:
      assert f"| {disk_s} |" in row and f"| {nvme} |" in row and f"| {host} |" in row


def test_the_window_the_page_asks_for():
  # The page's --window-bytes 2.5GiB: a group (window / 2.25) must hold one layer's row of
  # Llama-2-13B's w_down (5120 x 13824, bf16 weights and gradients, fp32 master and moments):
  # 70,778,880 x 16 B = 1.05 GiB, so a window of at least 2.37 GiB; the default, 10% of the 18 GiB
  # JAX takes of a 24 GiB card, is 1.80 GiB.
  import jax
  import jax.numpy as jnp

  import optax_offload as oo

  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
  shapes = {"w_down": jax.ShapeDtypeStruct((40, 13824, 5120), jnp.bfloat16, sharding=host)}
  kwargs = dict(master_dtype="fp32", device_memory="24GiB", memory_fraction=0.75)
  with pytest.raises(
    ValueError, match=r"window_bytes 1\.80 GiB .* 1\.05 GiB .* at least 2\.37 GiB"
  ):
    oo.estimate(shapes, **kwargs)
  assert oo.estimate(shapes, window_bytes="2.5GiB", **kwargs).fits
  # With 8-bit moments the row is 70,778,880 x about 10 B (2 + 2 + 4 + two 1-byte codes, and
  # their blocks' scales): 0.66 GiB, so the script's 1.8 GiB window holds it.
  assert oo.estimate(shapes, window_bytes="1.8GiB", moment_dtype="int8", **kwargs).fits
  for argv, _ in plan_blocks(PAGE.read_text()):
    window = argv[argv.index("--window-bytes") + 1]
    assert window == "2.5GiB" or (window == "1.8GiB" and "int8" in argv), argv


ACCUMULATION_ROWS = [
  # (moments, --host-memory, micro-batches, NVMe, host, disk busy, fits): speed.md's accumulation
  # table (bf16 accumulators), whose plan bytes and disk seconds are arithmetic: pinned here.
  ("fp32", "60 GiB", 40, "143.63 GiB", "58.95 GiB", "123.5 s", True),
  ("bf16", "60 GiB", 40, "94.53 GiB", "56.56 GiB", "81.3 s", True),
  ("bf16", "48 GiB", 40, "96.98 GiB", "54.29 GiB", "83.4 s", False),
  ("int8", "60 GiB", 24, "71.27 GiB", "55.84 GiB", "61.3 s", True),
]


@pytest.mark.parametrize("moments, host_memory, k, nvme, host, disk_s, fits", ACCUMULATION_ROWS)
def test_the_accumulation_rows_plan_bytes_and_disk_seconds(
  moments, host_memory, k, nvme, host, disk_s, fits, page_machine
):
  import argparse

  import optax_offload as oo
  from benchmarks import gpu_speed
  from benchmarks import llama
  from optax_offload._src.units import format_bytes

  budget = int(host_memory.split()[0]) << 30
  args = argparse.Namespace(host_memory=budget, moment_dtype=moments, nvme_dir=page_machine)
  window = int(0.1 * gpu_speed.MEMORY["rtx4090_24gb"])
  e = gpu_speed.nvme_plan(llama.CONFIGS["13B"], "rtx4090_24gb", args, window, k, "bf16")
  assert (format_bytes(e.nvme_bytes), format_bytes(e.host_total_bytes)) == (nvme, host)
  assert (e.host_total_bytes <= budget) == fits
  hw = oo.hardware("rtx4090_24gb", "desktop")
  assert f"{e.nvme_bytes / hw.nvme_read + e.nvme_bytes / hw.nvme_write:.1f} s" == disk_s
  label = {"fp32": "fp32 moments", "bf16": "bf16 moments", "int8": "8-bit moments"}[moments]
  speed = (ROOT / "docs" / "speed.md").read_text()
  rows = [
    r for r in speed.splitlines() if r.startswith(f"| {label}, {k} x 3 x 2,048 | {host_memory} |")
  ]
  assert rows, (label, k, host_memory)
  cells = [c.strip(" *") for c in rows[0].strip("|").split("|")]
  assert (cells[5], cells[10], cells[9], cells[11]) == (disk_s, nvme, host, "yes" if fits else "no")


def test_the_accumulation_figures_it_cites():
  # The page's accumulation paragraph cites speed.md's rows.
  speed = (ROOT / "docs" / "speed.md").read_text()
  page = PAGE.read_text()
  for row, cited in [
    ("| fp32 moments, 40 x 3 x 2,048 | 60 GiB | 245,760 |", ("62.8", "123 s")),
    ("| bf16 moments, 40 x 3 x 2,048 | 60 GiB | 245,760 |", ("71.9", "81 s")),
  ]:
    (line,) = [r for r in speed.splitlines() if r.startswith(row)]
    cells = [c.strip(" *") for c in line.strip("|").split("|")]
    assert cells[7] == cited[0] and cells[5].startswith(cited[1].split()[0])
    assert cited[0] in page and cited[1] in page


KEPT_ON_THE_CARD_ROWS = [
  # (moments, --host-memory, micro-batches, NVMe, host, disk busy, fits): speed.md's table with wq
  # and wo kept on the device, micro-batches of 2 x 2,048, a 7.5% window; plan bytes and disk
  # seconds pinned.
  ("int8", 48, 60, "71.27 GiB", "47.44 GiB", "61.3 s", True),
  ("bf16", 48, 60, "96.97 GiB", "47.32 GiB", "83.4 s", True),
]


@pytest.mark.parametrize("moments, host_gib, k, nvme, host, disk_s, fits", KEPT_ON_THE_CARD_ROWS)
def test_the_rows_with_leaves_kept_on_the_card(
  moments, host_gib, k, nvme, host, disk_s, fits, page_machine
):
  import argparse

  import optax_offload as oo
  from benchmarks import gpu_speed
  from benchmarks import llama
  from optax_offload._src.units import format_bytes

  args = argparse.Namespace(
    host_memory=int(host_gib * 2**30),
    moment_dtype=moments,
    nvme_dir=page_machine,
    device_leaves=("wq", "wo"),
  )
  window = int(0.075 * gpu_speed.MEMORY["rtx4090_24gb"])
  e = gpu_speed.nvme_plan(llama.CONFIGS["13B"], "rtx4090_24gb", args, window, k, "bf16")
  assert (format_bytes(e.nvme_bytes), format_bytes(e.host_total_bytes)) == (nvme, host)
  assert (e.host_total_bytes <= host_gib * 2**30) == fits
  assert e.stack_device_bytes == 2 * 40 * 5120 * 5120 * 2  # wq and wo, bf16
  hw = oo.hardware("rtx4090_24gb", "desktop")
  assert f"{e.nvme_bytes / hw.nvme_read + e.nvme_bytes / hw.nvme_write:.1f} s" == disk_s
  label = {"bf16": "bf16 moments", "int8": "8-bit moments"}[moments]
  speed = (ROOT / "docs" / "speed.md").read_text()
  # Every row of these moments: the plan does not depend on the micro-batch count.
  rows = [r for r in speed.splitlines() if re.match(rf"\| {label}, \d+ x 2 x 2,048\b", r)]
  assert len(rows) == (4 if moments == "int8" else 2), (label, rows)
  for row in rows:
    cells = [c.strip(" *") for c in row.strip("|").split("|")]
    assert (cells[4], cells[9], cells[8], cells[10]) == (
      disk_s,
      nvme,
      host,
      "yes" if fits else "no",
    )
  if moments == "int8":  # the card's bytes, XLA's default schedule apart; the host's parts
    assert format_bytes(e.host_weight_bytes + e.accumulator_bytes) == KEPT_FIGURES[4]
    assert format_bytes(e.nvme_buffer_bytes) == KEPT_FIGURES[5]
    assert [r.split("|")[8].strip() for r in rows if "default" not in r] == [KEPT_FIGURES[2]] * 3


@pytest.mark.parametrize(
  "head, host, nvme", [(None, "47.44 GiB", "71.27 GiB"), ("fp32", *HEAD_FIGURES[:3:2])]
)
def test_the_heads_fp32_moments_plan(head, host, nvme, page_machine):
  # The script's own plan (examples/consumer_13b.py), for the page's 48 GiB command with and
  # without --head-moment-dtype fp32.
  from helpers import consumer_example

  from optax_offload._src.units import format_bytes

  example = consumer_example()
  argv = ["--nvme-dir", page_machine, "--host-memory", "48GiB", "--batch", "2", "--accumulate",
          "60", "--accumulator-dtype", "bf16", "--moment-dtype", "int8", "--device-leaves", "wq,wo",
          "--window-bytes", "1.8GiB", "--xla-slop-factor", "115"]  # fmt: skip
  args, cfg = example.parse_args([*argv, *(["--head-moment-dtype", head] if head else [])])
  e = example.plan(cfg, args)
  assert (format_bytes(e.host_total_bytes), format_bytes(e.nvme_bytes)) == (host, nvme)
  assert host in PAGE.read_text() and nvme in PAGE.read_text()
