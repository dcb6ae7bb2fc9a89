"""`oo.value_and_update` with the optimizer state on NVMe, from the compiled GPU program (no GPU).

Compiles the fused step of a small Llama-style decoder (`benchmarks.llama`, d=64, fp32, stack in
pinned host memory, adamw, 512 KiB window) for the RTX 4090 (24 GB) target, with all its
offloaded state on NVMe (``--tier nvme``, a temporary directory) or in pinned host memory
(``--tier host``), and prints the device and host bytes and where the NVMe callbacks sit (per
computation: callbacks, executions per step). `tests/test_fused_nvme.py` pins the 6-layer NVMe
figures.

    python benchmarks/fused_nvme_program.py --layers 6 --tier nvme
    python benchmarks/fused_nvme_program.py --layers 12 --tier host
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optax_offload as oo  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks.stream_layers import streamed_loss_fn  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--tier", choices=("nvme", "host"), default="nvme")
  parser.add_argument("--target", default="rtx4090_24gb")
  args = parser.parse_args()
  cfg = llama.Config(d=64, layers=args.layers, ffn=128, heads=4, vocab=256)
  params = jax.device_put(llama.init_params(cfg, jax.random.key(0), jnp.float32), llama.DEVICE)
  params = dict(params, layers=oo.to_pinned_host(params["layers"]))
  with tempfile.TemporaryDirectory() as d:
    nvme = {"host_limit": 0, "nvme_dir": d} if args.tier == "nvme" else {}
    tx = oo.offload(optax.adamw(1e-2), min_size=256, window_bytes=512 * 1024, **nvme)
    state = tx.init(params)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    step = oo.value_and_update(lambda p, t: streamed_loss_fn(cfg, p, t), tx)
    try:
      program = oo.compile_for_gpu(
        step, params, state, tokens, donate_argnums=(0, 1), target=args.target
      )
    finally:
      if args.tier == "nvme":
        oo.close_nvme(state)
  schedule, memory = program.schedule, program.memory
  where = {}
  for name, instructions in schedule.computations.items():
    n = sum(1 for i in instructions if i.name in schedule.callbacks)
    if n:
      where["entry" if name == schedule.entry else name] = (n, schedule.executions(name))
  print(f"layers {args.layers}, state tier {args.tier}, target {args.target}")
  print(f"device bytes {memory.device} (temp {memory.temp}), host bytes {memory.host}")
  print(f"callbacks per computation (callbacks, executions per step): {where}")
  print(f"host compute instructions: {len(schedule.host_compute)}")


if __name__ == "__main__":
  main()
