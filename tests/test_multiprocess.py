"""Offloaded state across processes: 2 processes x 2 CPU devices on loopback == 1 process x 4 devices.

Also: when one process of a run is killed, the other one fails fast with a clear error.
"""

import json
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from conftest import CHILD_PROCESSES
from helpers import child_env
from helpers import start_child

from optax_offload._src import nvme

pytestmark = CHILD_PROCESSES


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _spawn(num_processes: int, out_dir, *flags: str, logs=None) -> list[subprocess.Popen]:
  """Starts the processes of one run of multiprocess_child.py; output to pipes, or to `logs[i]`."""
  port = _free_port()
  env = child_env(XLA_FLAGS=None)  # each process has its own devices
  procs = []
  for i in range(num_processes):
    procs.append(
      start_child(
        "multiprocess_child.py",
        i,
        num_processes,
        port,
        out_dir,
        *flags,
        env=env,
        stdout=subprocess.PIPE if logs is None else logs[i],
        stderr=subprocess.PIPE if logs is None else subprocess.STDOUT,
      )
    )
  return procs


def _run(num_processes: int, out_dir, *flags: str, timeout: float = 300, check: bool = True):
  """The footprints the processes wrote; with `check=False`, each one's (return code, stderr)."""
  out_dir.mkdir(exist_ok=True)
  procs = _spawn(num_processes, out_dir, *flags)
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      p.kill()
  if not check:
    return [(p.returncode, err) for p, (_, err) in zip(procs, outs)]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return _footprints(num_processes, out_dir)


def _footprints(num_processes: int, out_dir):
  return [json.loads((out_dir / f"footprint_{i}.json").read_text()) for i in range(num_processes)]


def _assert_same_result(a, b):
  ref, got = np.load(a / "result.npz"), np.load(b / "result.npz")
  assert sorted(ref.files) == sorted(got.files)
  for k in ref.files:
    assert np.array_equal(ref[k].view(np.uint8), got[k].view(np.uint8)), k


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The 1-process host-tier run, the reference of both bit-for-bit tests (run once)."""
  out = tmp_path_factory.mktemp("one_process") / "one"
  (footprint,) = _run(1, out)
  return out, footprint


def test_two_processes_equal_one_process_bit_for_bit(one_process, tmp_path):
  (one, fp_one), two = one_process, tmp_path / "two"
  # offload(host_memory=...) is each process's budget, planned from its own shards: 3/4 of the
  # whole state fits each of the 2 processes' halves (counted whole it would be refused: no
  # nvme_dir to spill to).
  budget = fp_one["footprint"]["host"] * 3 // 4
  fp_two = _run(2, two, "--host-memory", str(budget))
  _assert_same_result(one, two)
  # Each process holds its own shards in its own host memory: half of the sharded state each.
  assert all(f["memory_kinds"] == ["device", "pinned_host"] for f in [fp_one, *fp_two])
  host_one = fp_one["footprint"]["host"]
  host_two = [f["footprint"]["host"] for f in fp_two]
  assert host_two[0] == host_two[1]
  assert host_two[0] + host_two[1] == host_one


def test_nvme_tier_across_processes_and_checkpoint_into_one_process(one_process, tmp_path):
  """Host + NVMe tiers: 2 processes == 1 process == the host tier alone, each process storing only
  its own shards; a checkpoint saved by the 2 processes restores into 1 (and into 2) and continues
  identically."""
  host, _ = one_process
  one, two, resumed = (tmp_path / d for d in ("one", "two", "resumed"))
  (fp_one,) = _run(1, one, "--nvme")
  fp_two = _run(2, two, "--nvme", "--save-at", "5")
  _assert_same_result(host, one)
  _assert_same_result(one, two)
  # 'big' (300 x 200, sharded 4 ways on its first axis) has its Adam mu and nu on NVMe.
  shards = [f"leaf00000_part{j}_shard{s:04d}" for j in (0, 1) for s in range(4)]
  assert fp_one["nvme_files"] == shards
  assert [f["nvme_files"] for f in fp_two] == [
    [n for n in shards if n[-1] in "01"],
    [n for n in shards if n[-1] in "23"],
  ]
  assert [f["footprint"]["nvme"] for f in fp_two] == [fp_one["footprint"]["nvme"] // 2] * 2
  _run(1, resumed, "--nvme", "--restore-from", str(two))
  _assert_same_result(two, resumed)
  resumed_two = tmp_path / "resumed_two"
  _run(2, resumed_two, "--nvme", "--restore-from", str(two))
  _assert_same_result(two, resumed_two)


def test_host_memory_plans_every_process_with_the_least_room(tmp_path):
  """The processes of a run plan one program: where live arrays leave one of them less room, every
  process plans with that one's budget; where one is refused, every process is, at once."""
  room = 60_000_000  # 'wide' takes 51.2 MB of Adam state per process, the rest 0.3 MB
  runs = _run(
    2, tmp_path / "alone", "--wide", "--steps", "1", "--nvme", "--host-memory", str(room),
    check=False,
  )  # fmt: skip
  for code, err in runs:
    assert code == 0, err[-3000:]
    # Both nvme_dirs are on tmp_path's file system: each process plans with half its free space.
    assert "2 processes of this run keep their NVMe tier on this machine's file system" in err
    assert "each plans with 1/2 of it" in err
  alone = _footprints(2, tmp_path / "alone")
  assert [f["footprint"]["nvme"] for f in alone] == [0, 0]  # all of it fits in RAM
  # Process 0 holds 20 MB more in pinned host memory: its 'wide' state goes to NVMe, and process
  # 1's too, though it would fit there. At the first init process 1's store directory is locked
  # (after the processes agreed on the plan): both stop at once, then train once it is released.
  runs = _run(
    2, tmp_path / "held", "--wide", "--steps", "1", "--nvme", "--host-memory", str(room),
    "--hold-on-0", "20000000", "--lock-on-1", check=False,
  )  # fmt: skip
  for code, err in runs:
    assert code == 0, err[-3000:]
  assert "init refused: ValueError: offload: process 1 could not open its NVMe store" in runs[0][1]
  assert "init refused: RuntimeError: NVMe store directory" in runs[1][1], runs[1][1][-3000:]
  fps = _footprints(2, tmp_path / "held")
  assert fps[0]["footprint"] == fps[1]["footprint"]
  assert fps[1]["footprint"]["nvme"] == 51_200_000
  # Process 1 gave up the RAM it had room for, to plan as process 0.
  assert fps[1]["footprint"]["host"] == alone[1]["footprint"]["host"] - 51_200_000
  # 58 MB held: process 0 has no room for the NVMe tier's buffers; both are refused, at once.
  (code0, err0), (code1, err1) = _run(
    2, tmp_path / "short", "--wide", "--steps", "1", "--nvme", "--host-memory", str(room),
    "--hold-on-0", "58000000", timeout=120, check=False,
  )  # fmt: skip
  assert code0 != 0 and code1 != 0
  assert "raise --host-memory to at least" in err0, err0[-3000:]
  assert "process 0 refused the host_memory plan" in err1, err1[-3000:]
  # Process 1's nvme_dir cannot be created: its planning fails before the processes agree, and
  # process 0 is refused too rather than waiting for it.
  unwritable = tmp_path / "a_file"
  unwritable.write_text("")
  (code0, err0), (code1, err1) = _run(
    2, tmp_path / "no_dir", "--wide", "--steps", "1", "--nvme", "--host-memory", str(room),
    "--nvme-dir-on-1", str(unwritable / "nvme"), timeout=120, check=False,
  )  # fmt: skip
  assert code0 != 0 and code1 != 0
  assert "cannot be created" in err1, err1[-3000:]
  assert "process 1 refused the host_memory plan" in err0, err0[-3000:]


def test_the_fused_step_across_processes_is_plain_optax_within_an_ulp(tmp_path):
  """A layer stack in pinned host memory, sharded over 2 processes x 2 devices and updated inside
  the backward pass (`value_and_update`, 2 micro-batches): plain optax in the same processes
  within one ulp. (The programs' gradient collectives differ and gloo sums them in its own order:
  2 of 250,000 elements differed by an ulp when this was written, in 'embed' and 'wv'; in one
  process with 4 devices the two gave the same bits, checked once by hand.) Each process holds
  its half of the state in pinned host memory, planned by `offload(host_memory=...)` from its
  shards: exactly its shards of the stack's weights and accumulators and of the momentum fit, a
  byte less is refused on both processes (asserted in the child). (With the state on NVMe,
  value_and_update refuses a mesh: `nvme_tier.layers`.)"""
  fps = _run(2, tmp_path, "--fused", "--steps", "2")
  want, got = np.load(tmp_path / "reference.npz"), np.load(tmp_path / "result.npz")
  assert sorted(want.files) == sorted(got.files)
  for k in want.files:
    np.testing.assert_array_max_ulp(want[k], got[k], maxulp=1)
    assert np.count_nonzero(want[k] != got[k]) <= want[k].size // 1000, k
  assert all(f["stack_memory_kinds"] == ["pinned_host"] for f in fps)
  # SGD's momentum of every leaf of 256 elements or more (all but 'final_norm'), sharded: half
  # of it in each process's pinned host memory.
  momentum = sum(want[k].nbytes for k in want.files if want[k].size >= 256)
  assert [f["footprint"]["host"] for f in fps] == [momentum // 2] * 2, fps


FAULT_BOUND_S = 20
"""Most seconds the survivor may live after its peer is killed: the child's 10 s heartbeat timeout
(multiprocess_child.FAULT_TIMEOUTS) and as long again to report and exit. Measured here: 6.5-10.5 s
when the coordinator survives (the coordination service declares the peer dead), under 1 s when the
coordinator is the one killed (sockets close at once)."""

_FAULT_ERRORS = (
  "JAX distributed service detected fatal errors",  # the coordination service's verdict
  "Gloo all-reduce failed",  # a collective that saw the socket close
)


@pytest.mark.parametrize("victim", [1, 0], ids=["kill_worker", "kill_coordinator"])
def test_killed_process_fails_the_survivor_fast(tmp_path, victim):
  """SIGKILL one process mid-training: the other exits non-zero with a clear error, in bounded time.

  The children train with global-norm clipping outside offload, so every step all-reduces across
  the processes, as data-parallel training does, with host and NVMe tiers; afterwards each
  process's NVMe store is intact at its last committed generation.
  """
  paths = [tmp_path / f"log_{i}.txt" for i in range(2)]
  logs = [open(path, "w") for path in paths]
  procs = []
  try:
    procs = _spawn(2, tmp_path, "--fault", "--nvme", logs=logs)
    marker = tmp_path / f"step3_{victim}"
    deadline = time.monotonic() + 240  # two cold starts on a loaded 2-core machine
    while not marker.exists():
      for i, p in enumerate(procs):
        assert p.poll() is None, f"process {i} exited early:\n{paths[i].read_text()[-3000:]}"
      assert time.monotonic() < deadline, "step 3 not reached in time"
      time.sleep(0.1)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - victim]
    try:
      code = survivor.wait(timeout=FAULT_BOUND_S + 30)
    except subprocess.TimeoutExpired:
      code = None
    elapsed = time.monotonic() - killed
  finally:
    for p in procs:
      p.kill()
      p.wait()
    for f in logs:
      f.close()
  log = paths[1 - victim].read_text()
  assert code is not None, f"the survivor still ran {elapsed:.0f} s after its peer was killed"
  assert code != 0, log[-3000:]
  assert elapsed < FAULT_BOUND_S, f"{elapsed:.1f} s\n{log[-3000:]}"
  assert any(e in log for e in _FAULT_ERRORS), log[-3000:]
  assert "the peer was never lost" not in log
  # Both processes' NVMe stores open at their last committed generation, checksums verified.
  for i in range(2):
    directory = tmp_path / "nvme" / f"process_{i}"
    with nvme.NvmeStore(directory, nvme.stored_groups(directory), create=False) as store:
      # Init wrote generation 0; writing generation g waits for the commit of g - 2, so once the
      # put of step 3 (generation 4) was queued, generation 1 at least was committed.
      assert store.committed_generation >= 1
      assert all(a.size for a in store.read_generation().values())
  print(f"survivor exited with {code} {elapsed:.1f} s after the kill")
