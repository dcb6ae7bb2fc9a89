"""Child process for the NVMe-tier crash test: trains with an NVMe tier until killed.

Usage: python nvme_tier_child.py NVME_DIR STEPS [--no-close]
Prints "ready" once compilation is done (after two steps). With ``--no-close`` it exits after the last
step without `oo.sync_nvme` or `oo.close_nvme` (the store's exit hook has to flush the queued commit).
"""

import sys

import jax
import optax
from conftest import make_grads
from conftest import make_params

import optax_offload as oo

CONFIG = {"window_bytes": 100_000, "host_limit": "200KiB"}


def make_tx(nvme_dir):
  return oo.offload(optax.adamw(1e-2), nvme_dir=nvme_dir, **CONFIG)


def main():
  nvme_dir, steps = sys.argv[1], int(sys.argv[2])
  close = "--no-close" not in sys.argv[3:]
  tx = make_tx(nvme_dir)
  params = make_params()
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for t in range(steps):
    params, state = step(params, state, make_grads(params, t))
    jax.block_until_ready(state)
    if t == 1:
      print("ready", flush=True)  # compiled (the second call compiles again for committed inputs)
  if close:
    oo.close_nvme(state)


if __name__ == "__main__":
  main()
