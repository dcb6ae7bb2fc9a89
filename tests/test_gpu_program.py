"""The program XLA:GPU builds for an offloaded step, compiled for an H100 without a GPU.

On the CPU backend transfers compile to nothing; these tests read the H100 program itself: its
device and host bytes (`memory_analysis`) and its schedule (which copies are in flight while an
update computes).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_offload as oo
from optax_offload._src import gpu_program

pytest.importorskip(
  "jax_plugins.xla_cuda12", reason="needs the CUDA PJRT plugin (pip install .[test])"
)

MiB = 1 << 20


def abstract_params(leaves: int, shape: tuple[int, ...], dtype=jnp.float32) -> dict:
  return {f"layer_{i:02d}": jax.ShapeDtypeStruct(shape, dtype) for i in range(leaves)}


def compile_step(tx, params, *, apply: bool = True, target: str = "h100_80gb"):
  """One donated optimizer step (gradients as inputs), compiled for `target` from abstract inputs."""
  state = oo.abstract_state(tx, params)
  if apply:

    def step(params, state, grads):
      return oo.update_and_apply(tx, grads, state, params)
  else:

    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

  return gpu_program.compile_for_gpu(
    step, params, state, params, donate_argnums=(0, 1), target=target
  )


def test_harness_reports_device_and_host_bytes_and_copies():
  host = jax.sharding.NamedSharding(
    jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",)),
    jax.sharding.PartitionSpec(),
    memory_kind="pinned_host",
  )
  x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=host)
  program = gpu_program.compile_for_gpu(lambda x: jax.device_put(x, jax.memory.Space.Device) * 2, x)
  assert program.memory.host_argument == 1 * MiB
  assert program.memory.output == 1 * MiB
  assert program.memory.device == program.memory.output + program.memory.temp
  (copy,) = program.schedule.copies
  assert (copy.direction, copy.nbytes) == ("to_device", 1 * MiB)
  assert not copy.in_flight_during_compute  # nothing else to compute while it is in flight
  assert program.compile_seconds > 0


def test_unknown_target_is_refused():
  with pytest.raises(ValueError, match="h100_80gb"):
    gpu_program.target_config("a100")


@pytest.mark.parametrize("window_mib", [16, 32, 64])
def test_update_streams_through_the_window(window_mib):
  # The case: AdamW, 16 leaves of 1024x1024 f32 (state 128 MiB), donated step.
  params = abstract_params(16, (1024, 1024))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=window_mib * MiB)
  program = compile_step(tx, params)
  schedule = program.schedule
  assert program.memory.temp <= 1.10 * window_mib * MiB + MiB, program.memory
  assert program.memory.host_temp == 0  # row slices are written into the donated host arrays
  for direction in ("to_device", "to_host"):
    hit, total = schedule.overlap(direction)
    assert sum(c.nbytes for c in schedule.copies if c.direction == direction) == 128 * MiB
    assert hit >= 0.8 * total, (direction, hit, total)


def test_update_streams_at_a_realistic_size():
  # 16 leaves of 64 MiB (state 2 GiB), window 512 MiB.
  params = abstract_params(16, (4096, 4096))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=512 * MiB)
  program = compile_step(tx, params)
  assert program.memory.temp <= 1.10 * 512 * MiB + MiB
  for direction in ("to_device", "to_host"):
    assert program.schedule.overlap_fraction(direction) >= 0.8, direction


def test_a_stacked_leaf_streams_in_row_slices():
  # One leaf of 32 stacked layers, as lax.scan models keep them: 1 GiB of params, 2 GiB of state.
  params = {"layers": jax.ShapeDtypeStruct((32, 4096, 2048), jnp.float32)}
  tx = oo.offload(optax.adamw(1e-3), window_bytes=256 * MiB)
  program = compile_step(tx, params)
  assert program.memory.temp <= 1.10 * 256 * MiB + MiB
  assert program.memory.host_temp == 0
  moved = sum(c.nbytes for c in program.schedule.copies if c.direction == "to_device")
  assert moved == 2 * 1024 * MiB  # every row of mu and nu, once
  assert program.schedule.overlap_fraction("to_device") >= 0.8
  assert program.schedule.overlap_fraction("to_host") >= 0.8


def test_abstract_and_concrete_inputs_compile_to_the_same_copies():
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {f"w{i}": jax.device_put(jnp.ones((512, 1024)), on_mesh) for i in range(4)}
  tx = oo.offload(optax.adam(1e-3), window_bytes=4 * MiB)
  state = tx.init(params)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  def copies(program):
    return [(c.direction, c.nbytes) for c in program.schedule.copies]

  concrete = gpu_program.compile_for_gpu(step, params, state, params, donate_argnums=(0, 1))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  from_abstract = compile_step(tx, abstract)
  # The state's own shardings (NamedShardings, as its params') as abstract inputs.
  own_params, own = (
    jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    for t in (params, state)
  )
  from_own = gpu_program.compile_for_gpu(step, own_params, own, own_params, donate_argnums=(0, 1))
  assert copies(concrete) == copies(from_abstract) == copies(from_own)
  assert len(copies(concrete)) > 0
  assert concrete.memory == from_abstract.memory == from_own.memory


def test_a_state_without_placement_is_refused():
  params = {"w": jnp.ones((512, 1024))}
  tx = oo.offload(optax.adam(1e-3))
  lost = jax.eval_shape(tx.init, params)  # no memory kinds
  with pytest.raises(ValueError, match=r"\['w'\].*lost its placement.*oo.abstract_state"):
    jax.jit(tx.update).trace(params, lost, params)
  # A one-device state's own SingleDeviceShardings do not carry the memory kind into tracing in
  # jax 0.10: the same clear error, not a silent on-device update.
  state = tx.init(params)
  single = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
  )
  assert isinstance(single.inner[0].mu["w"].sharding, jax.sharding.SingleDeviceSharding)
  with pytest.raises(ValueError, match="lost its placement"):
    jax.jit(tx.update).trace(params, single, params)


def test_the_24gb_target_compiles():
  params = abstract_params(4, (1024, 1024))
  program = compile_step(
    oo.offload(optax.adamw(1e-3), window_bytes=16 * MiB), params, target="h100_24gb"
  )
  assert program.target == "h100_24gb"
  assert program.memory.temp <= 1.10 * 16 * MiB + MiB


def test_a_stacked_llama_step_keeps_the_state_off_the_device():
  # A small Llama-style decoder (layers stacked under lax.scan, remat, bf16 params), the training
  # step compiled for the 24 GiB target: with offload_state the device holds bf16 params and grads
  # (4 B/param) plus the window and activations; plain optax with fp32 moments holds 10 B/param more.
  from benchmarks import gpu_memory
  from benchmarks import llama

  cfg = llama.Config(d=512, layers=8, ffn=1536, heads=8, vocab=8192)
  window = 16 * MiB
  plain = gpu_memory.compile_step(cfg, "plain_bf16", "h100_24gb", None, seq=256).memory
  off = gpu_memory.compile_step(cfg, "offload_state", "h100_24gb", window, seq=256)
  weights_and_grads = 4 * cfg.params
  assert off.memory.host >= 0.99 * 12 * cfg.params  # fp32 master, mu, nu in pinned host memory
  assert off.memory.device <= weights_and_grads + 1.1 * window + 0.25 * weights_and_grads
  assert plain.device - off.memory.device >= 5 * cfg.params


def test_host_update_moves_only_gradients_params_and_updates():
  # update_on="host" with bf16 params (one a (d, vocab) head, which failed XLA:GPU's layout
  # assignment before) and fp32 master weights: the state never crosses the link.
  params = {
    "embed": jax.ShapeDtypeStruct((8192, 512), jnp.bfloat16),
    "head": jax.ShapeDtypeStruct((512, 8192), jnp.bfloat16),
    "w": jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),
  }
  tx = oo.offload(
    optax.adamw(1e-3), window_bytes=8 * MiB, update_on="host", master_dtype=jnp.float32
  )
  program = compile_step(tx, params, apply=False)
  n = sum(x.size for x in jax.tree.leaves(params))
  schedule = program.schedule
  assert sum(c.nbytes for c in schedule.copies if c.direction == "to_host") == 2 * 2 * n
  assert sum(c.nbytes for c in schedule.copies if c.direction == "to_device") == 4 * n
  assert schedule.host_compute
  assert program.memory.host_argument >= 12 * n * 0.99  # master, mu, nu stay in host memory


def test_params_and_grads_in_host_memory_stream_with_the_state():
  # Weights offloaded too: bf16 params and grads in pinned_host, fp32 master + AdamW state. Every
  # group's (param, grad, state) slices come in, its new params and state go back, in the window.
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
  host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
  params = {"layers": jax.ShapeDtypeStruct((16, 1024, 2048), jnp.bfloat16, sharding=host)}
  # A layer (row): 2M params x (4 B master + 8 B moments + 2 B weight + 2 B grad) = 32 MiB; a
  # group holds window / 2.25, so the window must be at least 72 MiB.
  tx = oo.offload(optax.adamw(1e-3), window_bytes=80 * MiB, master_dtype=jnp.float32)
  state = oo.abstract_state(tx, params)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  program = gpu_program.compile_for_gpu(
    step,
    params,
    state,
    params,
    donate_argnums=(0, 1),
    xla_flags=oo.STREAM_XLA_OPTIONS,
  )
  n = 16 * 1024 * 2048
  memory, schedule = program.memory, program.schedule
  assert memory.temp <= 1.10 * 80 * MiB + MiB, memory
  assert memory.host_temp == 0
  assert memory.host_alias == memory.host_output == 14 * n  # new params and state, donated
  moved = {
    d: sum(c.nbytes for c in schedule.copies if c.direction == d) for d in ("to_device", "to_host")
  }
  assert moved == {"to_device": 16 * n, "to_host": 14 * n}  # grads come in; params, state both ways
  for direction in ("to_device", "to_host"):
    assert schedule.overlap_fraction(direction) >= 0.8, (direction, schedule.overlap(direction))


def test_a_stacked_llama_step_with_the_weights_offloaded_too():
  # The same step with the layer stack's bf16 weights and gradients in pinned host memory too
  # (offloaded_scan + update_and_apply on host params): of the stack, the device holds a few layers
  # of weights and gradients (3 and 4) instead of all 24; the host holds them beside the state.
  from benchmarks import gpu_memory
  from benchmarks import llama

  cfg = llama.Config(d=256, layers=24, ffn=768, heads=4, vocab=4096)
  stack = cfg.params - 2 * cfg.vocab * cfg.d - cfg.d
  window = 32 * MiB  # about 20 groups (compile time grows fast with the group count)
  state = gpu_memory.compile_step(cfg, "offload_state", "h100_24gb", window, seq=256).memory
  both = gpu_memory.compile_step(cfg, "offload_all", "h100_24gb", window, seq=256).memory
  assert both.host >= 0.99 * (12 * cfg.params + 4 * stack)  # state, and the stack's weights + grads
  off_device = state.device - both.device
  assert off_device >= 4 * stack * (24 - 7) / 24 * 0.9, (state.device, both.device)
