"""Tests of `stream`: equal row slices of a leaf updated in a loop, with the unrolled form's bits,
and a program whose size does not grow with their number."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import bits_equal
from conftest import make_grads
from conftest import update_step
from helpers import gpu_compile_or_skip

import optax_offload as oo
from optax_offload._src import stream_spec

LAYERS = 13  # slices of one or two layers after "head"'s group, an odd remainder for sgd
ADAM_LAYERS = 7
"""Layers of the adamw cases: their slices are of one layer, so 7 give a loop of the same shape as
13 (the groups before it, its stages, the groups unrolled after it; 2 trips instead of 5 for one
stack, 6 instead of 12 for two, 3 instead of 6 for three: measured with `stream_spec.loop_plan`)
with fewer unrolled groups to compile. sgd's slices are of two layers: 13 for a loop of at least
`LOOP_MIN_GROUPS` slices and an odd layer left over."""


def _train(
  make,
  *,
  loop: bool,
  apply: bool,
  host_params: bool,
  monkeypatch,
  dtype=jnp.float32,
  stacks=1,
  layers=LAYERS,
):
  """Three jitted steps on `stacks` alike stacked leaves in one-layer row slices (and a small
  leaf), with the loop (or, `loop` False, every group unrolled): one loop for all the stacks."""
  monkeypatch.setattr(stream_spec, "LOOP_MIN_GROUPS", 6 if loop else 10**9)
  rng = np.random.default_rng(0)
  params = {
    "head": jnp.asarray(rng.normal(size=(64, 32)) * 0.1, dtype),
    **{
      f"layers{n or ''}": jnp.asarray(rng.normal(size=(layers, 64, 128)) * 0.1, dtype)
      for n in range(stacks)
    },
  }
  master = jnp.float32 if dtype == jnp.bfloat16 else None
  row = 64 * 128 * (16 if host_params else 8)  # one layer's state (and weight and gradient)
  tx = oo.offload(make(), window_bytes=int(2.25 * row) + 256, min_size=256, master_dtype=master)
  place = oo.to_pinned_host if host_params else (lambda x: x)
  p = {k: v if k == "head" else place(v) for k, v in params.items()}
  state = tx.init(p)
  runs = []
  loop_plan = stream_spec.loop_plan

  def recorded(*args):
    order, loops = loop_plan(*args)
    runs.append(loops)
    return order, loops

  monkeypatch.setattr(stream_spec, "loop_plan", recorded)

  step = jax.jit(update_step(tx, apply), donate_argnums=(0, 1))
  for t in range(3):
    g = make_grads(params, t)
    p, state = step(p, state, {k: v if k == "head" else place(v) for k, v in g.items()})
  assert len(runs) == 1 and len(runs[0]) == (1 if loop else 0), runs  # one loop, traced once
  assert all(len(r.leaves) == stacks for r in runs[0].values()), runs
  return jax.device_get(p), oo.to_inner(state, memory_kind="device")


@pytest.mark.parametrize(
  "name,make,apply,host_params,dtype",
  [
    ("sgd_momentum", lambda: optax.sgd(1e-2, momentum=0.9), True, False, jnp.float32),
    ("adamw", lambda: optax.adamw(1e-2), True, False, jnp.float32),
    ("adamw_tx_update", lambda: optax.adamw(1e-2), False, False, jnp.float32),
    ("adamw_weights_on_host", lambda: optax.adamw(1e-2), True, True, jnp.float32),
    ("adamw_bf16_master", lambda: optax.adamw(1e-2), True, False, jnp.bfloat16),
  ],
  ids=lambda x: x if isinstance(x, str) else "",
)
def test_the_loop_gives_the_unrolled_bits(name, make, apply, host_params, dtype, monkeypatch):
  kwargs = dict(apply=apply, host_params=host_params, monkeypatch=monkeypatch, dtype=dtype)
  kwargs["layers"] = LAYERS if name == "sgd_momentum" else ADAM_LAYERS
  ref_params, ref_state = _train(make, loop=False, **kwargs)
  got_params, got_state = _train(make, loop=True, **kwargs)
  assert bits_equal(ref_params, got_params), name
  assert bits_equal(ref_state, got_state), name


@pytest.mark.parametrize(
  "stacks,host_params,dtype",
  [
    (2, False, jnp.float32),
    (3, False, jnp.float32),
    (2, True, jnp.float32),
    (3, False, jnp.bfloat16),
  ],
  ids=["2", "3", "2-weights_on_host", "3-bf16_master"],
)
def test_alike_leaves_share_one_loop_with_the_unrolled_bits(
  stacks, host_params, dtype, monkeypatch
):
  # Their slices run in turn in one loop (three leaves: six groups an iteration, so that the
  # buffers alternate in the carry); the order of the groups changes nothing in the results,
  # with the weights streamed through the loop too (each leaf's host params in the carry) and
  # with bf16 params and an fp32 master copy.
  kwargs = dict(apply=True, host_params=host_params, monkeypatch=monkeypatch, stacks=stacks)
  kwargs["dtype"], kwargs["layers"] = dtype, ADAM_LAYERS
  make = lambda: optax.adamw(1e-2)  # noqa: E731
  ref_params, ref_state = _train(make, loop=False, **kwargs)
  got_params, got_state = _train(make, loop=True, **kwargs)
  assert bits_equal(ref_params, got_params)
  assert bits_equal(ref_state, got_state)


def test_program_size_does_not_grow_with_the_row_slices():
  # The case: one stacked leaf in 16 or 128 one-layer row slices, compiled for an H100.
  # Unrolled, the program grew with the slices (5,460 and 43,761 instructions; 8 and 338 s to
  # compile here); in a loop it is the same program with another trip count.
  gpu_compile_or_skip()
  from benchmarks import gpu_groups

  small, window = gpu_groups.compile_slices(16)
  large, _ = gpu_groups.compile_slices(128)
  assert large.instruction_count <= 1.3 * small.instruction_count, (
    small.instruction_count,
    large.instruction_count,
  )
  # Still streamed: every slice's mu and nu in and out once, all but the first arrival in flight
  # during an update, the same device temporaries (this window holds 2.25 slices: the chunks'
  # results exceed it a little, as unrolled), the new state in place.
  for program, n in ((small, 16), (large, 128)):
    schedule = program.schedule
    for direction in ("to_device", "to_host"):
      hit, total = schedule.overlap(direction, per_execution=True)
      assert total == 2 * n and hit >= total - 2, (n, direction, hit, total)
    assert program.memory.host_temp == 0, program.memory
  assert large.memory.temp == small.memory.temp <= 1.2 * window, (small.memory, large.memory)
