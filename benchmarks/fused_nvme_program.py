"""`oo.value_and_update` with the optimizer state on NVMe, from the compiled GPU program (no GPU).

Compiles the fused step of a small Llama-style decoder (`benchmarks.llama`, d=64, fp32, stack in
pinned host memory, adamw, 512 KiB window) for the RTX 4090 (24 GB) target, with all its
offloaded state on NVMe (``--tier nvme``, a temporary directory) or in pinned host memory
(``--tier host``), and prints the device and host bytes and where the NVMe callbacks sit (per
computation: callbacks, executions per step). `tests/test_fused_nvme.py` pins the 6-layer NVMe
figures.

``--model 13B`` (or another `benchmarks.llama` size) compiles the model's real step instead: bf16
weights in pinned host memory (`oo.offloaded_scan`), AdamW with an fp32 master copy, the update in
the backward pass (`oo.value_and_update`), one micro-batch of ``--micro-batch`` x 2,048 tokens,
Pallas flash attention, the state placed by the one-host-budget plan for ``--host-memory``
(`benchmarks.gpu_speed.nvme_plan`: what the stack's weights and the staging buffers leave holds
state in host memory, the rest is on NVMe), at full depth, and prints XLA's device and host bytes,
the callbacks per step, the copies in flight during a matmul and the compile time.
`benchmarks/gpu_speed.py --variants fused_nvme` models its speed.

    python benchmarks/fused_nvme_program.py --layers 6 --tier nvme
    python benchmarks/fused_nvme_program.py --layers 12 --tier host
    python benchmarks/fused_nvme_program.py --model 13B --host-memory 48GiB
    python benchmarks/fused_nvme_program.py --model 13B --host-memory 58GiB --micro-batch 3 \
        --accumulate 40 --accumulator-dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
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
from optax_offload._src import gpu_program  # noqa: E402

GiB = 1 << 30


def model_program(args) -> None:
  """The real model's fused NVMe step (``--model``): its bytes, callbacks, overlap, compile time."""
  from benchmarks import gpu_speed

  args.host_memory = oo.parse_bytes(args.host_memory, "--host-memory")
  args.nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="fused_nvme_program_")
  args.moment_dtype = args.moment_dtype or "fp32"
  args.device_leaves = gpu_speed.device_leaves_arg(args.device_leaves)
  cfg = dataclasses.replace(llama.CONFIGS[args.model], attention="flash")
  window = int(args.window_fraction * gpu_speed.MEMORY[args.target])
  k = args.accumulate
  e, c = gpu_speed.compile_nvme(cfg, args.target, args, window, None, k)
  schedule = gpu_program.parse_schedule(c.hlo)
  _, runs = gpu_speed.nvme_disk_io(c.hlo)
  per_step = sum(
    schedule.executions(comp)
    for comp, instrs in schedule.computations.items()
    for i in instrs
    if i.name in schedule.callbacks
  )
  print(
    f"{args.model} ({cfg.params:,} params), {cfg.layers} layers compiled, target {args.target},"
    f" {args.moment_dtype} moments, {k} micro-batch(es) of {args.micro_batch} x 2,048 a step"
    + (f" ({args.accumulator_dtype} accumulators)" if k > 1 else "")
  )
  print(
    f"plan for --host-memory {args.host_memory / GiB:.2f} GiB: state in host memory"
    f" {e.host_bytes / GiB:.2f} GiB (host_limit={e.host_bytes}), NVMe {e.nvme_bytes / GiB:.2f} GiB,"
    f" host in all {e.host_total_bytes / GiB:.2f} GiB"
    + (
      f"; the stack's weights on NVMe {e.nvme_weight_bytes / GiB:.2f} GiB"
      if e.nvme_weight_bytes
      else ""
    )
  )
  m = c.memory
  print(
    f"device bytes {c.device_bytes} ({c.device_bytes / GiB:.2f} GiB, memory_analysis;"
    f" temporaries {m.temp / GiB:.2f} GiB)"
  )
  print(
    f"host bytes {c.host_bytes} ({c.host_bytes / GiB:.2f} GiB, XLA's pinned-host buffers;"
    f" temporaries {m.host_temp / GiB:.2f} GiB)"
  )
  print(f"callbacks per step {per_step}, of them NVMe: {runs}")
  for d in ("to_device", "to_host"):
    busy, total = schedule.overlap(d, per_execution=True)
    hit, _ = schedule.overlap(d, per_execution=True, matmul=True)
    print(f"copies {d} per step {total}: in flight during compute {busy}, during a matmul {hit}")
  print(f"compile {c.compile_s:.1f} s{' (cached)' if c.cached else ''}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--tier", choices=("nvme", "host"), default="nvme")
  parser.add_argument("--target", default="rtx4090_24gb")
  parser.add_argument("--model", default=None, help="a benchmarks.llama size, e.g. 13B")
  parser.add_argument("--host-memory", default="48GiB", help="--model: the host budget")
  parser.add_argument("--micro-batch", type=int, default=4, help="--model: sequences of 2,048")
  parser.add_argument("--moment-dtype", default=None, choices=("fp32", "bf16", "int8"))
  parser.add_argument("--accumulate", type=int, default=1, help="--model: micro-batches a step")
  parser.add_argument(
    "--device-leaves", default="", help="--model: stack leaves kept on the device, e.g. wq,wo"
  )
  parser.add_argument("--xla-slop-factor", type=int, default=None, help="--model: as gpu_speed's")
  parser.add_argument(
    "--accumulator-dtype", default="fp32", choices=("fp32", "bf16"), help="--model, --accumulate"
  )
  parser.add_argument("--window-fraction", type=float, default=0.1, help="--model: window / card")
  parser.add_argument("--nvme-dir", default=None, help="--model: NVMe tier directory (temp)")
  parser.add_argument(
    "--weights-on",
    default="device",
    choices=("device", "nvme"),
    help="--model: nvme puts the stack's weights on NVMe, trained there; device (the default) "
    "leaves them where the params are placed: the stack in pinned host memory",
  )
  args = parser.parse_args()
  if args.model is not None:
    return model_program(args)
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
