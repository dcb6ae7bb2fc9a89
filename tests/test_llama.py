"""The Llama-style decoder the GPU benchmarks compile (`benchmarks.llama`): the default path keeps
its numbers, the options (flash attention, remat policies, gradient accumulation) compute what
they say, and the compiled program no longer carries an attention mask across the layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpu_compile_or_skip
from jax import lax

from benchmarks import llama


def tiny(**options) -> llama.Config:
  return llama.Config(d=64, layers=3, ffn=128, heads=4, vocab=256, **options)


def inputs(cfg, dtype, batch=2, seq=32):
  params = llama.init_params(cfg, jax.random.key(0), dtype)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab)
  return params, tokens


def reference_loss(cfg, params, tokens):
  """`llama.loss_fn` as it was before the fused mask: ``jnp.tril`` of ones and -1e30."""

  def layer(x, p):
    b, s, d = x.shape
    hd = d // cfg.heads
    h = llama._rms_norm(x, p["attn_norm"])
    q, k, v = (jnp.einsum("bsd,de->bse", h, p["w" + n]).reshape(b, s, cfg.heads, hd) for n in "qkv")
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhqk,bkhe->bqhe", probs, v).reshape(b, s, d)
    x = x + jnp.einsum("bsd,de->bse", attn, p["wo"])
    h = llama._rms_norm(x, p["mlp_norm"])
    gate = jnp.einsum("bsd,df->bsf", h, p["w_gate"])
    up = jnp.einsum("bsd,df->bsf", h, p["w_up"])
    return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, p["w_down"]), None

  x = params["embed"][tokens[:, :-1]]
  x, _ = lax.scan(jax.checkpoint(layer), x, params["layers"])
  x = llama._rms_norm(x, params["final_norm"])
  logits = jnp.einsum("bsd,dv->bsv", x, params["head"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def assert_trees_equal(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [True, False])
def test_the_default_path_keeps_its_numbers_bit_for_bit(dtype, jit):
  cfg = tiny()
  params, tokens = inputs(cfg, dtype)
  new = jax.value_and_grad(lambda p, t: llama.loss_fn(cfg, p, t))
  old = jax.value_and_grad(lambda p, t: reference_loss(cfg, p, t))
  if jit:
    new, old = jax.jit(new), jax.jit(old)
  assert_trees_equal(new(params, tokens), old(params, tokens))


@pytest.mark.parametrize("remat", ["dots", "none"])
def test_a_remat_policy_changes_what_is_recomputed_not_the_result(remat):
  params, tokens = inputs(tiny(), jnp.float32)
  want = jax.jit(jax.value_and_grad(lambda p, t: llama.loss_fn(tiny(), p, t)))(params, tokens)
  got = jax.jit(jax.value_and_grad(lambda p, t: llama.loss_fn(tiny(remat=remat), p, t)))(
    params, tokens
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_unknown_options_are_refused():
  with pytest.raises(ValueError, match="flash"):
    tiny(attention="cudnn")
  with pytest.raises(ValueError, match="dots"):
    tiny(remat="some")


def test_a_step_over_micro_batches_applies_their_mean_gradient_once():
  cfg = tiny()
  params, _ = inputs(cfg, jnp.float32)
  tokens = jax.random.randint(jax.random.key(2), (3, 2, 17), 0, cfg.vocab)
  tx = llama.optimizer()
  state = tx.init(params)
  new_params, new_state, loss = jax.jit(llama.train_step(cfg, tx))(params, state, tokens)

  per_batch = jax.jit(jax.value_and_grad(lambda p, t: llama.loss_fn(cfg, p, t)))
  losses, grads = zip(*(per_batch(params, t) for t in tokens))
  mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
  updates, want_state = tx.update(mean, state, params)
  np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves(new_params), jax.tree.leaves(optax.apply_updates(params, updates))
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert int(new_state[0].count) == int(want_state[0].count) == 1


# ----------------------------------------------------------------------------------------------
# Compiled for a GPU (no GPU needed).


def _while_shapes(hlo: str) -> str:
  return "\n".join(line.split(" while(")[0] for line in hlo.splitlines() if " while(" in line)


def test_the_causal_mask_is_not_carried_across_the_layers():
  gpu_compile_or_skip()
  from optax_offload._src import gpu_program

  cfg = llama.Config(d=256, layers=3, ffn=512, heads=4, vocab=1024)
  seq = 1024
  params = llama.abstract_params(cfg, jnp.bfloat16)
  tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)

  def grads(loss):
    return lambda p, t: jax.grad(lambda p: loss(cfg, p, t))(p)

  new = gpu_program.compile_for_gpu(grads(llama.loss_fn), params, tokens)
  old = gpu_program.compile_for_gpu(grads(reference_loss), params, tokens)
  per_layer_mask = f"[1,{cfg.heads},{seq},{seq}]"
  assert per_layer_mask in _while_shapes(old.hlo)  # what the jnp.tril formulation compiled to
  assert per_layer_mask not in _while_shapes(new.hlo)


def test_flash_attention_and_saved_projections_compile_for_the_gpu():
  gpu_compile_or_skip()
  from optax_offload._src import hlo_cost

  base = llama.Config(d=256, layers=2, ffn=512, heads=2, vocab=1024)
  seq = 512
  flops = {}
  for attention in llama.ATTENTION:
    for remat in ("full", "dots"):
      cfg = dataclasses.replace(base, attention=attention, remat=remat)
      program = llama.compile_train_step(cfg, seq=seq)
      assert (hlo_cost.TRITON_TARGET in program.hlo) == (attention == "flash")
      flops[attention, remat] = program.timeline().gemm_flops
  # Full remat runs the forward projections again (q, k, v, o, gate and up: w_down's output only
  # feeds a residual add, whose backward pass does not need it), 2 FLOPs per weight and token;
  # with the projections' outputs saved, none of them runs twice.
  recomputed = base.layers * (4 * base.d * base.d + 2 * base.d * base.ffn)
  for attention in llama.ATTENTION:
    saved = flops[attention, "full"] - flops[attention, "dots"]
    assert saved == 2 * recomputed * seq
