"""A Llama-style decoder for the GPU-memory benchmarks: layers stacked under `lax.scan`, with remat.

The stacked layout is the JAX way (MaxText, scanned Flax NNX layers): every layer's weights of one
kind live in one leaf with a leading layer axis, e.g. ``layers/w_up`` of shape (layers, d, ffn).

    >>> cfg = CONFIGS["7B"]
    >>> round(cfg.params / 1e9, 2)
    6.74
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

_MESH = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
DEVICE = jax.sharding.NamedSharding(_MESH, jax.sharding.PartitionSpec())
"""One device's memory, as a NamedSharding (what abstract inputs need to keep a memory kind)."""
HOST = DEVICE.with_memory_kind("pinned_host")
"""The same device's pinned host memory."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Shape of a Llama-style decoder (multi-head attention, SwiGLU MLP, RMSNorm, untied head)."""

  d: int
  layers: int
  ffn: int
  heads: int
  vocab: int = 32000

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


def _layer(cfg: Config, x, p):
  b, s, d = x.shape
  hd = d // cfg.heads
  h = _rms_norm(x, p["attn_norm"])
  q, k, v = (jnp.einsum("bsd,de->bse", h, p["w" + n]).reshape(b, s, cfg.heads, hd) for n in "qkv")
  scores = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
  attn = jnp.einsum("bhqk,bkhe->bqhe", probs, v).reshape(b, s, d)
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

  x, _ = lax.scan(jax.checkpoint(body), x, params["layers"])
  x = _rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,dv->bsv", x, params["head"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
