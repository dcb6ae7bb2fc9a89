"""GPU memory headline, from compiled programs: how large a Llama-style model trains on each card.

Compiles one training step (forward + backward under remat, AdamW) of a Llama-style decoder
(`benchmarks.llama`: layers stacked under `lax.scan`, batch 1 x 2048) for an H100 80 GB and for the
same chip with 24 GiB, without a GPU (`optax_offload`'s compile-for-GPU harness), and reads device
and host bytes from XLA's buffer assignment. Variants:

* ``plain_fp32``: fp32 params, ``optax.adamw`` (16 B/param on the device);
* ``plain_bf16``: bf16 params, ``optax.adamw(mu_dtype=fp32)`` (no master copy);
* ``offload_state``: bf16 params, ``oo.offload(optax.adamw, master_dtype=fp32)`` with
  ``oo.update_and_apply``: fp32 master weights and moments in pinned host memory, streamed through
  a window of `--window` (default 10% of the card; 25% for ``offload_all``, whose device is
  otherwise nearly empty: fewer groups compile faster, see docs/gpu.md);
* ``offload_all``: as ``offload_state`` with the layer stack's bf16 weights and gradients in pinned
  host memory too: `oo.offloaded_scan` brings each layer in during the forward and backward pass
  and sends its gradient back; `oo.update_and_apply` streams (weights, gradients, state) row slices
  through the window. Compiled with `oo.STREAM_XLA_OPTIONS`.

"Fits" means device bytes <= `--usable` x the card's memory (XLA preallocates 75% unless
``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise; set it to 0.95 to use what this assumes).
``--largest`` finds the largest model of the 13B shape (d 5120, ffn 13824) that fits each card
(not for ``offload_all``, whose device bytes barely grow with the layers: host memory and disk
bound it, 16 B/param; ``python -m optax_offload plan`` says how they split):
device bytes are linear in the number of layers, so it compiles two depths, solves for the most
layers under the limit and compiles that depth to check.

    python benchmarks/gpu_memory.py --json bench_out/gpu_memory.json          # 1B, 7B, 13B
    python benchmarks/gpu_memory.py --models 1B --targets h100_24gb --variants offload_state
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks._common import write_json  # noqa: E402
from benchmarks.stream_layers import streamed_loss_fn  # noqa: E402
from optax_offload._src import gpu_program  # noqa: E402

VARIANTS = ("plain_fp32", "plain_bf16", "offload_state", "offload_all")
OPTIONAL = ("offload_host",)
"""``offload_host``: as ``offload_state`` with ``update_on="host"`` (the update runs on the CPU)."""
GiB = 1 << 30
_MEMORY = {"h100_80gb": 84978434048, "h100_24gb": 24 * GiB}


def offload_params(cfg: llama.Config, variant: str) -> dict:
  """bf16 params on the device; with ``offload_all`` the layer stack in pinned host memory."""
  stack = llama.HOST if variant == "offload_all" else None
  return llama.abstract_params(cfg, jnp.bfloat16, sharding=llama.DEVICE, stack_sharding=stack)


def compile_step(cfg: llama.Config, variant: str, target: str, window: int | None, seq: int = 2048):
  """The compiled training step of `cfg` in `variant` for `target`."""
  tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)
  if variant == "plain_fp32":
    params, tx = llama.abstract_params(cfg, jnp.float32), optax.adamw(1e-4)
    state = jax.eval_shape(tx.init, params)
  elif variant == "plain_bf16":
    params = llama.abstract_params(cfg, jnp.bfloat16)
    tx = optax.adamw(1e-4, mu_dtype=jnp.float32)
    state = jax.eval_shape(tx.init, params)
  elif variant in ("offload_state", "offload_host", "offload_all"):
    params = offload_params(cfg, variant)
    tx = oo.offload(
      optax.adamw(1e-4),
      master_dtype=jnp.float32,
      window_bytes=window,
      update_on="host" if variant == "offload_host" else "device",
    )
    state = oo.abstract_state(tx, params)
  else:
    raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS + OPTIONAL}")

  def step(params, state, tokens):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, tokens))(params)
    if variant.startswith("offload"):
      params, state = oo.update_and_apply(tx, grads, state, params)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state, loss

  loss_fn = streamed_loss_fn if variant == "offload_all" else llama.loss_fn
  options = oo.STREAM_XLA_OPTIONS if variant == "offload_all" else None
  return gpu_program.compile_for_gpu(
    step, params, state, tokens, donate_argnums=(0, 1), target=target, xla_flags=options
  )


def row(name: str, cfg: llama.Config, variant: str, target: str, window, usable: float) -> dict:
  t0, c0 = time.perf_counter(), time.process_time()
  program = compile_step(cfg, variant, target, window)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  memory = program.memory
  out = {
    "model": name,
    "params": cfg.params,
    "layers": cfg.layers,
    "target": target,
    "variant": variant,
    "device_bytes": memory.device,
    "host_bytes": memory.host,
    "fits": memory.device <= usable * _MEMORY[target],
    "device_bytes_per_param": memory.device / cfg.params,
    "window_bytes": window if variant.startswith("offload") else None,
    "compile_s": wall,
    "cached": program.cached,  # read from JAX's compilation cache dir: compile_s is its reading
    # CPU-seconds of this process (trace, lowering, XLA): on a shared machine other jobs inflate
    # the wall time, not this.
    "compile_cpu_s": cpu,
  }
  if variant.startswith("offload"):
    # oo.estimate's device figure (params, grads, window, small-leaf state; activations excluded).
    est = oo.estimate(
      offload_params(cfg, variant),
      optimizer=optax.adamw(1e-4),
      master_dtype="fp32",
      window_bytes=window,
      update_on="host" if variant == "offload_host" else "device",
    )
    out["estimate_device_bytes"] = est.device_bytes
    out["estimate_over_compiled"] = est.device_bytes / memory.device
    for direction in ("to_device", "to_host"):
      hit, total = program.schedule.overlap(direction, per_execution=True)
      out[f"copies_{direction}"] = total
      out[f"copies_{direction}_overlapped"] = hit
  print(
    f"{name:>6} {variant:14s} {target:10s} device {memory.device / GiB:7.2f} GiB"
    f" ({out['device_bytes_per_param']:.2f} B/param), host {memory.host / GiB:7.2f} GiB,"
    f" fits {out['fits']!s:5s} compile {out['compile_s']:.0f}s ({out['compile_cpu_s']:.0f} CPU-s)"
    f"{' (cached)' if out['cached'] else ''}",
    flush=True,
  )
  return out


def largest(variant: str, target: str, window, usable: float, base: llama.Config) -> dict:
  """The deepest model of `base`'s width that fits `target`, by two compiles and a check."""
  limit = usable * _MEMORY[target]
  a, b = 4, 8
  da = compile_step(base.with_layers(a), variant, target, window).memory.device
  db = compile_step(base.with_layers(b), variant, target, window).memory.device
  per_layer = (db - da) / (b - a)
  layers = int((limit - (da - a * per_layer)) // per_layer)
  check = None
  if layers >= 1:
    check = row(f"L{layers}", base.with_layers(layers), variant, target, window, usable)
    while not check["fits"] and layers > 1:  # the schedule may change near the limit
      layers -= 1
      check = row(f"L{layers}", base.with_layers(layers), variant, target, window, usable)
  cfg = base.with_layers(max(layers, 0))
  return {
    "target": target,
    "variant": variant,
    "largest_layers": layers,
    "largest_params": cfg.params if layers >= 1 else 0,
    "bytes_per_layer": per_layer,
    "checked": check,
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="1B,7B,13B")
  parser.add_argument("--targets", default="h100_80gb,h100_24gb")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument(
    "--window",
    default=None,
    help="offload window (default: 10%% of the card, 25%% for offload_all)",
  )
  parser.add_argument("--usable", type=float, default=0.95, help="usable fraction of the card")
  parser.add_argument("--largest", action="store_true", help="also find the largest model per card")
  parser.add_argument("--json", default=None, help="write the rows here (one object per row)")
  args = parser.parse_args(argv)

  rows, largest_rows = [], []
  for target in args.targets.split(","):
    given = oo.parse_bytes(args.window, "--window")
    for name in args.models.split(","):
      for variant in args.variants.split(","):
        window = given or int((0.25 if variant == "offload_all" else 0.1) * _MEMORY[target])
        rows.append(row(name, llama.CONFIGS[name], variant, target, window, args.usable))
    window = given or int(0.1 * _MEMORY[target])
    if args.largest:
      for variant in args.variants.split(","):
        if variant == "offload_all":  # the device holds a few layers: host and disk set the limit
          print("largest offload_all: not searched (device bytes barely grow with the layers)")
          continue
        found = largest(variant, target, window, args.usable, llama.CONFIGS["13B"])
        largest_rows.append(found)
        print(
          f"largest {variant} on {target}: {found['largest_params'] / 1e9:.1f}B params "
          f"({found['largest_layers']} layers of the 13B shape)",
          flush=True,
        )
  result = {
    "benchmark": "gpu_memory",
    "jax": jax.__version__,
    "rows": rows,
    "largest": largest_rows,
  }
  if args.json:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
    write_json({"largest": largest_rows}, os.path.splitext(args.json)[0] + "_largest.json")
  return result


if __name__ == "__main__":
  main()
