"""Layer stacks on NVMe (`oo.write_nvme_stack`): measured on this machine, modelled for a GPU.

``cpu``: writes a stack of bf16 MLP layers (`--stack-bytes`) to `--dir`, then times a jitted
gradient step of LoRA adapters on that frozen base (`oo.offloaded_scan`) twice in the same
process: the base on NVMe, and the same base in pinned host memory (the baseline). Reports the
ratio of their step times, the bytes the store read per step and their rate, beside the disk's
own read rate measured on the same directory (`oo.measure_bandwidths`: a file written, dropped
from the page cache, read back).

``train``: the same MLP stack trained whole (`oo.value_and_update`, AdamW with an fp32 master
copy in pinned host memory): the stack's bf16 weights on NVMe (each block's new weights written to
the store's next generation in the backward pass), against the same stack in pinned host memory
in the same process. Reports the ratio of their step times, the store's layer fetches and bytes read
and written per step (a fetch of a layer still in the write-behind buffer reads nothing, so the
bytes read move with the disk's timing), beside the disk's own read and write rates.

``gpu``: compiles the LoRA step of a Llama-shaped decoder (`--model`, the base's weights in bf16
on NVMe, rank-16 adapters on wq and wv on the device, batch `--batch` x `--seq`) for `--target`
without a GPU, and prints the device bytes XLA assigns, the read callbacks, and the step time that
`oo.timeline` models with the disk's reads (one layer per callback, two layers read ahead, the
PCIe 4.0 drive of `hardware(target, "desktop")`) against the same program's compute alone. A
modelled time, not a measurement.

    python benchmarks/nvme_stack.py cpu --dir /nvme/bench
    python benchmarks/nvme_stack.py train --dir /nvme/bench
    python benchmarks/nvme_stack.py gpu --model 70B --target rtx4090_24gb --batch 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks._common import write_json  # noqa: E402
from optax_offload._src import nvme_stack  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
RANK = 16


def _mlp(x, w):
  """One MLP layer with a LoRA adapter on its input projection."""
  up = x @ w["base"]["w_in"] + (x @ w["lora"]["a"]) @ w["lora"]["b"]
  return x + jax.nn.gelu(up) @ w["base"]["w_out"], None


def _mlp_stack(args):
  """The measured runs' stack of bf16 MLP layers, written to NVMe under `--dir` (a temporary
  directory by default; `_remove` deletes it after the run): (layers, bytes a layer, the
  measured directory, the stack's directory, the stack's leaves, a random generator)."""
  d, f = args.d, 4 * args.d
  layer_bytes = 2 * d * f * 2
  n = max(2, int(oo.parse_bytes(args.stack_bytes, "--stack-bytes")) // layer_bytes)
  rng = np.random.default_rng(0)
  directory = args.dir or tempfile.mkdtemp(prefix="nvme_stack_bench_")
  os.makedirs(directory, exist_ok=True)
  stack_dir = tempfile.mkdtemp(dir=directory)

  def layer(i):
    return {
      "w_in": (rng.standard_normal((d, f), np.float32) * 0.02).astype(jnp.bfloat16),
      "w_out": (rng.standard_normal((f, d), np.float32) * 0.02).astype(jnp.bfloat16),
    }

  stack = oo.write_nvme_stack(stack_dir, layer, num_layers=n)
  return n, layer_bytes, directory, stack_dir, stack, rng


def _remove(stack_dir: str, directory: str, args) -> None:
  """Deletes the measured stack, and the directory too where it was a temporary one (no `--dir`)."""
  shutil.rmtree(stack_dir, ignore_errors=True)
  if not args.dir:
    shutil.rmtree(directory, ignore_errors=True)


def _compared(n: int, layer_bytes: int, times: dict[str, list[float]], directory: str):
  """(the disk's rates on `directory`, the figures both measured runs report: the stack, each
  run's median step, the first of each compiling, and their ratio)."""
  disk = oo.measure_bandwidths(directory, nbytes=min(n * layer_bytes, 1 << 30))
  host_s = statistics.median(times["host"][1:])
  nvme_s = statistics.median(times["nvme"][1:])
  return disk, {
    "layers": n,
    "layer_bytes": layer_bytes,
    "stack_bytes": n * layer_bytes,
    "step_s_host": host_s,
    "step_s_nvme": nvme_s,
    "ratio_nvme_to_host": nvme_s / host_s,
  }


def cpu(args) -> dict:
  d, f = args.d, 4 * args.d
  n, layer_bytes, directory, stack_dir, base, rng = _mlp_stack(args)
  on_host = oo.to_pinned_host(jax.tree.map(jnp.asarray, oo.read_nvme_stack(base)))
  lora = oo.to_pinned_host(
    {
      "a": jnp.zeros((n, d, RANK), jnp.bfloat16),
      "b": jnp.full((n, RANK, f), 0.01, jnp.bfloat16),
    }
  )
  x = jnp.asarray(rng.standard_normal((args.tokens, d)), jnp.bfloat16)

  def loss(lora, base, x):
    y, _ = oo.offloaded_scan(_mlp, x, {"base": base, "lora": lora})
    return jnp.mean(y.astype(jnp.float32) ** 2)

  step = jax.jit(jax.grad(loss))
  opened = nvme_stack._OPEN[nvme_stack._key(stack_dir)]
  times: dict[str, list[float]] = {"host": [], "nvme": []}
  read = []
  for _ in range(args.repeats + 1):  # the first of each compiles
    for name, b in (("host", on_host), ("nvme", base)):
      before = opened.store.stats["bytes_read"]
      t = time.perf_counter()
      jax.block_until_ready(step(lora, b, x))
      times[name].append(time.perf_counter() - t)
      if name == "nvme":
        read.append(opened.store.stats["bytes_read"] - before)
  stats = opened.store.stats
  oo.close_nvme_stack(base)
  disk, out = _compared(n, layer_bytes, times, directory)
  _remove(stack_dir, directory, args)
  host_s, nvme_s = out["step_s_host"], out["step_s_nvme"]
  per_step = statistics.median(read[1:])
  out = {
    **out,
    "bytes_read_per_step": per_step,
    "read_rate_in_step": per_step / nvme_s,
    "disk_read_rate": disk.nvme_read,
    "store_stats": {k: stats[k] for k in ("fetches", "prefetch_hits", "misses", "waits")},
  }
  print(
    f"{n} layers of {oo.format_bytes(layer_bytes)} ({oo.format_bytes(n * layer_bytes)}), "
    f"{args.tokens} tokens x d {d}, LoRA rank {RANK}: gradient step with the base in pinned "
    f"host memory {host_s:.3f} s, on NVMe {nvme_s:.3f} s (x{nvme_s / host_s:.2f}); the store "
    f"read {oo.format_bytes(per_step)} a step ({per_step / n / layer_bytes:.2f} stacks), "
    f"{per_step / nvme_s / 1e9:.2f} GB/s over the step; this disk reads "
    f"{disk.nvme_read / 1e9:.2f} GB/s (oo.measure_bandwidths); store: {out['store_stats']}"
  )
  return out


def train(args) -> dict:
  """``train``: see the module docstring."""
  import optax

  d = args.d
  n, layer_bytes, directory, stack_dir, stack, rng = _mlp_stack(args)

  def body(x, w):
    return x + jax.nn.gelu(x @ w["w_in"]) @ w["w_out"], None

  def loss(p, x):
    y, _ = oo.offloaded_scan(body, x, p["layers"])
    return jnp.mean(y.astype(jnp.float32) ** 2)

  x = jnp.asarray(rng.standard_normal((args.tokens, d)), jnp.bfloat16)
  runs = {
    "host": {"layers": oo.to_pinned_host(jax.tree.map(jnp.asarray, oo.read_nvme_stack(stack)))},
    "nvme": {"layers": stack},
  }
  steps, states = {}, {}
  for name, params in runs.items():
    tx = oo.offload(optax.adamw(1e-4), master_dtype=jnp.float32)
    states[name] = tx.init(params)
    steps[name] = jax.jit(oo.value_and_update(loss, tx), donate_argnums=(0, 1))
  opened = nvme_stack._OPEN[nvme_stack._key(stack_dir)]
  # Rounds of `--steps` steps of each, back to back (the NVMe store writes a step's generation
  # behind the next step, as in training), the NVMe round closed by a sync of the store: the
  # median round's time per step.
  times: dict[str, list[float]] = {"host": [], "nvme": []}
  moved = []
  for _ in range(args.repeats + 1):  # the first round compiles
    for name in ("host", "nvme"):
      before = dict(opened.store.stats)
      t = time.perf_counter()
      for _ in range(args.steps):
        _, runs[name], states[name] = steps[name](runs[name], states[name], x)
      jax.block_until_ready((runs[name], states[name]))
      if name == "nvme":
        opened.store.sync()  # the round's generations written and committed
      times[name].append((time.perf_counter() - t) / args.steps)
      if name == "nvme":
        after = opened.store.stats
        moved.append(
          (
            (after["bytes_read"] - before["bytes_read"]) / args.steps,
            (after["bytes_written"] - before["bytes_written"]) / args.steps,
            (after["fetches"] - before["fetches"]) / args.steps,
          )
        )
  oo.close_nvme_stack(runs["nvme"]["layers"])
  disk, out = _compared(n, layer_bytes, times, directory)
  _remove(stack_dir, directory, args)
  host_s, nvme_s = out["step_s_host"], out["step_s_nvme"]
  read, written, fetches = (statistics.median(m[i] for m in moved[1:]) for i in range(3))
  disk_s = read / disk.nvme_read + written / disk.nvme_write
  out = {
    **out,
    "bytes_read_per_step": read,
    "bytes_written_per_step": written,
    "layer_fetches_per_step": fetches,
    "disk_read_rate": disk.nvme_read,
    "disk_write_rate": disk.nvme_write,
    "disk_s_at_measured_rates": disk_s,
  }
  print(
    f"{n} layers of {oo.format_bytes(layer_bytes)} ({oo.format_bytes(n * layer_bytes)}), "
    f"{args.tokens} tokens x d {d}, AdamW with an fp32 master copy in host memory: training "
    f"step with the stack's weights in pinned host memory {host_s:.3f} s, on NVMe {nvme_s:.3f} s "
    f"(x{nvme_s / host_s:.2f}); the store read {oo.format_bytes(read)} for {fetches:g} layer "
    f"fetches and wrote {oo.format_bytes(written)} a step; this disk reads {disk.nvme_read / 1e9:.2f} GB/s and "
    f"writes {disk.nvme_write / 1e9:.2f} GB/s (oo.measure_bandwidths): {disk_s:.3f} s for those "
    "bytes alone"
  )
  return out


def _lora_layer(cfg: llama.Config, x, w):
  """`llama._layer` with rank-`RANK` adapters on wq and wv: ``h @ W + (h @ A) @ B``."""
  p, a = w["base"], w["lora"]
  b, s, d = x.shape
  hd = d // cfg.heads
  h = llama._rms_norm(x, p["attn_norm"])

  def proj(name):
    out = jnp.einsum("bsd,de->bse", h, p["w" + name])
    if "a" + name in a:
      out = out + jnp.einsum(
        "bsr,re->bse", jnp.einsum("bsd,dr->bsr", h, a["a" + name]), a["b" + name]
      )
    return out.reshape(b, s, cfg.heads, hd)

  q, k, v = proj("q"), proj("k"), proj("v")
  x = x + jnp.einsum("bsd,de->bse", llama._attention(q, k, v).reshape(b, s, d), p["wo"])
  h = llama._rms_norm(x, p["mlp_norm"])
  gate = jnp.einsum("bsd,df->bsf", h, p["w_gate"])
  up = jnp.einsum("bsd,df->bsf", h, p["w_up"])
  return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, p["w_down"])


def gpu(args) -> dict:
  cfg = llama.CONFIGS[args.model]
  shapes = llama.abstract_params(cfg, jnp.bfloat16, sharding=llama.DEVICE)
  gen = jax.ShapeDtypeStruct((), jnp.int32, sharding=llama.DEVICE)
  base = {  # stand-ins: nothing is read while compiling, so no stack need exist on disk
    k: nvme_stack.NvmeStackLeaf(gen, "/compile-only", f"['{k}']", a.shape, a.dtype)
    for k, a in shapes["layers"].items()
  }
  L, d = cfg.layers, cfg.d
  lora = {
    f"{ab}{n}": jax.ShapeDtypeStruct(
      (L, d, RANK) if ab == "a" else (L, RANK, d), jnp.bfloat16, sharding=llama.DEVICE
    )
    for ab in "ab"
    for n in "qv"
  }
  frozen = {k: shapes[k] for k in ("embed", "final_norm", "head")}
  tokens = jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32, sharding=llama.DEVICE)

  def loss(lora, base, frozen, tokens):
    x = frozen["embed"][tokens[:, :-1]]
    x, _ = oo.offloaded_scan(
      lambda x, w: (_lora_layer(cfg, x, w), None), x, {"base": base, "lora": lora}
    )
    x = llama._rms_norm(x, frozen["final_norm"])
    logits = jnp.einsum("bsd,dv->bsv", x, frozen["head"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  t = time.perf_counter()
  program = oo.compile_for_gpu(
    jax.value_and_grad(loss),
    lora,
    base,
    frozen,
    tokens,
    target=args.target,
    xla_flags=oo.STREAM_XLA_OPTIONS,
  )
  wall = time.perf_counter() - t
  layer_bytes = sum(a.nbytes // L for a in base.values())
  hw = oo.hardware(args.target, host="desktop")
  disk = {nvme_stack.FETCH_SCOPE: (layer_bytes, 0)}
  modelled = oo.timeline(program, hw, disk=disk, read_ahead_bytes=2 * layer_bytes)
  summary = program.schedule.summary()
  tokens_per_step = args.batch * args.seq
  out = {
    "model": args.model,
    "target": args.target,
    "base_bytes": L * layer_bytes,
    "layer_bytes": layer_bytes,
    "device_bytes": program.memory.device,
    "device_temp_bytes": program.memory.temp,
    "callbacks": summary["callbacks"],
    "compile_s": program.compile_seconds,
    "wall_s": wall,
    "modelled_step_s": modelled.step_s,
    "modelled_compute_s": modelled.compute_s,
    "modelled_disk_s": modelled.disk_s,
    "modelled_disk_wait_s": modelled.disk_wait_s,
    "modelled_callbacks": modelled.callbacks,
    "modelled_callback_s": modelled.callback_s,
    "modelled_link_to_device_s": modelled.link_to_device_s,
    "modelled_transfer_wait_s": modelled.transfer_wait_s,
    "tokens_per_step": tokens_per_step,
    "modelled_tokens_per_s": tokens_per_step / modelled.step_s,
  }
  print(
    f"{args.model} LoRA (rank {RANK} on wq, wv), base {oo.format_bytes(L * layer_bytes)} bf16 on "
    f"NVMe, batch {args.batch} x {args.seq}, compiled for {args.target}: device "
    f"{oo.format_bytes(program.memory.device)} (temporaries "
    f"{oo.format_bytes(program.memory.temp)}), {summary['callbacks']} read callbacks, "
    f"compile {program.compile_seconds:.1f} s. Modelled (oo.timeline, {hw.name}): step "
    f"{modelled.step_s:.2f} s, of which compute alone {modelled.compute_s:.2f} s, disk busy "
    f"{modelled.disk_s:.2f} s, the stream waiting on the disk {modelled.disk_wait_s:.2f} s and in "
    f"{modelled.callbacks} callbacks {modelled.callback_s:.2f} s, the link to the device busy "
    f"{modelled.link_to_device_s:.2f} s; "
    f"{tokens_per_step / modelled.step_s:,.0f} tokens/s."
  )
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
  sub = parser.add_subparsers(dest="what", required=True)
  c = sub.add_parser("cpu", allow_abbrev=False)
  c.add_argument("--dir", help="a directory on the disk to measure (default: a temporary one)")
  c.add_argument("--stack-bytes", default="512MiB")
  c.add_argument("--d", type=int, default=1024)
  c.add_argument("--tokens", type=int, default=512)
  c.add_argument("--repeats", type=int, default=3)
  t = sub.add_parser("train", allow_abbrev=False)
  t.add_argument("--dir", help="a directory on the disk to measure (default: a temporary one)")
  t.add_argument("--stack-bytes", default="256MiB")
  t.add_argument("--d", type=int, default=1024)
  t.add_argument("--tokens", type=int, default=512)
  t.add_argument("--repeats", type=int, default=3, help="rounds")
  t.add_argument("--steps", type=int, default=3, help="steps a round")
  g = sub.add_parser("gpu", allow_abbrev=False)
  g.add_argument("--model", default="13B", choices=sorted(llama.CONFIGS))
  g.add_argument("--target", default="rtx4090_24gb")
  g.add_argument("--batch", type=int, default=1)
  g.add_argument("--seq", type=int, default=2048)
  for p in (c, t, g):
    p.add_argument("--json", help="also write the figures to this file")
  args = parser.parse_args(argv)
  out = {"cpu": cpu, "train": train, "gpu": gpu}[args.what](args)
  if args.json:
    write_json(out, args.json)
  return out


if __name__ == "__main__":
  main()
