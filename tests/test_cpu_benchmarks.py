"""The CPU benchmarks' bookkeeping (what they label and what they time), at tiny sizes: their
figures are measurements (docs/benchmarks.md), not checked here."""

import jax

from benchmarks import _common
from benchmarks import host_tier


def test_the_trees_are_committed_so_a_timed_step_does_not_compile():
  # Uncommitted params made the first step after the warm-up compile again (README), inside the
  # first timed rep of nvme_tier, nvme_scale and time_variants.
  params = _common.make_tree(2e4, 4)
  assert all(x.committed for x in jax.tree.leaves(params))


def test_host_tier_reports_the_groups_the_plan_made(tmp_path):
  # The window was sized for window / 2 a group: "8 groups" were 16 row slices, "one group" 3.
  r = host_tier.main(
    ["--params", "2e5", "--leaves", "16", "--reps", "1", "--out", str(tmp_path / "r.json")]
  )
  assert (r["groups"], r["groups_asked"], r["groups_one_group"]) == (8, 8, 1)
