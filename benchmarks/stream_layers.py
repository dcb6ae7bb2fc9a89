"""Streamed layer stacks on an H100, from the compiled program (no GPU needed).

Compiles ``jax.value_and_grad`` of the Llama-style decoder (`benchmarks.llama`, bf16, batch 1 x
`--seq`) for a GPU target (default: the H100 with 24 GiB) twice: ``plain``, the layer stack on the
device under ``lax.scan`` + ``jax.checkpoint`` (`llama.loss_fn`), and ``stream``, the stack in
pinned host memory applied by `oo.offloaded_scan` (compiled with `oo.STREAM_XLA_OPTIONS`). Prints
device and host bytes (XLA's buffer assignment) and, per direction, the fraction of host<->device
copies in flight while a matmul runs, each copy counted once per loop iteration.

    python benchmarks/stream_layers.py --json bench_out/stream_layers.json     # 7B, 13B
    python benchmarks/stream_layers.py --configs 1B --variants stream --seq 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks._common import write_json  # noqa: E402

GiB = 1 << 30
VARIANTS = ("plain", "stream")


def streamed_loss_fn(cfg: llama.Config, params: dict, tokens: jax.Array) -> jax.Array:
  """`llama.loss_fn` with the layer stack (in pinned host memory) applied by `oo.offloaded_scan`."""
  x = params["embed"][tokens[:, :-1]]
  x, _ = oo.offloaded_scan(lambda x, w: (llama._layer(cfg, x, w), None), x, params["layers"])
  x = llama._rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,dv->bsv", x, params["head"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def compile_variant(cfg: llama.Config, variant: str, target: str, seq: int) -> oo.GpuProgram:
  """value_and_grad of the decoder's loss in `variant`, compiled for `target`."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS}")
  stream = variant == "stream"
  params = llama.abstract_params(
    cfg, jnp.bfloat16, sharding=llama.DEVICE, stack_sharding=llama.HOST if stream else None
  )
  tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32, sharding=llama.DEVICE)
  loss = streamed_loss_fn if stream else llama.loss_fn
  options = oo.STREAM_XLA_OPTIONS if stream else None

  def step(params, tokens):
    return jax.value_and_grad(lambda p: loss(cfg, p, tokens))(params)

  return oo.compile_for_gpu(step, params, tokens, target=target, xla_flags=options)


def row(name: str, cfg: llama.Config, variant: str, target: str, seq: int) -> dict:
  t0 = time.perf_counter()
  program = compile_variant(cfg, variant, target, seq)
  memory, schedule = program.memory, program.schedule
  out = {
    "model": name,
    "params": cfg.params,
    "layers": cfg.layers,
    "seq": seq,
    "target": target,
    "variant": variant,
    "device_bytes": memory.device,
    "host_bytes": memory.host,
    "compile_s": time.perf_counter() - t0,
  }
  for direction in ("to_device", "to_host"):
    hit, total = schedule.overlap(direction, per_execution=True, matmul=True)
    out[f"copies_{direction}"] = total
    out[f"copies_{direction}_during_matmul"] = hit
    out[f"bytes_{direction}"] = sum(
      c.nbytes * schedule.executions(c.computation)
      for c in schedule.copies
      if c.direction == direction
    )
  hidden = "  ".join(
    f"{d} {out[f'copies_{d}_during_matmul']}/{out[f'copies_{d}']}"
    for d in ("to_device", "to_host")
    if out[f"copies_{d}"]
  )
  print(
    f"{name:>5} {variant:7s} {target:10s} device {memory.device / GiB:6.2f} GiB, host"
    f" {memory.host / GiB:6.2f} GiB, copies during a matmul: {hidden or '-'}"
    f" (compile {out['compile_s']:.0f}s)",
    flush=True,
  )
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="7B,13B", help=f"of {','.join(llama.CONFIGS)}")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--target", default="h100_24gb")
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--json", default=None, help="write the result here")
  args = parser.parse_args(argv)
  rows = [
    row(name, llama.CONFIGS[name], variant, args.target, args.seq)
    for name in args.configs.split(",")
    for variant in args.variants.split(",")
  ]
  result = {"benchmark": "stream_layers", "jax": jax.__version__, "rows": rows}
  if args.json:
    write_json(result, args.json)
  return result


if __name__ == "__main__":
  main()
