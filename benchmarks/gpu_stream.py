"""How `offload`'s update streams on an H100, from the compiled program (no GPU needed).

For a donated optimizer step (AdamW; gradients as inputs), compiled for the H100 80 GB target:
device temporaries against the window, and the fraction of host<->device copies in flight while
an update computes, for `oo.update_and_apply` and for ``tx.update`` + ``optax.apply_updates``.
Cases: the GPU-program issue's 16 leaves of 1024x1024 f32 at windows of 16, 32 and 64 MiB; 16
leaves of 64 MiB at a 512 MiB window; one stacked leaf of 32 layers (2 GiB of state) at 256 MiB.
With the weights in host memory too (``update_and_apply`` on pinned_host params and gradients, the
way `oo.offloaded_scan` leaves them): the 16 leaves at 32 MiB (f32), and a stacked bf16 leaf with
an fp32 master copy at 80 MiB, each with XLA's default options and with `oo.STREAM_XLA_OPTIONS`.

    python benchmarks/gpu_stream.py --json bench_out/gpu_stream.json
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
from benchmarks import llama  # noqa: E402
from benchmarks._common import write_json  # noqa: E402
from optax_offload._src import gpu_program  # noqa: E402

MiB = 1 << 20
CASES = (
  ("16 x (1024,1024)", 16, (1024, 1024), 16),
  ("16 x (1024,1024)", 16, (1024, 1024), 32),
  ("16 x (1024,1024)", 16, (1024, 1024), 64),
  ("16 x (4096,4096)", 16, (4096, 4096), 512),
  ("1 x (32,4096,2048)", 1, (32, 4096, 2048), 256),
)
HOST_WEIGHT_CASES = (  # name, leaves, shape, window MiB, dtype, master
  ("16 x (1024,1024)", 16, (1024, 1024), 32, jnp.float32, None),
  ("1 x (16,1024,2048) bf16", 1, (16, 1024, 2048), 80, jnp.bfloat16, jnp.float32),
)


def measure(
  leaves: int,
  shape,
  window_mib: int,
  apply: bool,
  target: str,
  *,
  dtype=jnp.float32,
  master=None,
  host_weights: bool = False,
  xla_flags=None,
) -> dict:
  sharding = llama.HOST if host_weights else None
  params = {
    f"w{i:02d}": jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for i in range(leaves)
  }
  tx = oo.offload(optax.adamw(1e-3), window_bytes=window_mib * MiB, master_dtype=master)
  state = oo.abstract_state(tx, params)

  def step(params, state, grads):
    if apply:
      return oo.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  program = gpu_program.compile_for_gpu(
    step, params, state, params, donate_argnums=(0, 1), target=target, xla_flags=xla_flags
  )
  out = {
    "leaves": leaves,
    "shape": list(shape),
    "window_bytes": window_mib * MiB,
    "path": "update_and_apply" if apply else "update",
    "host_weights": host_weights,
    "stream_xla_options": xla_flags is not None,
    "device_temp_bytes": program.memory.temp,
    "temp_over_window": program.memory.temp / (window_mib * MiB),
    "host_temp_bytes": program.memory.host_temp,
    "compile_s": program.compile_seconds,
  }
  out.update(program.schedule.summary())
  return out


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="h100_80gb")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  rows = []
  print(f"{'case':20s} {'window':>7s} {'path':16s} {'temp/window':>11s} {'in':>9s} {'out':>9s}")
  for name, leaves, shape, window in CASES:
    for apply in (True, False):
      r = measure(leaves, shape, window, apply, args.target)
      rows.append(r)
      print(
        f"{name:20s} {window:5d}Mi {r['path']:16s} {r['temp_over_window']:11.3f}"
        f" {r['copies_to_device_overlapped']:4d}/{r['copies_to_device']:<4d}"
        f" {r['copies_to_host_overlapped']:4d}/{r['copies_to_host']:<4d}",
        flush=True,
      )
  for name, leaves, shape, window, dtype, master in HOST_WEIGHT_CASES:
    for flags in (None, oo.STREAM_XLA_OPTIONS):
      r = measure(
        leaves,
        shape,
        window,
        True,
        args.target,
        dtype=dtype,
        master=master,
        host_weights=True,
        xla_flags=flags,
      )
      rows.append(r)
      path = "weights on host" + (" +opts" if flags else "")
      print(
        f"{name:20s} {window:5d}Mi {path:16s} {r['temp_over_window']:11.3f}"
        f" {r['copies_to_device_overlapped']:4d}/{r['copies_to_device']:<4d}"
        f" {r['copies_to_host_overlapped']:4d}/{r['copies_to_host']:<4d}"
        f"  host temp {r['host_temp_bytes']}",
        flush=True,
      )
  if args.json:
    write_json({"benchmark": "gpu_stream", "target": args.target, "rows": rows}, args.json)
  return rows


if __name__ == "__main__":
  main()
