"""Full fine-tuning of a Llama-style 13B model on one 24 GB GPU, 64 GB of RAM and an NVMe drive.

The layer stack's bf16 weights live in pinned host memory and stream through the card layer by
layer (`oo.offloaded_scan`); the optimizer update of each layer runs inside the backward pass as
soon as its gradient exists (`oo.value_and_update`), so the stack's gradients never exist whole;
AdamW's fp32 master copy and moments are split between host memory and the NVMe drive
(`oo.offload(..., master_dtype=jnp.float32, host_limit=..., nvme_dir=...)`). The host budget for
the state is what `oo.estimate` leaves of `--host-memory` after the weights and buffers: the plan
of ``python -m optax_offload plan`` (docs/consumer.md).

  python examples/consumer_13b.py --nvme-dir /nvme/run1 --ckpt-dir /nvme/ckpt   # 13B, on the GPU
      # (Orbax checkpoints every --ckpt-every steps; a rerun resumes from the latest)
  python examples/consumer_13b.py --size tiny --steps 3 --nvme-dir /tmp/run1 --host-limit 64KiB
      # a CPU-sized copy (its state fits in RAM: --host-limit sends the rest to the drive)
  python examples/consumer_13b.py --size tiny --steps 3 --no-nvme       # state in host memory only
  python examples/consumer_13b.py --nvme-dir /tmp/run1 --compile-for rtx4090_24gb  # no GPU (the
      # CUDA plugin): the 13B step compiled for a 24 GB card from its shapes, its device bytes

More tokens per update within 48 GiB of RAM (docs/consumer.md, "Speed"): 60 micro-batches of
2 x 2,048 tokens a step, their gradients accumulated in bf16 (`value_and_update(...,
accumulate=60, accumulator_dtype="bf16")`), 8-bit moments, and the stack's ``wq`` and ``wo``
kept on the card (their weights and accumulators leave the host budget; the card has room for them):

  XLA_PYTHON_CLIENT_MEM_FRACTION=.95 python examples/consumer_13b.py --nvme-dir /nvme/run1 \
      --host-memory 48GiB --batch 2 --accumulate 60 --accumulator-dtype bf16 \
      --moment-dtype int8 --device-leaves wq,wo --window-bytes 1.8GiB --xla-slop-factor 115

With 8-bit moments, ``--head-moment-dtype fp32`` keeps the output kernel's in fp32: its blocks
of 256 run along the vocabulary and mix rare and frequent tokens (docs/tiers.md, "Choosing per
leaf"); 0.98 GB more state for 13B.

The data are the bytes of the Python standard library's source (no download; one byte, one
token): replace `batches` with your tokenizer's output. The weights start random: load your
checkpoint's into `init_params`'s tree instead (one leaf at a time, straight into pinned host
memory, as it does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import lax

import optax_offload as oo


@dataclasses.dataclass(frozen=True)
class Config:
  """A Llama-style decoder: multi-head attention, SwiGLU MLP, RMSNorm, untied head."""

  d: int
  layers: int
  ffn: int
  heads: int
  vocab: int
  seq: int
  batch: int
  window: str | None = None  # offload's window_bytes: must hold one layer row of the largest leaf
  accumulate: int = 1  # micro-batches per optimizer step

  @property
  def params(self) -> int:
    d, f, v = self.d, self.ffn, self.vocab
    return 2 * v * d + d + self.layers * (4 * d * d + 3 * d * f + 2 * d)


SIZES = {
  # Llama-2-13B's shapes (13.0e9 params); batch 1 x 2,048 tokens a step (--batch).
  # The window holds a layer's row of w_down (1.05 GiB of weights, gradients and state) in a
  # group of window / 2.25: at least 2.37 GiB, more than offload's default (10% of the 18 GiB
  # JAX takes of a 24 GB card); the plan and offload both say so when it is too small.
  "13B": Config(
    d=5120, layers=40, ffn=13824, heads=40, vocab=32000, seq=2048, batch=1, window="2.5GiB"
  ),
  # The same code at a size the tests run on the CPU.
  "tiny": Config(d=64, layers=4, ffn=128, heads=4, vocab=256, seq=32, batch=4),
}


def shapes(cfg: Config, device_leaves=()) -> dict:
  """The params as (shape, in pinned host memory?): the layer stack is (but its leaves named in
  `device_leaves`), the rest is not."""
  L, d, f, v = cfg.layers, cfg.d, cfg.ffn, cfg.vocab
  layer = {
    "attn_norm": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
    "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
  }  # fmt: skip
  return {
    "embed": ((v, d), False),
    "layers": {k: ((L, *s), k not in device_leaves) for k, s in layer.items()},
    "final_norm": ((d,), False),
    "head": ((d, v), False),
  }


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], bool)


def init_params(cfg: Config, seed: int = 0, device_leaves=()) -> dict:
  """bf16 params: the stack in pinned host memory (but `device_leaves`), built one layer at a time
  on the host (the 13B stack, 26 GB, never passes through the card); the rest on the device."""
  rng = np.random.default_rng(seed)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  host = device.with_memory_kind("pinned_host")

  def make(path, spec):
    shape, on_host = spec
    out = np.empty(shape, ml_dtypes.bfloat16)
    parts = out if on_host else out[None]  # the stack one layer at a time: small fp32 temporaries
    for part in parts:
      if "norm" in jax.tree_util.keystr(path):
        part[...] = 1
      else:
        part[...] = (rng.standard_normal(part.shape, np.float32) * 0.02).astype(part.dtype)
    return jax.device_put(out, host if on_host else device)

  return jax.tree_util.tree_map_with_path(make, shapes(cfg, device_leaves), is_leaf=_is_spec)


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def attention(q, k, v):
  """Causal multi-head attention: compiled for an NVIDIA GPU the Pallas Triton flash-attention
  kernel (the (seq, seq) scores never leave the chip, as in docs/speed.md's programs), elsewhere
  XLA's einsums."""
  return lax.platform_dependent(q, k, v, cuda=_flash_attention, default=_xla_attention)


def _flash_attention(q, k, v):
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention

  return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True)


def _xla_attention(q, k, v):
  s, hd = q.shape[1], q.shape[-1]
  scores = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
  mask = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhe->bqhe", probs, v)


def layer(cfg: Config, x, p):
  """One decoder layer (`benchmarks/llama.py`'s)."""
  b, s, d = x.shape
  hd = d // cfg.heads
  h = rms_norm(x, p["attn_norm"])
  q, k, v = (jnp.einsum("bsd,de->bse", h, p["w" + n]).reshape(b, s, cfg.heads, hd) for n in "qkv")
  attn = attention(q, k, v).reshape(b, s, d)
  x = x + jnp.einsum("bsd,de->bse", attn, p["wo"])
  h = rms_norm(x, p["mlp_norm"])
  gate = jnp.einsum("bsd,df->bsf", h, p["w_gate"])
  up = jnp.einsum("bsd,df->bsf", h, p["w_up"])
  return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, p["w_down"])


def loss_fn(cfg: Config, params: dict, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross entropy; the stack streamed from host memory layer by layer."""
  x = params["embed"][tokens[:, :-1]]
  x, _ = oo.offloaded_scan(lambda x, w: (layer(cfg, x, w), None), x, params["layers"])
  x = rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,dv->bsv", x, params["head"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def batch_shape(cfg: Config) -> tuple[int, ...]:
  """A step's tokens: (batch, seq + 1), or (accumulate, batch, seq + 1) with micro-batches."""
  one = (cfg.batch, cfg.seq + 1)
  return one if cfg.accumulate == 1 else (cfg.accumulate, *one)


def batches(cfg: Config):
  """(batch, seq + 1) int32 windows of the standard library's bytes, in order; with `accumulate`
  k > 1, (k, batch, seq + 1): k micro-batches a step."""
  files = sorted(pathlib.Path(os.path.dirname(os.__file__)).glob("*.py"))
  text = np.frombuffer(b"".join(f.read_bytes() for f in files[:50]), np.uint8).astype(np.int32)
  shape = batch_shape(cfg)
  n = int(np.prod(shape))
  for start in range(0, len(text) - n, n):
    yield jnp.asarray(text[start : start + n].reshape(shape))


def abstract_params(cfg: Config, device_leaves=()) -> dict:
  """The params' shapes, dtypes and memory kinds, with no memory behind them."""
  host = jax.sharding.NamedSharding(
    jax.sharding.Mesh(jax.devices()[:1], ("d",)),
    jax.sharding.PartitionSpec(),
    memory_kind="pinned_host",
  )
  device = host.with_memory_kind("device")
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s[0], jnp.bfloat16, sharding=host if s[1] else device),
    shapes(cfg, device_leaves),
    is_leaf=_is_spec,
  )


def optimizer(args) -> tuple[optax.GradientTransformation, str | None]:
  """AdamW, and the moment dtype for `offload`; with --head-moment-dtype, the head's moments in
  their own dtype through `optax.multi_transform` (docs/tiers.md, "Choosing per leaf")."""
  if args.head_moment_dtype is None:
    return optax.adamw(args.lr), args.moment_dtype

  def kept_in(dtype):
    adamw = optax.adamw(args.lr)
    return adamw if dtype in (None, "fp32") else oo.with_moment_dtype(adamw, dtype)

  def labels(params):  # (value_and_update passes a layer stack's leaves as a tuple: no keys)
    def label(path, _):
      return "head" if any(getattr(k, "key", None) == "head" for k in path) else "rest"

    return jax.tree_util.tree_map_with_path(label, params)

  transforms = {"rest": kept_in(args.moment_dtype), "head": kept_in(args.head_moment_dtype)}
  return optax.multi_transform(transforms, labels), None


def plan(cfg: Config, args) -> oo.Estimate:
  """`oo.estimate` of this model and machine: the same plan as ``python -m optax_offload plan``."""
  inner, moment_dtype = optimizer(args)
  return oo.estimate(
    abstract_params(cfg, args.device_leaves),
    optimizer=inner,
    master_dtype="fp32",
    moment_dtype=moment_dtype,
    accumulate=cfg.accumulate,
    accumulator_dtype=args.accumulator_dtype,
    device_memory=args.device_memory,
    memory_fraction=float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)),
    window_bytes=cfg.window,
    host_memory=args.host_memory,
    host_limit=None if args.no_nvme else args.host_limit,
    nvme_dir=None if args.no_nvme else args.nvme_dir,
    update_in_backward=True,
  )


def resume(checkpoints, params, state) -> tuple[dict, oo.OffloadState, int]:
  """The params and optimizer state of the latest checkpoint, restored into `params`' placement
  and into `state` (its NVMe data written into this run's store), and the steps it had done."""
  done = checkpoints.latest_step()
  restored = checkpoints.restore(
    done,
    args=ocp.args.Composite(
      params=ocp.args.StandardRestore(params), opt_state=oo.OffloadRestore(state)
    ),
  )
  params = restored["params"]
  print(f"resumed from {checkpoints.directory} after step {done}", flush=True)
  return params, restored["opt_state"], done


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
  """The command line, checked: (args, the size's `Config` with its batch, accumulation, window)."""
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    allow_abbrev=False,
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  p.add_argument("--size", choices=sorted(SIZES), default="13B", help="the model")
  p.add_argument("--steps", type=int, default=10, help="optimizer steps")
  p.add_argument("--batch", type=int, help="sequences per step (13B: 1; 4 needs more of the card)")
  p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate")
  p.add_argument("--device-memory", default="24GiB", help="the card's memory")
  p.add_argument("--host-memory", default="48GiB", help="host RAM for the run in all")
  p.add_argument("--host-limit", help="the state's host budget; default: what the plan leaves")
  p.add_argument("--nvme-dir", help="directory on the NVMe drive for the optimizer state")
  p.add_argument("--no-nvme", action="store_true", help="keep the state in host memory only")
  p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
  p.add_argument(
    "--accumulator-dtype", default="fp32", choices=("fp32", "bf16"), help="with --accumulate"
  )
  p.add_argument(
    "--moment-dtype", default=None, choices=("bf16", "int8"), help="AdamW's moments (fp32)"
  )
  p.add_argument(
    "--head-moment-dtype",
    default=None,
    choices=("fp32", "bf16"),
    help="the output kernel's moments (default: --moment-dtype's); with int8, fp32 is safer: "
    "its 8-bit blocks run along the vocabulary, mixing rare and frequent tokens (docs/tiers.md)",
  )
  p.add_argument(
    "--device-leaves", default="", help="stack leaves kept on the card, e.g. wq,wo (none)"
  )
  p.add_argument("--window-bytes", help="offload's window (default: the size's)")
  p.add_argument(
    "--force", action="store_true", help="train even where the plan says it does not fit"
  )
  p.add_argument(
    "--xla-slop-factor",
    type=int,
    help="on a GPU: XLA's xla_gpu_memory_limit_slop_factor (its scheduler plans for 80%% of the "
    "card less the device inputs, times this %%; raise it with --device-leaves, e.g. 115)",
  )
  p.add_argument(
    "--compile-for",
    metavar="TARGET",
    help="compile the step for a GPU target without a GPU (rtx4090_24gb, h100_24gb, h100_80gb; "
    "needs the CUDA plugin), print its device bytes and exit: nothing is allocated or trained",
  )
  p.add_argument(
    "--ckpt-dir",
    help="Orbax checkpoints of the params and optimizer state here (NVMe data hard-linked); a "
    "run finds the latest one and resumes from it",
  )
  p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
  p.add_argument("--json", help="write the losses and bytes per tier here")
  args = p.parse_args(argv)
  if not args.no_nvme and not args.nvme_dir:
    p.error("give --nvme-dir (a directory on the NVMe drive), or --no-nvme")
  cfg = SIZES[args.size]
  args.device_leaves = tuple(x for x in args.device_leaves.split(",") if x)
  unknown = set(args.device_leaves) - set(shapes(cfg)["layers"])
  if unknown:
    p.error(f"--device-leaves: {', '.join(sorted(unknown))} not a leaf of the layer stack")
  if args.accumulate < 1:
    p.error("--accumulate must be at least 1")
  if args.batch is not None:
    cfg = dataclasses.replace(cfg, batch=args.batch)
  cfg = dataclasses.replace(cfg, accumulate=args.accumulate, window=args.window_bytes or cfg.window)
  return args, cfg


def main(argv=None) -> dict:
  args, cfg = parse_args(argv)
  e = plan(cfg, args)
  print(
    f"{cfg.params:,} params; plan (bytes per tier, the stack's weights and the NVMe buffers "
    f"included): {e.bytes_per_tier}, fits: {e.fits}",
    flush=True,
  )
  if not e.fits:
    print("\n".join(f"  {s.tier}: {s.advice}" for s in e.shortfalls), flush=True)
    if not args.force:  # (it would fail later, or swap; --force tries anyway)
      print(
        "The plan does not fit: change the options as said above (or pass --force).",
        file=sys.stderr,
      )
      raise SystemExit(1)
  host_limit = args.host_limit if args.host_limit is not None else e.host_bytes
  inner, moment_dtype = optimizer(args)
  moments = {} if moment_dtype is None else {"moment_dtype": moment_dtype}
  tx = oo.offload(
    inner,
    master_dtype=jnp.float32,
    window_bytes=cfg.window,
    host_limit=None if args.no_nvme else host_limit,
    nvme_dir=None if args.no_nvme else args.nvme_dir,
    **moments,
  )
  fused = oo.value_and_update(
    lambda p, t: loss_fn(cfg, p, t),
    tx,
    accumulate=cfg.accumulate,
    accumulator_dtype=args.accumulator_dtype,
  )
  step = jax.jit(fused, donate_argnums=(0, 1))
  options = dict(oo.STREAM_XLA_OPTIONS)  # on a GPU, the options under which copies overlap compute
  if args.xla_slop_factor is not None:
    options["xla_gpu_memory_limit_slop_factor"] = args.xla_slop_factor
  if args.compile_for:
    params = abstract_params(cfg, args.device_leaves)
    sharding = params["embed"].sharding
    tokens = jax.ShapeDtypeStruct(batch_shape(cfg), jnp.int32, sharding=sharding)
    t0 = time.perf_counter()
    state = oo.abstract_state(tx, params)
    target = args.compile_for
    program = oo.compile_for_gpu(step, params, state, tokens, target=target, xla_flags=options)
    out = {
      "device_bytes": program.memory.device,
      "callbacks": len(program.schedule.callbacks),  # the NVMe tier's, in the program
      "compile_s": time.perf_counter() - t0,
    }
    print(
      f"compiled for {args.compile_for} in {out['compile_s']:.0f} s: "
      f"{oo.format_bytes(out['device_bytes'])} of the card, {out['callbacks']} callback instructions"
    )
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(out))
    return out
  params = init_params(cfg, device_leaves=args.device_leaves)
  state = tx.init(params)
  checkpoints, start = None, 0
  if args.ckpt_dir:
    checkpoints = ocp.CheckpointManager(
      os.path.abspath(args.ckpt_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    if checkpoints.latest_step() is not None:
      params, state, start = resume(checkpoints, params, state)
  losses = []
  data = batches(cfg)
  for _ in range(start):  # the batches the checkpointed steps took
    next(data)
  first = next(data)
  if jax.default_backend() == "gpu":
    step = step.lower(params, state, first).compile(compiler_options=options)
  for i in range(start, args.steps):
    t0 = time.perf_counter()
    tokens = first if i == start else next(data)
    loss, params, state = step(params, state, tokens)
    losses.append(float(loss))
    print(f"step {i}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if checkpoints is not None and ((i + 1) % args.ckpt_every == 0 or i + 1 == args.steps):
      checkpoints.save(
        i + 1,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=oo.OffloadSave(state)
        ),
      )
  if checkpoints is not None:
    checkpoints.wait_until_finished()
    checkpoints.close()
  oo.sync_nvme(state)
  out = {"losses": losses, "footprint": oo.footprint(state), "plan": e.bytes_per_tier}
  print("optimizer state's bytes per tier (oo.footprint):", out["footprint"])
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out))
  out["params"], out["state"] = params, state
  return out


if __name__ == "__main__":
  result = main()
  if "state" in result:
    oo.close_nvme(result["state"])
  sys.exit(0)
