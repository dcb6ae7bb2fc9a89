"""The standard step, ``tx.update`` + ``optax.apply_updates``, compiled for an H100 (no GPU needed).

docs/gpu.md, "tx.update in the compiled program": copies in flight while the device computes (in /
out, a loop body's once per iteration), device bytes and temporaries, and the `pad` instructions of
the program, for the Llama-style training step of `benchmarks/llama.py` (bf16 params, fp32 master +
AdamW offloaded, ``value_and_grad`` then the update), with ``tx.update`` or ``update_and_apply``,
with XLA's default options or `oo.STREAM_XLA_OPTIONS`:

    python benchmarks/gpu_tx_update.py                     # d 512, 8 layers, 16 MiB, 24 GiB target
    python benchmarks/gpu_tx_update.py --model 13B --window-mib 1024 --seq 2048 \\
        --target h100_80gb --paths update --options default   # about 5 min on 2 loaded cores

A compile that aborts XLA (its rematerialization pass, with `STREAM_XLA_OPTIONS` at 13B) takes the
process with it: run one path and one option set per process there.
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
from benchmarks.gpu_memory import offload_params  # noqa: E402
from optax_offload._src import gpu_program  # noqa: E402

MiB = 1 << 20
SMALL = llama.Config(d=512, layers=8, ffn=1536, heads=8, vocab=8192)


def measure(cfg: llama.Config, path: str, options: str, window: int, seq: int, target: str) -> dict:
  params = offload_params(cfg, "offload_state")
  tx = oo.offload(optax.adamw(1e-4), master_dtype=jnp.float32, window_bytes=window)
  state = oo.abstract_state(tx, params)
  tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)

  def step(params, state, tokens):
    loss, grads = jax.value_and_grad(lambda p: llama.loss_fn(cfg, p, tokens))(params)
    if path == "update_and_apply":
      params, state = oo.update_and_apply(tx, grads, state, params)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state, loss

  flags = oo.STREAM_XLA_OPTIONS if options == "stream" else None
  program = gpu_program.compile_for_gpu(
    step, params, state, tokens, donate_argnums=(0, 1), target=target, xla_flags=flags
  )
  schedule = program.schedule
  out = {"params": cfg.params, "path": path, "options": options, "window_bytes": window}
  for d in ("to_device", "to_host"):
    out[d] = list(schedule.overlap(d, per_execution=True))
  out.update(
    device_bytes=program.memory.device,
    temp_bytes=program.memory.temp,
    pads=program.hlo.count(" pad("),
    host_compute=len(schedule.host_compute),
    compile_seconds=round(program.compile_seconds, 1),
  )
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--model", default=None, help="a name of llama.CONFIGS (default: d 512, 8 layers)"
  )
  parser.add_argument("--window-mib", type=int, default=16)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--target", default="h100_24gb")
  parser.add_argument("--paths", default="update,update_and_apply")
  parser.add_argument("--options", default="stream,default", help="stream and/or default")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  cfg = llama.CONFIGS[args.model] if args.model else SMALL
  rows = []
  for path in args.paths.split(","):
    for options in args.options.split(","):
      row = measure(cfg, path, options, args.window_mib * MiB, args.seq, args.target)
      rows.append(row)
      print(
        f"{path:16s} {options:8s} in {row['to_device'][0]}/{row['to_device'][1]} "
        f"out {row['to_host'][0]}/{row['to_host'][1]} device {row['device_bytes'] / MiB:.1f} MiB "
        f"temp {row['temp_bytes'] / MiB:.1f} MiB pads {row['pads']}",
        flush=True,
      )
  if args.json:
    write_json({"model": args.model or "small", "target": args.target, "rows": rows}, args.json)


if __name__ == "__main__":
  main()
