"""docs/consumer.md: every `plan` output it shows is the command's output today, and every size its
prose states is in one of those outputs."""

import contextlib
import io
import pathlib
import re
import shlex

import pytest

from optax_offload._src import cli
from optax_offload._src import estimate as estimate_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "consumer.md"
TWO_TB = 2_000_000_000_000  # the page's drive: 2 TB, empty
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
  return str(tmp_path / "run1")


def test_the_page_shows_each_plan_as_printed(page_machine):
  text = PAGE.read_text()
  blocks = plan_blocks(text)
  assert len(blocks) == 4
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
  for figure in re.findall(r"\d+(?:\.\d+)? GiB", prose):
    assert any(figure in o for o in outputs), figure


def test_the_speed_page_figures_it_cites():
  speed = (ROOT / "docs" / "speed.md").read_text()
  assert "| 13B, `rtx4090_24gb` | `fused_all` | 524,288 | 391 s | 367 s | 1.07 | 1,340 | **104.7**" in speed
