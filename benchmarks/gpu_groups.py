"""Compile time and program size against the number of groups: one stacked leaf in row slices.

Compiles one donated `oo.update_and_apply` step of AdamW on one stacked fp32 leaf of `n` layers
(``(n, 128, 256)``, one layer a row slice: the window holds about one layer's state per group)
for the H100 target without a GPU, and prints, per `n`: the groups, XLA's compile time, the
scheduled program's instruction count, device temp over the window, host temp, and the copies in
flight during compute each way.

    python benchmarks/gpu_groups.py --slices 16 128
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from optax_offload._src import gpu_program  # noqa: E402

ROW = (128, 256)


def compile_slices(n: int, target: str = "h100_80gb", **offload_kwargs):
  """The compiled step of one (n, 128, 256) fp32 leaf in n one-layer row slices."""
  params = {"layers": jax.ShapeDtypeStruct((n,) + ROW, jnp.float32)}
  row_state = 2 * 4 * ROW[0] * ROW[1]  # mu and nu of one layer
  window = int(2.25 * row_state) + 1024
  tx = oo.offload(optax.adamw(1e-3), window_bytes=window, **offload_kwargs)
  state = oo.abstract_state(tx, params)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  program = gpu_program.compile_for_gpu(
    step, params, state, params, donate_argnums=(0, 1), target=target
  )
  return program, window


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--slices", type=int, nargs="+", default=[16, 128])
  parser.add_argument("--target", default="h100_80gb")
  args = parser.parse_args(argv)
  rows = []
  for n in args.slices:
    program, window = compile_slices(n, args.target)
    s = program.schedule
    row = {
      "slices": n,
      "compile_s": round(program.compile_seconds, 2),
      "cached": program.cached,  # compile_s is then the kept compile's
      "instructions": program.instruction_count,
      "temp_over_window": round(program.memory.temp / window, 2),
      "host_temp": program.memory.host_temp,
      "to_device": s.overlap("to_device", per_execution=True),
      "to_host": s.overlap("to_host", per_execution=True),
    }
    print(row, flush=True)
    rows.append(row)
  return rows


if __name__ == "__main__":
  main()
