"""Offloaded state across processes: 2 processes x 2 CPU devices on loopback == 1 process x 4 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(__file__)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes: int, out_dir, timeout: float = 300):
  port = str(_free_port())
  env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        os.path.join(HERE, "multiprocess_child.py"),
        str(i),
        str(num_processes),
        port,
        str(out_dir),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(num_processes)
  ]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [json.loads((out_dir / f"footprint_{i}.json").read_text()) for i in range(num_processes)]


def test_two_processes_equal_one_process_bit_for_bit(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  one.mkdir()
  two.mkdir()
  (fp_one,) = _run(1, one)
  fp_two = _run(2, two)
  ref = np.load(one / "result.npz")
  got = np.load(two / "result.npz")
  assert sorted(ref.files) == sorted(got.files)
  for k in ref.files:
    assert np.array_equal(ref[k].view(np.uint8), got[k].view(np.uint8)), k
  # Each process holds its own shards in its own host memory: half of the sharded state each.
  assert all(f["memory_kinds"] == ["device", "pinned_host"] for f in [fp_one, *fp_two])
  host_one = fp_one["footprint"]["host"]
  host_two = [f["footprint"]["host"] for f in fp_two]
  assert host_two[0] == host_two[1]
  assert host_two[0] + host_two[1] == host_one
