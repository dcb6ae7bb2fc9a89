"""Orbax checkpoints of offloaded states: exact resume for every tier, other placements, crashes, bad input.

The resume matrix restores in this process, into a state made by a new `offload` instance with
another nvme_dir; `test_resume_in_a_fresh_process` does the same for a representative subset in a
child process (which also trains with the new instance's update, host tier included).
NVMe stores and checkpoints live on tmpfs when there is one: a generation's fsync on this
machine's disk costs up to a second under load, and nothing here depends on it.
"""

import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import checkpoint_child as child
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import CHILD_PROCESSES
from conftest import WHOLE_LEAF_WINDOW
from conftest import bits_equal
from helpers import expect_line
from helpers import kill_child
from helpers import run_child
from helpers import start_child

import optax_offload as oo
from optax_offload._src import nvme
from optax_offload._src import nvme_tier

STEP = 5


@pytest.fixture
def fast_dir(tmp_path):
  """A fresh directory on tmpfs (/dev/shm) when there is one, else in tmp_path."""
  if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
    d = pathlib.Path(tempfile.mkdtemp(prefix="oo_ckpt_", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
  else:
    d = tmp_path / "fast"
    d.mkdir()
    yield d


def _results_equal(a: dict, b: dict) -> bool:
  return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def _save(ckpt_dir, step, params, state, **options):
  with ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(**options)) as mngr:
    mngr.save(step, args=child.save_args(params, state))
    mngr.wait_until_finished()


def _restore(ckpt_dir, step, params, target):
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    restored = mngr.restore(step, args=child.restore_args(params, target))
  return restored["params"], restored["opt_state"]


def _digest(directory) -> dict[str, str]:
  """Every file under `directory` with a hash of its content."""
  out = {}
  for path in sorted(pathlib.Path(directory).rglob("*")):
    if path.is_file():
      out[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
  return out


def _store_of(state) -> nvme.NvmeStore:
  (s,) = [
    x
    for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, oo.OffloadState))
    if isinstance(x, oo.OffloadState)
  ]
  return nvme_tier.lookup(s.nvme_store).store


_EXPECTED_TIERS = {  # which footprint entries are non-zero in each tier setting
  "device": {"device"},
  "host": {"device", "host"},
  "nvme": {"device", "nvme"},
  "mixed": {"device", "host", "nvme"},
}

_CASES = [
  pytest.param(opt, tier, id=f"{opt}-{tier}") for opt in child.OPTIMIZERS for tier in child.TIERS
]


@pytest.mark.parametrize("opt,tier", _CASES)
def test_resume_is_bit_exact(opt, tier, fast_dir):
  params = child.committed_params()
  tx = child.make_tx(opt, tier, fast_dir / "nvme_a")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  assert {k for k, v in oo.footprint(s).items() if v} == _EXPECTED_TIERS[tier]
  _save(fast_dir / "ckpt", STEP, p, s)
  want = child.result(*child.run(step, p, s, STEP, 2 * STEP))
  oo.close_nvme(s)
  shutil.rmtree(fast_dir / "nvme_a", ignore_errors=True)  # the checkpoint needs nothing from it

  tx2 = child.make_tx(opt, tier, fast_dir / "nvme_b")
  target = tx2.init(params)
  p2, s2 = _restore(fast_dir / "ckpt", STEP, params, target)
  assert child.placement(s2) == child.placement(target)  # host leaves in pinned_host, ...
  # Without an NVMe tier the state does not name its transformation: the step compiled for `tx`
  # runs it (same types, no second compilation). With one, the new store's step must.
  step2 = step if tier in ("device", "host") else child.make_step(tx2)
  got = child.result(*child.run(step2, p2, s2, STEP, 2 * STEP))
  assert _results_equal(want, got)
  oo.close_nvme(s2)


def test_a_prefix_mask_resumes_bit_exact(fast_dir):
  # optax.multi_transform with labels given as a prefix of the params' tree: one MaskedNode over
  # each frozen subtree in the state (refused before), host and NVMe tiers.
  params = child.committed_params()
  labels = {"embed": "train", "dense": "freeze", "conv": "train", "big": "train", "scale": "freeze"}

  def make(name):
    inner = optax.multi_transform(
      {"train": optax.adamw(1e-2), "freeze": optax.set_to_zero()}, labels
    )
    return oo.offload(
      inner, window_bytes=child.WINDOW, **child.offload_kwargs("adamw", "mixed", fast_dir / name)
    )

  tx = make("nvme_a")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  assert oo.footprint(s)["host"] and oo.footprint(s)["nvme"]
  _save(fast_dir / "ckpt", STEP, p, s)
  want = child.result(*child.run(step, p, s, STEP, 2 * STEP))
  oo.close_nvme(s)
  tx2 = make("nvme_b")
  p2, s2 = _restore(fast_dir / "ckpt", STEP, params, tx2.init(params))
  assert _results_equal(
    want, child.result(*child.run(child.make_step(tx2), p2, s2, STEP, 2 * STEP))
  )
  oo.close_nvme(s2)


def test_resume_in_a_fresh_process(fast_dir):
  # Every tier in a nested state, and a MultiSteps state mid-accumulation.
  cases = [("chain_clip_adamw", "mixed"), ("multisteps_adamw", "host")]
  params = child.committed_params()
  wanted, jobs = [], []
  for n, (opt, tier) in enumerate(cases):
    tx = child.make_tx(opt, tier, fast_dir / f"nvme_a{n}")
    step = child.make_step(tx)
    p, s = child.run(step, params, tx.init(params), 0, STEP)
    _save(fast_dir / f"ckpt{n}", STEP, p, s)
    wanted.append(child.result(*child.run(step, p, s, STEP, STEP + child.RESUME_STEPS)))
    oo.close_nvme(s)
    shutil.rmtree(fast_dir / f"nvme_a{n}", ignore_errors=True)
    jobs.append(
      {
        "opt": opt,
        "tier": tier,
        "ckpt": str(fast_dir / f"ckpt{n}"),
        "step": STEP,
        "nvme_dir": str(fast_dir / f"nvme_b{n}"),
        "out": str(fast_dir / f"out{n}.npz"),
      }
    )
  run_child("checkpoint_child.py", "resume", json.dumps(jobs))
  for (opt, tier), job, want in zip(cases, jobs, wanted):
    with np.load(job["out"]) as got:
      assert _results_equal(want, dict(got)), (opt, tier)


def test_standard_checkpointer_restore_trains_on_in_a_fresh_process(tmp_path):
  # Orbax's own recipe: StandardCheckpointer, restored into ShapeDtypeStructs with the target's
  # shardings. On one device those are SingleDeviceShardings, which jax 0.10 builds into arrays
  # typed as device memory; the restored host-tier state must still enter the step as tx.init's.
  params = child.committed_params()
  tx = child.make_tx("adamw", "host")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, 2)
  ckpt = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(ckpt, {"p": p, "s": s})
  expected = child.result(*child.run(step, p, s, 2, 2 + child.RESUME_STEPS))
  out = tmp_path / "resumed.npz"
  run_child("checkpoint_child.py", "standard", ckpt, 2, out)
  assert _results_equal(dict(np.load(out)), expected)


def test_restore_into_other_placements_and_plain_optax(fast_dir):
  params = child.committed_params()
  host_tx = child.make_tx("adamw", "host")
  step = child.make_step(host_tx)
  p, s = child.run(step, params, host_tx.init(params), 0, STEP)
  _save(fast_dir / "from_host", STEP, p, s)
  plain_at_save = oo.to_inner(s, memory_kind="device")
  want = child.result(*child.run(step, p, s, STEP, 2 * STEP))

  # Saved all on host; restored with a smaller host_limit and an NVMe tier, then the other way.
  mixed_tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  target = mixed_tx.init(params)
  p2, s2 = _restore(fast_dir / "from_host", STEP, params, target)
  assert child.placement(s2) == child.placement(target)
  assert oo.footprint(s2)["nvme"] > 0 and oo.footprint(s2)["host"] < oo.footprint(s)["host"]
  assert s2.inner[0].mu["dense"]["kernel"].sharding.memory_kind == "pinned_host"
  _save(fast_dir / "from_mixed", STEP, p2, s2)
  mixed_step = child.make_step(mixed_tx)
  assert _results_equal(want, child.result(*child.run(mixed_step, p2, s2, STEP, 2 * STEP)))
  p3, s3 = _restore(fast_dir / "from_mixed", STEP, params, host_tx.init(params))
  assert _results_equal(want, child.result(*child.run(step, p3, s3, STEP, 2 * STEP)))

  # Back to plain optax: restore straight into a plain state, or through oo.to_inner.
  plain_tx = optax.adamw(1e-2, weight_decay=1e-2)
  _, plain = _restore(fast_dir / "from_mixed", STEP, params, plain_tx.init(params))
  assert bits_equal(plain_at_save, plain)
  assert plain[0].mu["big"].sharding.memory_kind == "device"
  _, s4 = _restore(fast_dir / "from_mixed", STEP, params, mixed_tx.init(params))
  assert bits_equal(plain_at_save, oo.to_inner(s4, memory_kind="device"))
  oo.close_nvme(s4)


def test_nvme_files_are_linked_or_copied(fast_dir, tmp_path):
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  plain = oo.to_inner(s)
  store = _store_of(s)
  generation = int(s.nvme_generation)
  with ocp.CheckpointManager(fast_dir / "ckpt") as mngr:
    mngr.save(STEP, args=child.save_args(p, s))
    # Training goes on while the save completes: its generation stays pinned until linked.
    p_more, s_more = child.run(step, p, s, STEP, STEP + 3)
    mngr.wait_until_finished()
  oo.sync_nvme(s_more)  # the steps' commits, written behind (a loaded machine lags them)
  assert generation not in store.generations_on_disk
  item = fast_dir / "ckpt" / str(STEP) / "opt_state" / oo.OffloadCheckpointHandler.SUBDIR
  manifest = json.loads((item / "process_0" / "manifest.json").read_text())
  assert manifest["nvme_transfer"] == "link"
  linked = sorted(
    p for p in (item / "process_0").rglob("*") if p.is_file() and p.name != "manifest.json"
  )
  assert linked and all(p.stat().st_nlink == 1 for p in linked)  # the store dropped its names

  # A copy when links are impossible (another filesystem) or not wanted.
  handler = oo.OffloadCheckpointHandler(link=False)
  handlers = {"opt_state": handler, "params": ocp.StandardCheckpointHandler()}
  with ocp.CheckpointManager(tmp_path / "copied", item_handlers=handlers) as mngr:
    mngr.save(STEP + 3, args=child.save_args(p_more, s_more))
    mngr.wait_until_finished()
    copied = mngr.item_metadata(STEP + 3)["opt_state"]
  assert copied["nvme_transfer"] == "copy"
  oo.close_nvme(s_more)

  tx2 = child.make_tx("adamw", "mixed", fast_dir / "nvme_b")  # keep it: it owns the store
  _, s2 = _restore(fast_dir / "ckpt", STEP, params, tx2.init(params))
  assert bits_equal(plain, oo.to_inner(s2))
  oo.close_nvme(s2)


def test_two_saves_of_one_state_both_complete(fast_dir, monkeypatch):
  """A fast local save and a slow persistent one of the same state: the first to finish does not
  release the NVMe generation under the other while training moves on."""
  from optax_offload._src import checkpoint as checkpoint_lib

  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", fast_dir / "nvme")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  plain = oo.to_inner(s)
  generation = int(s.nvme_generation)
  release, link = threading.Event(), checkpoint_lib._link_tree

  def slow_link(src, dst, how):
    if "slow" in str(dst):
      assert release.wait(120)
    return link(src, dst, how)

  monkeypatch.setattr(checkpoint_lib, "_link_tree", slow_link)
  with ocp.CheckpointManager(fast_dir / "slow") as slow:
    try:
      slow.save(STEP, args=child.save_args(p, s))
      _save(fast_dir / "fast", STEP, p, s)
      p, s = child.run(step, p, s, STEP, STEP + 3)
      oo.sync_nvme(s)
      assert generation in _store_of(s).generations_on_disk  # still pinned by the slow save
    finally:
      release.set()
    slow.wait_until_finished()
  oo.sync_nvme(s)
  assert generation not in _store_of(s).generations_on_disk
  oo.close_nvme(s)
  for name in ("slow", "fast"):
    tx2 = child.make_tx("adamw", "nvme", fast_dir / f"nvme_{name}")
    _, restored = _restore(fast_dir / name, STEP, params, tx2.init(params))
    assert bits_equal(plain, oo.to_inner(restored))
    oo.close_nvme(restored)


def test_linked_files_share_the_store_inodes(fast_dir):
  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", fast_dir / "nvme")
  s = tx.init(params)
  store = _store_of(s)
  _save(fast_dir / "ckpt", 0, params, s)
  gen_files = {
    p.relative_to(store.generation_path(int(s.nvme_generation))): p.stat().st_ino
    for p in store.generation_path(int(s.nvme_generation)).rglob("*")
    if p.is_file()
  }
  item = fast_dir / "ckpt" / "0" / "opt_state" / oo.OffloadCheckpointHandler.SUBDIR / "process_0"
  ckpt_files = {
    p.relative_to(item / "store_0"): p.stat().st_ino
    for p in (item / "store_0").rglob("*")
    if p.is_file()
  }
  assert ckpt_files and ckpt_files == gen_files
  oo.close_nvme(s)


@CHILD_PROCESSES
def test_sigkill_during_training_and_saves(fast_dir):
  # Trial 0 links slowly and is killed inside a save's background part; the others at random
  # moments: just after a save started, or up to 0.3 s later (mid-step or mid-save).
  trials = 3
  rng = random.Random(0)
  procs = []
  for n in range(trials):
    argv = ["train", fast_dir / f"ckpt{n}", fast_dir / f"nvme{n}", 2]
    procs.append(start_child("checkpoint_child.py", *argv, *(["slow_link"] if n == 0 else [])))
  for n, proc in enumerate(procs):
    expect_line(proc, "ready")
    saves = 0
    wanted = 3 if n == 0 else rng.randint(3, 6)
    # "save k" is printed before save(k); save(k) waits for the save before it. So once the
    # third line is read, the first save is complete.
    while saves < wanted:
      line = proc.stdout.readline()
      assert line, proc.stderr.read()[-3000:]
      saves += line.startswith("save ")
    time.sleep([rng.uniform(1.2, 1.8), rng.uniform(0.0, 0.02), rng.uniform(0.0, 0.3)][n % 3])
    kill_child(proc)
    if n == 0:  # killed mid-save: its temporary directory is there, and never the latest
      assert any(".orbax-checkpoint-tmp" in p.name for p in (fast_dir / "ckpt0").iterdir())

  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme_restore")
  step = child.make_step(tx)
  latest = {}
  for n in range(trials):
    with ocp.CheckpointManager(fast_dir / f"ckpt{n}") as mngr:
      latest[n] = mngr.latest_step()
      assert latest[n] is not None and latest[n] >= 2
      complete = [int(p.name) for p in (fast_dir / f"ckpt{n}").iterdir() if p.name.isdigit()]
      assert latest[n] == max(complete)
      restored = mngr.restore(latest[n], args=child.restore_args(params, tx.init(params)))
    p, s = restored["params"], restored["opt_state"]
    latest[n] = (
      latest[n],
      child.result(p, s),
      child.result(*child.run(step, p, s, latest[n], latest[n] + 2)),
    )
  # The same run, uninterrupted, on the host tier (bit-equal to the NVMe tier for the same window).
  ref_tx = child.make_tx("adamw", "host")
  ref_step = child.make_step(ref_tx)
  p, s = params, ref_tx.init(params)
  refs, last = {}, max(k for k, _, _ in latest.values()) + 2
  for t in range(last + 1):
    refs[t] = child.result(p, s)
    if t < last:
      p, s = child.run(ref_step, p, s, t, t + 1)
  for n, (k, at_k, after) in latest.items():
    assert _results_equal(refs[k], at_k), (n, k)
    assert _results_equal(refs[k + 2], after), (n, k)


def test_restore_into_a_different_tree_is_refused(fast_dir):
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  s = tx.init(params)
  _save(fast_dir / "ckpt", 0, params, s)
  oo.close_nvme(s)
  before = _digest(fast_dir / "ckpt")
  fewer = {k: v for k, v in params.items() if k != "scale"}
  wider = {**params, "big": jax.numpy.zeros((300, 201))}
  targets = {
    "only in the checkpoint: .*'scale'": child.make_tx("adamw", "host").init(fewer),
    r"\['big'\] is float32\[300, 200\] in the checkpoint but float32\[300, 201\]": (
      child.make_tx("adamw", "host").init(wider)
    ),
    r"only in the checkpoint: \[0\]\.nu\['big'\]": child.make_tx("lion", "host").init(params),
  }
  for match, target in targets.items():
    with pytest.raises(ValueError, match=match):
      with ocp.CheckpointManager(fast_dir / "ckpt") as mngr:
        mngr.restore(0, args=ocp.args.Composite(opt_state=oo.OffloadRestore(target)))
  assert _digest(fast_dir / "ckpt") == before


def _damage(item: pathlib.Path, how: str, which: int = 0) -> str:
  """Damages the NVMe data of a checkpoint item (its array `which`, in name order); returns a path
  the error must name."""
  arrays = sorted((item / oo.OffloadCheckpointHandler.SUBDIR / "process_0").glob("store_*/*"))
  array = arrays[which]
  chunks = sorted(p for p in array.rglob("*") if p.is_file() and p.name != "zarr.json")
  if how == "missing_array":
    shutil.rmtree(array)
    return str(array)
  if how == "missing_chunk":
    chunks[0].unlink()
    return str(array)
  data = bytearray(chunks[0].read_bytes())
  data[len(data) // 2] ^= 0x40
  chunks[0].unlink()  # a new file: the old one may still be a name of the store's data
  chunks[0].write_bytes(bytes(data))
  return str(array)


def test_missing_or_corrupted_nvme_data_is_refused(fast_dir):
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  step = child.make_step(tx)
  p, s = params, tx.init(params)
  damages = ("missing_array", "missing_chunk", "flipped_bit")
  with ocp.CheckpointManager(fast_dir / "ckpt") as mngr:
    for t in range(len(damages) + 1):
      mngr.save(t, args=child.save_args(p, s))
      mngr.wait_until_finished()
      if t == len(damages):
        want = child.result(p, s)
      p, s = child.run(step, p, s, t, t + 1)
  oo.close_nvme(s)
  intact = _digest(fast_dir / "ckpt" / str(len(damages)))
  tx2 = child.make_tx("adamw", "mixed", fast_dir / "nvme_b")
  target = tx2.init(params)
  for t, how in enumerate(damages):
    path = _damage(fast_dir / "ckpt" / str(t) / "opt_state", how)
    with pytest.raises(oo.NvmeCorruptionError, match="failed verification") as e:
      _restore(fast_dir / "ckpt", t, params, target)
    assert path in str(e.value), how
  # The intact checkpoint is untouched, and restores into the same target.
  assert _digest(fast_dir / "ckpt" / str(len(damages))) == intact
  p2, s2 = _restore(fast_dir / "ckpt", len(damages), params, target)
  assert _results_equal(want, child.result(p2, s2))
  oo.close_nvme(s2)


def test_a_failed_restore_leaves_the_target_training_on(fast_dir):
  """A restore refused half-way (a corrupted copy) leaves the target as it was, and trainable: its
  next step equals a run that never restored."""
  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", fast_dir / "nvme")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  plain = oo.to_inner(s)
  handlers = {
    "opt_state": oo.OffloadCheckpointHandler(link=False),
    "params": ocp.StandardCheckpointHandler(),
  }
  with ocp.CheckpointManager(fast_dir / "ckpt", item_handlers=handlers) as mngr:
    mngr.save(STEP, args=child.save_args(p, s))
    mngr.wait_until_finished()
  # The last array's file: the groups before it are written when the restore is refused.
  last = _damage(fast_dir / "ckpt" / str(STEP) / "opt_state", "flipped_bit", which=-1)
  written = _store_of(s).stats["bytes_written"]
  with pytest.raises(oo.NvmeCorruptionError, match=pathlib.Path(last).name):
    _restore(fast_dir / "ckpt", STEP, params, s)
  oo.sync_nvme(s)
  assert _store_of(s).stats["bytes_written"] > written
  assert bits_equal(plain, oo.to_inner(s))
  p, s = child.run(step, p, s, STEP, STEP + 2)
  oo.sync_nvme(s)
  store = _store_of(s)  # the refused restore's groups are gone
  on_disk = sorted(d.name for d in store.directory.iterdir() if d.name.startswith("gen_"))
  assert on_disk == [store.generation_path(g).name for g in store.generations_on_disk]
  tx_b = child.make_tx("adamw", "nvme", fast_dir / "nvme_b")
  p_b, s_b = child.run(child.make_step(tx_b), params, tx_b.init(params), 0, STEP + 2)
  assert _results_equal(child.result(p_b, s_b), child.result(p, s))
  oo.close_nvme(s)
  oo.close_nvme(s_b)


def test_bad_calls_are_clear_errors(fast_dir):
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  step = child.make_step(tx)
  old = tx.init(params)
  p, s = child.run(step, params, old, 0, 2)
  oo.sync_nvme(s)  # (the second update's commit drops the first generation: wait for it)
  with pytest.raises(ValueError, match="no longer in .*latest update"):
    oo.OffloadSave(old)  # its generation was deleted
  with pytest.raises(ValueError, match="needs the target state"):
    oo.OffloadRestore(None)
  with ocp.CheckpointManager(fast_dir / "ckpt") as mngr:  # saved without OffloadSave
    mngr.save(1, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(oo.to_inner(s))))
  with ocp.CheckpointManager(fast_dir / "ckpt") as mngr:
    with pytest.raises(FileNotFoundError, match="oo.OffloadSave"):
      mngr.restore(1, args=ocp.args.Composite(opt_state=oo.OffloadRestore(s)))
  oo.close_nvme(s)
  with pytest.raises(RuntimeError, match="closed"):
    oo.OffloadSave(s)


def test_standard_save_of_an_nvme_state_names_offload_save(fast_dir):
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  s = tx.init(params)
  # A synchronous Checkpointer: a save failing inside an asynchronous CheckpointManager can leave
  # Orbax's threads waiting for minutes (docs/checkpoints.md).
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
    with pytest.raises(ValueError, match=r"zero size: opt_state\.inner.*oo\.OffloadSave"):
      ckptr.save(fast_dir / "ckpt", args=ocp.args.StandardSave({"opt_state": s}))
    ckptr.save(fast_dir / "plain", args=ocp.args.StandardSave({"opt_state": oo.to_inner(s)}))
  oo.close_nvme(s)


def test_standard_restore_of_an_offload_save_names_offload_restore(fast_dir):
  # TensorStore's NOT_FOUND for the first NVMe leaf was all the user saw.
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", fast_dir / "nvme")
  s = tx.init(params)
  _save(fast_dir / "ckpt", 0, params, s)
  plain = oo.to_inner(s)  # the state's tree, as a user would give StandardRestore
  oo.close_nvme(s)
  item = fast_dir / "ckpt" / "0" / "opt_state"
  with ocp.StandardCheckpointer() as ckptr:
    with pytest.raises(ValueError, match=r"saved with oo.OffloadSave .* oo.OffloadRestore"):
      ckptr.restore(item, plain)


def _make_read_only(directory: pathlib.Path) -> Callable[[], None]:
  """Makes `directory` refuse writes, and returns what undoes it: a read-only bind mount for root
  (which ignores permission bits), read-only permission bits for anyone else."""
  if os.geteuid() != 0:
    dirs = [directory, *(p for p in directory.rglob("*") if p.is_dir())]
    for d in dirs:
      d.chmod(0o555)
    return lambda: [d.chmod(0o755) for d in dirs]
  mount = subprocess.run(
    f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory}",
    shell=True,
    capture_output=True,
    text=True,
  )
  if mount.returncode != 0:
    pytest.skip(f"cannot make a read-only bind mount here: {mount.stderr.strip()}")
  return lambda: subprocess.run(["umount", "-l", str(directory)], check=False)


def test_read_only_checkpoint_directory(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  params = child.committed_params()
  tx = child.make_tx("adamw", "mixed", tmp_path / "nvme")
  s = tx.init(params)
  _save(ckpt, 0, params, s)
  before = _digest(ckpt)
  undo = _make_read_only(ckpt)
  try:
    # Orbax's default asynchronous directory creation leaves its own threads waiting for the
    # directory for minutes when creating it fails; creating it in the caller fails at once.
    options = ocp.CheckpointManagerOptions(
      async_options=ocp.AsyncOptions(create_directories_asynchronously=False)
    )
    with ocp.CheckpointManager(ckpt, options=options) as mngr:
      with pytest.raises(OSError, match="Read-only file system|Permission denied"):
        mngr.save(1, args=child.save_args(params, s))
        mngr.wait_until_finished()
      tx2 = child.make_tx("adamw", "mixed", tmp_path / "nvme_b")
      restored = mngr.restore(0, args=child.restore_args(params, tx2.init(params)))
  finally:
    undo()
  assert bits_equal(oo.to_inner(s), oo.to_inner(restored["opt_state"]))
  assert _digest(ckpt) == before
  store_manifest = json.loads((tmp_path / "nvme" / "process_0" / "MANIFEST.json").read_text())
  assert store_manifest["pinned"] == []  # the failed save left nothing pinned
  oo.close_nvme(s)
  oo.close_nvme(restored["opt_state"])


def test_sliced_nvme_leaf_restores_into_other_placements_and_slices(fast_dir):
  # 'big' is on NVMe in 15 row slices at child.WINDOW, each saved as its own file with its region;
  # restore reads any target's regions by overlap: the host tier (whole arrays), and an NVMe tier
  # whose window cuts 'big' into other slices.
  params = child.committed_params()
  tx = child.make_tx("adamw", "nvme", fast_dir / "nvme_a")
  step = child.make_step(tx)
  p, s = child.run(step, params, tx.init(params), 0, STEP)
  _save(fast_dir / "ckpt", STEP, p, s)
  item = fast_dir / "ckpt" / str(STEP) / "opt_state" / oo.OffloadCheckpointHandler.SUBDIR
  manifest = json.loads((item / "process_0" / "manifest.json").read_text())
  (big_mu,) = [e for e in manifest["arrays"] if e["path"] == "[0].mu['big']"]
  assert [r["region"][0] for r in big_mu["nvme"]] == [[20 * k, 20 * k + 20] for k in range(15)]
  saved = oo.to_inner(s)
  want = child.result(*child.run(step, p, s, STEP, STEP + 2))
  oo.close_nvme(s)

  host_tx = child.make_tx("adamw", "host")
  p2, s2 = _restore(fast_dir / "ckpt", STEP, params, host_tx.init(params))
  assert bits_equal(saved, oo.to_inner(s2))
  # The same window: the same groups, so the host tier continues with the NVMe tier's bits.
  assert _results_equal(
    want, child.result(*child.run(child.make_step(host_tx), p2, s2, STEP, STEP + 2))
  )

  window = child.WINDOW * 3  # 'big' in 5 slices of 60 rows (75 fit; a slice holds an even number)
  other_tx = child.make_tx("adamw", "nvme", fast_dir / "nvme_b", window_bytes=window)
  p3, s3 = _restore(fast_dir / "ckpt", STEP, params, other_tx.init(params))
  try:
    assert bits_equal(saved, oo.to_inner(s3))
    names = [spec.name for group in _store_of(s3).groups for spec in group]
    assert [n for n in names if n.startswith("leaf00000_part0")] == [
      f"leaf00000_part0_shard0000_rows{a:06d}-{a + 60:06d}" for a in (0, 60, 120, 180, 240)
    ]
    # And it trains on like the host tier with that window (same groups, same bits).
    ref_tx = child.make_tx("adamw", "host", window_bytes=window)
    p4, s4 = _restore(fast_dir / "ckpt", STEP, params, ref_tx.init(params))
    got = child.result(*child.run(child.make_step(other_tx), p3, s3, STEP, STEP + 2))
    assert _results_equal(
      child.result(*child.run(child.make_step(ref_tx), p4, s4, STEP, STEP + 2)), got
    )
  finally:
    oo.close_nvme(s3)


def test_whole_and_sliced_nvme_files_restore_into_each_other(fast_dir):
  # A checkpoint of whole NVMe shards (as saved before leaves were sliced on NVMe, or with a window
  # that keeps 'big' whole) restores into row slices, and back.
  params = child.committed_params()
  whole_tx = child.make_tx("adamw", "nvme", fast_dir / "whole", window_bytes=WHOLE_LEAF_WINDOW)
  p, s = child.run(child.make_step(whole_tx), params, whole_tx.init(params), 0, STEP)
  saved = oo.to_inner(s)
  _save(fast_dir / "ckpt_whole", STEP, p, s)
  oo.close_nvme(s)
  item = fast_dir / "ckpt_whole" / str(STEP) / "opt_state" / oo.OffloadCheckpointHandler.SUBDIR
  manifest = json.loads((item / "process_0" / "manifest.json").read_text())
  (big_mu,) = [e for e in manifest["arrays"] if e["path"] == "[0].mu['big']"]
  assert [r["region"] for r in big_mu["nvme"]] == [[[0, 300], [0, 200]]]

  sliced_tx = child.make_tx("adamw", "nvme", fast_dir / "sliced")
  _, s2 = _restore(fast_dir / "ckpt_whole", STEP, params, sliced_tx.init(params))
  assert bits_equal(saved, oo.to_inner(s2))
  assert len(_store_of(s2).groups) > 12  # 'big' in 12 slices, and the other leaves
  _save(fast_dir / "ckpt_sliced", STEP, p, s2)
  oo.close_nvme(s2)
  _, s3 = _restore(fast_dir / "ckpt_sliced", STEP, params, whole_tx.init(params))
  assert bits_equal(saved, oo.to_inner(s3))
  oo.close_nvme(s3)
