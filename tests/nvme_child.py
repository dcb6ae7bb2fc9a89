"""Child processes for the crash and lock tests of `tests/test_nvme.py`.

Run as ``python nvme_child.py``: a zygote that imports the store once (importing TensorStore takes seconds)
and then reads commands from stdin, one per line, forking a worker for each (TensorStore starts no thread
on import, so forking is safe). Workers write one line per event to stdout:

  ``run DIR SEED``: prints ``ready PID GEN`` once the store is open at committed generation GEN, then runs
    the cyclic protocol forever (fetch, check, update, put, commit) until it is killed; prints
    ``bad PID MESSAGE`` and exits if a fetched group differs from `expected`.
  ``hold DIR``: opens the store, prints ``holding PID`` and sleeps until killed.
  ``open DIR``: tries to open the store and prints ``opened PID`` or ``error PID MESSAGE``.

The test module imports this file for `GROUPS`, `CHUNK_BYTES`, `expected` and `update`.
"""

import os
import signal
import sys
import time

import ml_dtypes
import numpy as np

from optax_offload._src.nvme import LeafSpec
from optax_offload._src.nvme import NvmeStore

CHUNK_BYTES = 16 << 10
GROUPS = [
  [LeafSpec("a_int32", (1000,), np.int32), LeafSpec("b_f32", (64, 33), np.float32)],
  [LeafSpec("c_bf16", (3000,), ml_dtypes.bfloat16)],
  [LeafSpec("d_f32", (20000,), np.float32)],
]


def expected(generation: int) -> dict[str, np.ndarray]:
  """Every leaf's value at `generation` (exact small integers in every dtype)."""
  out = {}
  for group in GROUPS:
    for spec in group:
      base = (np.arange(int(np.prod(spec.shape))) % 61).reshape(spec.shape)
      if spec.dtype == ml_dtypes.bfloat16:
        out[spec.name] = ((base + generation) % 128).astype(np.float32).astype(spec.dtype)
      else:
        out[spec.name] = (base + generation).astype(spec.dtype)
  return out


def update(array: np.ndarray) -> np.ndarray:
  """The step: maps `expected(g)` leaves to `expected(g + 1)` leaves."""
  if array.dtype == ml_dtypes.bfloat16:
    return ((array.astype(np.float32) + 1) % 128).astype(array.dtype)
  return array + np.ones((), array.dtype)


def _say(*words) -> None:
  os.write(1, (" ".join(str(w) for w in words) + "\n").encode())


def _run(directory: str, seed: int) -> None:
  store = NvmeStore(
    directory,
    GROUPS,
    prefetch_depth=seed % 3,
    write_depth=1 + seed % 2,
    chunk_bytes=CHUNK_BYTES,
  )
  generation = store.committed_generation
  _say("ready", os.getpid(), generation)
  if generation < 0:
    store.write_initial(0, expected(0))
    generation = 0
  while True:
    want = expected(generation)
    for g, group in enumerate(GROUPS):
      arrays = store.fetch(g, generation)
      for spec, array in zip(group, arrays, strict=True):
        if array.tobytes() != want[spec.name].tobytes():
          _say("bad", os.getpid(), f"generation {generation} leaf {spec.name}")
          os._exit(3)
      store.put(g, generation + 1, [update(a) for a in arrays])
    store.commit(generation + 1)
    if generation % 4 == seed % 4:
      store.sync()
    generation += 1


def _worker(command: str, args: list[str]) -> None:
  if command == "run":
    _run(args[0], int(args[1]))
  elif command == "hold":
    store = NvmeStore(args[0], GROUPS, chunk_bytes=CHUNK_BYTES)  # held: a dropped store closes
    _say("holding", os.getpid(), store.committed_generation)
    while True:
      time.sleep(60)
  elif command == "open":
    try:
      NvmeStore(args[0], GROUPS, chunk_bytes=CHUNK_BYTES).close()
      _say("opened", os.getpid())
    except Exception as e:  # Reported to the test, which checks the message.
      _say("error", os.getpid(), type(e).__name__, str(e).replace("\n", " "))


def main() -> None:
  # Workers are reaped automatically, so the test sees a killed worker's pid vanish.
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)
  _say("zygote", os.getpid())
  for line in sys.stdin:
    words = line.split()
    if not words:
      continue
    pid = os.fork()
    if pid == 0:
      code = 0
      try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _worker(words[0], words[1:])
      except BaseException as e:  # noqa: BLE001 - a worker reports and never returns to the loop.
        _say("error", os.getpid(), type(e).__name__, str(e).replace("\n", " "))
        code = 1
      os._exit(code)
    _say("started", words[0], pid)


if __name__ == "__main__":
  main()
