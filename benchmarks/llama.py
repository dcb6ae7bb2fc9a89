"""A Llama-style decoder for the GPU benchmarks: layers stacked under `lax.scan`, with remat.

The stacked layout is the JAX way (MaxText, scanned Flax NNX layers): every layer's weights of one
kind live in one leaf with a leading layer axis, e.g. ``layers/w_up`` of shape (layers, d, ffn).
A `Config` also says how the step computes: attention by XLA (``"xla"``, the default, the only one
that runs on the CPU) or by the Pallas Triton flash-attention kernel (``"flash"``, for programs
compiled for a GPU), and what `jax.checkpoint` keeps (``remat``: ``"full"`` recomputes each layer,
``"dots"`` saves the projections' outputs, ``"none"`` saves everything). `train_step` is a whole
optimizer step with gradient accumulation over micro-batches; `compile_train_step` compiles it for
a GPU target.

    >>> cfg = CONFIGS["7B"]
    >>> round(cfg.params / 1e9, 2)
    6.74
    >>> dataclasses.replace(cfg, attention="flash", remat="dots").remat
    'dots'
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax
from jax import lax

_MESH = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
DEVICE = jax.sharding.NamedSharding(_MESH, jax.sharding.PartitionSpec())
"""One device's memory, as a NamedSharding (what abstract inputs need to keep a memory kind)."""
HOST = DEVICE.with_memory_kind("pinned_host")
"""The same device's pinned host memory."""

ATTENTION = ("xla", "flash")
"""``"xla"``: einsums and a softmax under a causal mask that XLA fuses; ``"flash"``: the Pallas
Triton kernel `jax.experimental.pallas.ops.gpu.attention.mha` (compiles for an NVIDIA target; the
CPU cannot run it)."""
REMAT = ("full", "dots", "none")
"""What `jax.checkpoint` keeps of each layer for the backward pass: nothing (the layer's forward
runs again), the outputs of the matmuls without batch dimensions (the projections; MaxText's
``minimal`` policy), or everything (no `jax.checkpoint`)."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Shape of a Llama-style decoder (multi-head attention, SwiGLU MLP, RMSNorm, untied head), and
  how its step computes attention (`ATTENTION`) and what remat keeps (`REMAT`)."""

  d: int
  layers: int
  ffn: int
  heads: int
  vocab: int = 32000
  attention: str = "xla"
  remat: str = "full"

  def __post_init__(self):
    if self.attention not in ATTENTION:
      raise ValueError(f"attention={self.attention!r}: one of {ATTENTION}")
    if self.remat not in REMAT:
      raise ValueError(f"remat={self.remat!r}: one of {REMAT}")

  @property
  def params(self) -> int:
    d, f, v = self.d, self.ffn, self.vocab
    return 2 * v * d + d + self.layers * (4 * d * d + 3 * d * f + 2 * d)

  def with_layers(self, layers: int) -> Config:
    return dataclasses.replace(self, layers=layers)


CONFIGS = {
  "1B": Config(d=2048, layers=22, ffn=5632, heads=32),  # TinyLlama-1.1B
  "3B": Config(d=3200, layers=26, ffn=8640, heads=32),  # OpenLLaMA-3B
  "7B": Config(d=4096, layers=32, ffn=11008, heads=32),  # Llama-2-7B
  "13B": Config(d=5120, layers=40, ffn=13824, heads=40),  # Llama-2-13B
  "30B": Config(d=6656, layers=60, ffn=17920, heads=52),  # LLaMA-33B
  "70B": Config(d=8192, layers=80, ffn=22016, heads=64),  # Llama-2-70B shapes, multi-head
}


def abstract_params(cfg: Config, dtype=jnp.bfloat16, sharding=None, stack_sharding=None) -> dict:
  """The params as `jax.ShapeDtypeStruct`s (nothing allocated); the layer stack's leaves take
  `stack_sharding` when given (e.g. one in pinned host memory), the others `sharding`."""
  L, d, f, v = cfg.layers, cfg.d, cfg.ffn, cfg.vocab

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def layer(*shape):
    placed = sharding if stack_sharding is None else stack_sharding
    return jax.ShapeDtypeStruct((L, *shape), dtype, sharding=placed)

  return {
    "embed": s(v, d),
    "layers": {
      "attn_norm": layer(d),
      "wq": layer(d, d),
      "wk": layer(d, d),
      "wv": layer(d, d),
      "wo": layer(d, d),
      "mlp_norm": layer(d),
      "w_gate": layer(d, f),
      "w_up": layer(d, f),
      "w_down": layer(f, d),
    },
    "final_norm": s(d),
    "head": s(d, v),
  }


def init_params(cfg: Config, key: jax.Array, dtype=jnp.float32) -> dict:
  """Random params of the same tree (for small configs that run on the CPU)."""
  shapes = abstract_params(cfg, dtype)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten(
    [
      jnp.ones(x.shape, dtype)
      if x.ndim <= 2 and x.shape[-1] == cfg.d and "norm" in str(i)
      else (jax.random.normal(k, x.shape, jnp.float32) * 0.02).astype(dtype)
      for i, (k, x) in enumerate(zip(keys, leaves))
    ]
  )


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _causal_mask(s: int, anchor: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The (s, s) causal mask and the fill value of masked scores, tied to `anchor`.

  Built from iotas alone, the mask depends on nothing the layer computes: under `jax.grad` the
  scan's partial evaluation hoists it out of the loop, broadcast over the heads together with the
  fill, and XLA keeps that (batch, heads, s, s) bool and float32 pair alive across the layers and
  reads it in every layer (640 MiB at 32 heads x 2,048 in the compiled 7B step). An optimization
  barrier with a value of the layer (`anchor`) keeps both inside the loop, where XLA fuses the iota
  comparison and the broadcast into the softmax. The barrier is an identity: the numbers are those
  of ``jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)``, bit for bit.
  """
  mask = lax.broadcasted_iota(jnp.int32, (s, s), 0) >= lax.broadcasted_iota(jnp.int32, (s, s), 1)
  (mask, fill), _ = lax.optimization_barrier(((mask, jnp.float32(-1e30)), anchor))
  return mask, fill


def _attention(q, k, v):
  """Causal multi-head attention by XLA: (batch, seq, heads, head_dim) in and out."""
  s, hd = q.shape[1], q.shape[-1]
  scores = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
  mask, fill = _causal_mask(s, q)
  probs = jax.nn.softmax(jnp.where(mask, scores, fill), axis=-1).astype(q.dtype)
  return jnp.einsum("bhqk,bkhe->bqhe", probs, v)


def _flash_attention(q, k, v):
  """Causal multi-head attention by the Pallas Triton flash-attention kernel (forward and
  backward): the (seq, seq) scores never leave the GPU's on-chip memory. For GPU programs only."""
  from jax.experimental.pallas.ops.gpu import attention

  return attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True)


def _layer(cfg: Config, x, p):
  b, s, d = x.shape
  hd = d // cfg.heads
  h = _rms_norm(x, p["attn_norm"])
  q, k, v = (jnp.einsum("bsd,de->bse", h, p["w" + n]).reshape(b, s, cfg.heads, hd) for n in "qkv")
  attend = _flash_attention if cfg.attention == "flash" else _attention
  attn = attend(q, k, v).reshape(b, s, d)
  x = x + jnp.einsum("bsd,de->bse", attn, p["wo"])
  h = _rms_norm(x, p["mlp_norm"])
  gate = jnp.einsum("bsd,df->bsf", h, p["w_gate"])
  up = jnp.einsum("bsd,df->bsf", h, p["w_up"])
  return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, p["w_down"])


def loss_fn(cfg: Config, params: dict, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross entropy; `tokens` is (batch, seq + 1) int32."""
  x = params["embed"][tokens[:, :-1]]

  def body(x, p):
    return _layer(cfg, x, p), None

  if cfg.remat == "full":
    body = jax.checkpoint(body)
  elif cfg.remat == "dots":
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  x, _ = lax.scan(body, x, params["layers"])
  x = _rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,dv->bsv", x, params["head"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def optimizer() -> optax.GradientTransformation:
  """AdamW with fp32 first moments, the plain optimizer of the bf16 benchmarks."""
  return optax.adamw(1e-4, mu_dtype=jnp.float32)


def train_step(cfg: Config, tx: optax.GradientTransformation):
  """One optimizer step over micro-batches: ``step(params, opt_state, tokens) -> (params,
  opt_state, loss)`` with `tokens` of shape (micro_batches, batch, seq + 1).

  The gradients of the micro-batches are summed in float32 under `lax.scan` (one compiled loop
  body, whatever their number), averaged, cast to the params' dtype and applied once: the update
  is amortised over ``micro_batches x batch x seq`` tokens, as in gradient accumulation.
  """

  def step(params, opt_state, tokens):
    def micro(carry, batch):
      acc, total = carry
      loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, batch))(params)
      acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
      return (acc, total + loss), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (acc, total), _ = lax.scan(micro, (zeros, jnp.float32(0)), tokens)
    n = tokens.shape[0]
    grads = jax.tree.map(lambda a, p: (a / n).astype(p.dtype), acc, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total / n

  return step


def compile_train_step(
  cfg: Config,
  target: str = "h100_80gb",
  *,
  batch: int = 1,
  seq: int = 2048,
  micro_batches: int = 1,
  xla_flags: dict | None = None,
):
  """`train_step` of `cfg` (bf16 params, `optimizer`) compiled for a GPU target, params and state
  donated: an `optax_offload.GpuProgram`."""
  from optax_offload._src import gpu_program

  tx = optimizer()
  params = abstract_params(cfg, jnp.bfloat16, sharding=DEVICE)
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=DEVICE), state)
  tokens = jax.ShapeDtypeStruct((micro_batches, batch, seq + 1), jnp.int32, sharding=DEVICE)
  return gpu_program.compile_for_gpu(
    train_step(cfg, tx),
    params,
    state,
    tokens,
    target=target,
    donate_argnums=(0, 1),
    xla_flags=xla_flags,
  )


def extrapolated_step(
  cfg: Config,
  target: str = "h100_80gb",
  *,
  batch: int = 1,
  seq: int = 2048,
  micro_batches: int = 1,
  depths: tuple[int, int] = (2, 4),
  host: str = "desktop",
) -> dict:
  """Modelled figures of `cfg`'s `train_step` on `target`, from two shallow compiles.

  The layers are one `lax.scan` body and their weights, gradients and optimizer state stacked
  leaves, so the compiled program of ``L`` layers is the program of ``depths[0]`` layers with
  ``L - depths[0]`` more iterations of the same loop bodies and larger update kernels: the
  modelled step time and the device bytes are linear in ``L``. Two depths give the slope and the
  rest (embedding, head, loss), extrapolated to ``cfg.layers``. XLA compiles the shallow programs
  without memory pressure, as it would compile each GPU's share of a sharded run; at full depth
  on one GPU its rematerialisation pass might recompute more to fit. A model of the compiled
  program (`optax_offload.timeline`), not a measurement.

  Returns:
    A dict: ``step_s``, ``tokens_per_s``, ``mfu`` (6 x params x tokens per step over the peak
    tensor rate), ``device_bytes``, ``fits`` (device bytes within the target's memory),
    ``layer_s`` (seconds per layer per step) and the per-depth figures.
  """
  from optax_offload._src import gpu_program
  from optax_offload._src import step_time

  hw = step_time.hardware(target, host)
  rows = []
  for layers in depths:
    program = compile_train_step(
      cfg.with_layers(layers), target, batch=batch, seq=seq, micro_batches=micro_batches
    )
    rows.append((layers, step_time.timeline(program, hw), program.memory.device))
  (l0, t0, m0), (l1, t1, m1) = rows
  layer_s = (t1.step_s - t0.step_s) / (l1 - l0)
  step_s = t0.step_s + (cfg.layers - l0) * layer_s
  device = m0 + (cfg.layers - l0) * (m1 - m0) / (l1 - l0)
  memory = int(re.search(r"device_memory_size:\s*(\d+)", gpu_program.target_config(target))[1])
  tokens = micro_batches * batch * seq
  return {
    "target": target,
    "layers": cfg.layers,
    "tokens_per_step": tokens,
    "step_s": step_s,
    "tokens_per_s": tokens / step_s,
    "mfu": 6 * cfg.params * tokens / step_s / hw.tensor_flops,
    "device_bytes": device,
    "fits": device <= memory,
    "layer_s": layer_s,
    "depths": {n: {"step_s": t.step_s, "device_bytes": m} for n, t, m in rows},
  }


def main(argv=None) -> dict:
  """Prints `extrapolated_step`'s figures for a config and a micro-batch layout (the defaults:
  the MaxText Llama-2-7B run of docs/speed.md)."""
  import argparse
  import json

  parser = argparse.ArgumentParser(description="Modelled step of the Llama-style decoder.")
  parser.add_argument("--config", default="7B", choices=sorted(CONFIGS))
  parser.add_argument("--target", default="h100_80gb")
  parser.add_argument("--attention", default="flash", choices=ATTENTION)
  parser.add_argument("--remat", default="dots", choices=REMAT)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--micro-batches", type=int, default=8)
  args = parser.parse_args(argv)
  cfg = dataclasses.replace(CONFIGS[args.config], attention=args.attention, remat=args.remat)
  out = extrapolated_step(
    cfg, args.target, batch=args.batch, seq=args.seq, micro_batches=args.micro_batches
  )
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":  # JAX_PLATFORMS=cpu python -m benchmarks.llama --help
  main()
