"""Child processes of the NVMe-tier tests (`tests/test_nvme_tier.py`).

Usage:
  python nvme_tier_child.py train NVME_DIR STEPS
    Trains with an NVMe tier until killed (or STEPS steps). Prints "ready" once the step has
    compiled and run (committed params: one compile).
  python nvme_tier_child.py init NVME_DIR
    Initialises a state with an NVMe tier in NVME_DIR, and exits.
  python nvme_tier_child.py exit NVME_DIR STEPS OUT
    Trains STEPS steps with an NVMe tier and, alongside, with the host tier (the same groups, so the
    same bits), then returns from `main` without `oo.sync_nvme` or `oo.close_nvme`: the NVMe tier's
    last writes and commit are still queued (its commit is slowed down by `SLOW_COMMIT_S`, as on a
    slow disk, so that it cannot be done before the interpreter exits unless something waits). Writes to OUT (npz) the host tier's plain state after
    each step, as ``g{generation}_{i}`` for the i-th leaf of ``oo.to_inner``, the NVMe state naming
    that generation; prints "exiting GENERATION" last.
  python nvme_tier_child.py malloc NVME_DIR RECIPE
    Trains 4 steps with 64 MiB of adamw state on NVMe (XLA's temporary buffer of a step: over the
    32 MiB that glibc maps afresh), runs the Python file RECIPE, then trains 6 more steps; prints
    the page faults of each step (MiB of first touches) as "before F F F F" and "after F ...".
"""

import resource
import sys
import time

import jax
import numpy as np
import optax
from conftest import make_grads
from conftest import make_params

import optax_offload as oo
from optax_offload._src import nvme_tier

# The separability check is skipped, as in checkpoint_child: test_transform tests it, and it runs
# a miniature of the update eagerly at every child's start (each trial of the SIGKILL test).
CONFIG = {"window_bytes": 100_000, "host_limit": "200KiB", "check_separable": False}
SLOW_COMMIT_S = 2.0


def make_tx(nvme_dir=None):
  """adamw with `CONFIG`: 'big' on NVMe when `nvme_dir` is given, else all on the host."""
  if nvme_dir is None:
    return oo.offload(
      optax.adamw(1e-2),
      window_bytes=CONFIG["window_bytes"],
      check_separable=CONFIG["check_separable"],
    )
  return oo.offload(optax.adamw(1e-2), nvme_dir=nvme_dir, **CONFIG)


def make_step(tx):
  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step


def train(nvme_dir: str, steps: int) -> None:
  tx = make_tx(nvme_dir)
  # Committed, as the step's outputs are: uncommitted params would compile the step twice.
  params = jax.device_put(make_params(), jax.devices()[0])
  state = tx.init(params)
  step = make_step(tx)
  for t in range(steps):
    params, state = step(params, state, make_grads(params, t))
    jax.block_until_ready(state)
    if t == 0:
      print("ready", flush=True)
  oo.close_nvme(state)


def exit_unsynced(nvme_dir: str, steps: int, out: str) -> None:
  nvme_tx, host_tx = make_tx(nvme_dir), make_tx()
  nvme_step, host_step = make_step(nvme_tx), make_step(host_tx)
  params = make_params()
  p_nvme, s_nvme = params, nvme_tx.init(params)
  p_host, s_host = params, host_tx.init(params)
  values = {}
  for t in range(steps):
    if t == steps - 1:
      _slow_down_commits(s_nvme)
    p_nvme, s_nvme = nvme_step(p_nvme, s_nvme, make_grads(params, t))
    p_host, s_host = host_step(p_host, s_host, make_grads(params, t))
    # The program has run (its commit is queued), but nothing waits for the writes.
    generation = int(s_nvme.nvme_generation)
    for i, x in enumerate(jax.tree.leaves(oo.to_inner(s_host))):
      values[f"g{generation}_{i}"] = np.asarray(x)
  np.savez(out, **values)
  print("exiting", generation, flush=True)


def _slow_down_commits(state) -> None:
  pipeline = nvme_tier.lookup(state.nvme_store).store._pipeline
  commit = pipeline._commit

  def slow(*args):
    time.sleep(SLOW_COMMIT_S)
    commit(*args)

  pipeline._commit = slow


def malloc_recipe(nvme_dir, recipe):
  params = {f"w{i}": jax.numpy.full((2048, 1024), 0.5, np.float32) for i in range(8)}
  grads = jax.tree.map(lambda p: jax.numpy.full_like(p, 1e-3), params)
  tx = oo.offload(optax.adamw(1e-3), nvme_dir=nvme_dir, host_limit=0, window_bytes=40 << 20)
  step = make_step(tx)
  state = tx.init(params)

  def faults(steps):
    nonlocal params, state
    out = []
    for _ in range(steps):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      params, state = step(params, state, grads)
      jax.block_until_ready(state)
      oo.sync_nvme(state)
      out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
    return " ".join(f"{f:.2f}" for f in out)

  print("before", faults(4), flush=True)
  with open(recipe) as f:
    exec(compile(f.read(), recipe, "exec"), {})
  print("after", faults(6), flush=True)
  oo.close_nvme(state)


def main():
  command, args = sys.argv[1], sys.argv[2:]
  if command == "train":
    train(args[0], int(args[1]))
  elif command == "init":
    make_tx(args[0]).init(make_params())
  elif command == "exit":
    exit_unsynced(args[0], int(args[1]), args[2])
  elif command == "malloc":
    malloc_recipe(args[0], args[1])
  else:
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
  main()
