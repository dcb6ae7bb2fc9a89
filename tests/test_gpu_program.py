"""The program XLA:GPU builds for an offloaded step, compiled for an H100 without a GPU.

On the CPU backend transfers compile to nothing; these tests read the H100 program itself: its
device and host bytes (`memory_analysis`) and its schedule (which copies are in flight while an
update computes).
"""

import dataclasses
import gzip
import json

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import gpu_compile_or_skip

import optax_offload as oo
from optax_offload._src import gpu_program

gpu_compile_or_skip(module_level=True)

MiB = 1 << 20
DIRECTIONS = ("to_device", "to_host")


def abstract_params(leaves: int, shape: tuple[int, ...], dtype=jnp.float32) -> dict:
  return {f"layer_{i:02d}": jax.ShapeDtypeStruct(shape, dtype) for i in range(leaves)}


def compile_step(
  tx, params, *, apply: bool = True, target: str = "h100_80gb", xla_flags: dict | None = None
):
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
    step, params, state, params, donate_argnums=(0, 1), target=target, xla_flags=xla_flags
  )


def copies(schedule, direction: str) -> tuple[int, int, int]:
  """(copies in flight during an update, all copies, bytes) in one direction, a copy in a loop
  body once per iteration (`Schedule.summary`, which the benchmarks print); a schedule in which
  the reader finds no copies fails here, whatever else the test checks."""
  summary = schedule.summary()
  total = summary[f"copies_{direction}"]
  assert total > 0, f"no {direction} copies found in the schedule"
  return summary[f"copies_{direction}_overlapped"], total, summary[f"bytes_{direction}"]


def assert_step_copies(schedule, counts: dict) -> None:
  """A training step's copies: as many as measured in each direction, no fewer of them in flight
  during compute, and no host compute."""
  for direction, (hit, total) in counts.items():
    got_hit, got_total, _ = copies(schedule, direction)
    assert got_total == total and got_hit >= hit, (direction, got_hit, got_total)
  assert not schedule.host_compute


def assert_streams(program, window: int, state_bytes: int, temp_ratio: float, counts: dict):
  """The update streams as docs/gpu.md's table says.

  Args:
    program: the compiled step.
    window: its window_bytes.
    state_bytes: the offloaded state, which crosses the link once each way.
    temp_ratio: device temporaries over the window, as the table gives it (two decimals).
    counts: direction -> (copies in flight during an update, all copies), as the table gives them.
  """
  memory, schedule = program.memory, program.schedule
  assert memory.temp <= window, memory  # README: the window bounds the update's temporaries
  assert round(memory.temp / window, 2) <= temp_ratio, memory.temp / window
  assert memory.host_temp == 0  # new state is written into the donated host arrays
  for direction in DIRECTIONS:
    hit, total, nbytes = copies(schedule, direction)
    want_hit, want_total = counts[direction]
    assert nbytes == state_bytes, (direction, nbytes)
    # Only the copies the docs name may miss: the first group's arrival (its mu and nu) and the
    # last group's departure; the table says which of them did.
    assert total == want_total and hit >= want_hit, (direction, hit, total)
    assert total - hit <= 2, (direction, hit, total)


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
  assert program.schedule.overlap_fraction("to_device") == 0.0
  with pytest.raises(ValueError, match="no to_host copies"):  # not a perfect 1.0
    program.schedule.overlap_fraction("to_host")
  assert program.compile_seconds > 0


def test_a_program_compiled_before_is_read_from_the_cache_dir(tmp_path, monkeypatch):
  """With JAX's compilation cache on, a second compile of the same lowered module, target and
  options is read back as compiled; anything else the compile reads compiles afresh; an entry
  that cannot be read is compiled and written again."""
  from optax_offload._src import program_cache

  monkeypatch.setattr(program_cache, "directory", lambda: str(tmp_path))
  x = jax.ShapeDtypeStruct((512, 256), jnp.float32)

  def compiled(fn=lambda x: jnp.sin(x) * 2, **kwargs):
    return gpu_program.compile_for_gpu(fn, x, **kwargs)

  first = compiled()
  (entry,) = tmp_path.glob(f"optax_offload_gpu-*{program_cache.SUFFIX}")
  again = compiled()
  assert (first.cached, again.cached) == (False, True)
  assert (again.memory, again.hlo, again.compile_seconds) == (
    first.memory,
    first.hlo,
    first.compile_seconds,
  )
  assert "cached" in repr(again) and "cached" not in repr(first)

  def deeper():  # another caller: another Python traceback, the same program
    return compiled()

  assert deeper().cached

  def scoped(x):  # the same operations, other op_names in the HLO
    with jax.named_scope("scaled"):
      return jnp.sin(x) * 2

  other_names = compiled(scoped)
  assert not other_names.cached and "scaled" in other_names.hlo and "scaled" not in first.hlo
  # Another function, target or XLA option: another program, compiled.
  assert not compiled(lambda x: jnp.cos(x) * 2).cached
  assert not compiled(target="h100_24gb").cached
  assert not compiled(xla_flags={"xla_gpu_enable_latency_hiding_scheduler": False}).cached
  assert len(list(tmp_path.glob(f"*{program_cache.SUFFIX}"))) == 5
  # A target config file changed after its device was made: the key is the text compiled for.
  config = tmp_path / "target.txtpb"
  config.write_text(gpu_program.target_config("h100_80gb"))
  compiled(target=str(config))
  config.write_text(gpu_program.target_config("h100_24gb"))
  assert not compiled(lambda x: jnp.tan(x), target=str(config)).cached  # for the 80 GB device
  assert not compiled(lambda x: jnp.tan(x), target="h100_24gb").cached
  # The Python frames that lowered it are not in the program (they vary with the caller): its
  # text is that of a step lowered without them.
  # (A scatter at a computed index: XLA gives the constants and slices it expands to metadata
  # that holds only a frame's index, printed as none once the index is left out.)
  scattered = lambda x: jnp.exp(x).at[jnp.argmax(x[:, 0])].add(1.0).cumsum(axis=0) * 3  # noqa: E731
  limit = jax.config.jax_traceback_in_locations_limit
  jax.config.update("jax_traceback_in_locations_limit", 0)
  try:
    without = compiled(scattered)  # a new function: lowered afresh
  finally:
    jax.config.update("jax_traceback_in_locations_limit", limit)
  # Lowered with its frames: the same key, read back; compiled afresh (another cache dir), the
  # same text.
  assert compiled(scattered).cached
  monkeypatch.setattr(program_cache, "directory", lambda: str(tmp_path / "another"))
  with_frames = compiled(scattered)
  monkeypatch.setattr(program_cache, "directory", lambda: str(tmp_path))
  assert not without.cached and not with_frames.cached  # two compiles, not one read back
  assert with_frames.hlo == without.hlo
  assert "FileNames" not in first.hlo and "stack_frame_id" not in first.hlo
  # A truncated entry (a process killed while it wrote, or a full disk), or one of another
  # format, is compiled again.
  overflowing = {"memory": {k: float("inf") for k in dataclasses.asdict(first.memory)}}
  for damaged in (
    entry.read_bytes()[:100],
    gzip.compress(b'{"memory": {}, "hlo": 1}'),
    gzip.compress(json.dumps({**overflowing, "hlo": "", "compile_seconds": 1}).encode()),
  ):
    entry.write_bytes(damaged)
    rewritten = compiled()
    assert not rewritten.cached and rewritten.hlo == first.hlo
    assert compiled().cached


def test_unknown_target_is_refused():
  with pytest.raises(ValueError, match="h100_80gb"):
    gpu_program.target_config("a100")


# docs/gpu.md's table (`python benchmarks/gpu_stream.py`): window, device temp / window, copies in
# flight during an update / all copies, to the device and back.
@pytest.mark.parametrize(
  "window_mib, temp_ratio, to_device, to_host",
  [(16, 0.57, (62, 64), (64, 64)), (32, 0.60, (32, 32), (32, 32)), (64, 0.30, (32, 32), (32, 32))],
)
def test_update_streams_through_the_window(window_mib, temp_ratio, to_device, to_host):
  # The case: AdamW, 16 leaves of 1024x1024 f32 (state 128 MiB), donated step.
  params = abstract_params(16, (1024, 1024))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=window_mib * MiB)
  program = compile_step(tx, params)
  counts = {"to_device": to_device, "to_host": to_host}
  assert_streams(program, window_mib * MiB, 128 * MiB, temp_ratio, counts)


def test_update_streams_at_a_realistic_size():
  # 16 leaves of 64 MiB (state 2 GiB), window 512 MiB.
  params = abstract_params(16, (4096, 4096))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=512 * MiB)
  program = compile_step(tx, params)
  counts = {"to_device": (30, 32), "to_host": (32, 32)}
  assert_streams(program, 512 * MiB, 2048 * MiB, 0.56, counts)


STACKED = {"layers": jax.ShapeDtypeStruct((32, 4096, 2048), jnp.float32)}
"""One leaf of 32 stacked layers, as lax.scan models keep them: 1 GiB of params, 2 GiB of state."""


def test_a_stacked_leaf_streams_in_row_slices():
  tx = oo.offload(optax.adamw(1e-3), window_bytes=256 * MiB)
  program = compile_step(tx, STACKED)
  # Every row of mu and nu in and out once, in 32 slices of each.
  counts = {"to_device": (62, 64), "to_host": (64, 64)}
  assert_streams(program, 256 * MiB, 2048 * MiB, 0.56, counts)


def test_tx_update_of_a_row_sliced_leaf_assembles_its_updates_on_the_device():
  # What the window does not bound (README, docs/gpu.md): with tx.update, a leaf updated in row
  # slices leaves the update as one param-sized buffer of updates, and with the gradients as
  # arguments XLA copies it once more: 2 GiB of temporaries for a 256 MiB window (8.31x).
  tx = oo.offload(optax.adamw(1e-3), window_bytes=256 * MiB)
  program = compile_step(tx, STACKED, apply=False)
  param_bytes = 1024 * MiB
  assert 2 * param_bytes <= program.memory.temp <= 2 * param_bytes + 256 * MiB, program.memory
  assert round(program.memory.temp / (256 * MiB), 2) == 8.31
  # The state streams as with update_and_apply: each slice's update runs in chunks, so the
  # departures overlap it too (4 of 64 with one update per slice, before).
  assert copies(program.schedule, "to_device") == (62, 64, 2048 * MiB)
  assert copies(program.schedule, "to_host") == (64, 64, 2048 * MiB)
  assert "pad(" not in program.hlo


def test_tx_update_of_whole_leaves_streams_like_update_and_apply():
  # The case with the standard step (tx.update + optax.apply_updates): 16 leaves of
  # 1024x1024 f32, 32 MiB window (docs/gpu.md's table). Each group's update runs in chunks written
  # in place of the gradient, so the previous group's state leaves during the first chunks and
  # the next one's arrives during the last (2 of 32 departures overlapped an update, before).
  params = abstract_params(16, (1024, 1024))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=32 * MiB)
  program = compile_step(tx, params, apply=False)
  assert copies(program.schedule, "to_device") == (30, 32, 128 * MiB)
  assert copies(program.schedule, "to_host") == (32, 32, 128 * MiB)
  # The updates are materialized (with the gradients as arguments, in a copy of them: 64 MiB);
  # in a training step that computes the gradients they are written in place of them. Device
  # temporaries 82.0 MiB, 2.56x the window (0.75x before, the updates fused into apply_updates).
  assert 64 * MiB <= program.memory.temp <= 64 * MiB + 32 * MiB, program.memory
  assert round(program.memory.temp / (32 * MiB), 2) == 2.56
  assert program.memory.host_temp == 0


def test_tx_update_of_stacked_bf16_leaves_with_master_weights():
  # The model-scale case in small (issue 21, item 4: a 13B stacked Llama's device peak held the
  # fp32 updates of whole stacked leaves as `pad` fusions): two stacked bf16 leaves in one-layer
  # row slices and a whole embedding, fp32 master + AdamW offloaded, tx.update + apply_updates,
  # compiled with STREAM_XLA_OPTIONS (three state arrays a slice: without them XLA keeps two copies
  # in flight and 68 of 102 overlap, as with update_and_apply).
  params = {f"s{i}": jax.ShapeDtypeStruct((16, 512, 1024), jnp.bfloat16) for i in range(2)}
  params["embed"] = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16)
  window = 16 * MiB
  tx = oo.offload(optax.adamw(1e-3), window_bytes=window, master_dtype=jnp.float32)
  program = compile_step(tx, params, apply=False, xla_flags=oo.STREAM_XLA_OPTIONS)
  n = sum(x.size for x in jax.tree.leaves(params))
  # Every state array (master, mu, nu) in and out once; every copy in flight during an update
  # (99/102 in and 6/102 out before).
  assert copies(program.schedule, "to_device") == (102, 102, 12 * n)
  assert copies(program.schedule, "to_host") == (102, 102, 12 * n)
  # Each leaf's fp32 updates are one buffer, every slice written into it in place: no `pad` (the
  # first slice's updates padded to the leaf's size, 3 before). What tx.update returns is on the
  # device: the fp32 updates (4 B/param, 68 MiB), plus the window's state and the chunks'
  # temporaries: 86.6 MiB in all, 5.41x the window.
  assert "pad(" not in program.hlo
  assert 4 * n <= program.memory.temp <= 4 * n + 1.25 * window, program.memory
  assert round(program.memory.temp / window, 2) == 5.41
  assert program.memory.host_temp == 0


def test_the_host_update_holds_the_params_updates_on_the_device_and_twice_the_state_on_the_host():
  # update_on="host" (README's status, docs/gpu.md): XLA:GPU runs every group in one host call, so
  # the device holds all gradients' updates at once, whatever the window (64 MiB: 4x a 16 MiB
  # window here), and the host call's temporaries are twice the state.
  params = abstract_params(16, (1024, 1024))
  tx = oo.offload(optax.adamw(1e-3), window_bytes=16 * MiB, update_on="host")
  program = compile_step(tx, params)
  param_bytes, state_bytes = 64 * MiB, 128 * MiB
  assert param_bytes <= program.memory.temp <= param_bytes + MiB, program.memory
  assert 2 * state_bytes <= program.memory.host_temp <= 2 * state_bytes + MiB, program.memory
  schedule = program.schedule
  # Gradients and params go to the host, updates come back; none of it overlaps the host call.
  assert copies(schedule, "to_host") == (0, 64, 2 * param_bytes)
  assert copies(schedule, "to_device") == (0, 32, param_bytes)
  assert len(schedule.host_compute) == 1


def test_abstract_and_concrete_inputs_compile_to_the_same_copies():
  mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {f"w{i}": jax.device_put(jnp.ones((512, 1024)), on_mesh) for i in range(4)}
  tx = oo.offload(optax.adam(1e-3), window_bytes=4 * MiB)
  state = tx.init(params)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  def copy_list(program):
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
  assert copy_list(concrete) == copy_list(from_abstract) == copy_list(from_own)
  # mu and nu of each 2 MiB leaf, in and out once (the leaves' row slices in turn in one loop).
  assert copies(concrete.schedule, "to_device")[2] == 4 * 2 * 2 * MiB
  assert copies(concrete.schedule, "to_host")[2] == 4 * 2 * 2 * MiB
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
  assert_streams(program, 16 * MiB, 32 * MiB, 0.57, {"to_device": (14, 16), "to_host": (16, 16)})


def test_a_stacked_llama_step_keeps_the_state_off_the_device():
  # A small Llama-style decoder (layers stacked under lax.scan, remat, bf16 params), the training
  # step compiled for the 24 GiB target: with offload_state the device holds bf16 params and grads
  # (4 B/param) plus the window and activations (measured 4.78 B/param in all); plain optax
  # (bf16 params, fp32 mu, bf16 nu) holds 6 B/param of state more, less the window.
  from benchmarks import gpu_memory
  from benchmarks import llama

  cfg = llama.Config(d=512, layers=8, ffn=1536, heads=8, vocab=8192)
  window = 16 * MiB
  plain = gpu_memory.compile_step(cfg, "plain_bf16", "h100_24gb", None, seq=256).memory
  off = gpu_memory.compile_step(cfg, "offload_state", "h100_24gb", window, seq=256)
  weights_and_grads = 4 * cfg.params
  assert off.memory.host >= 0.99 * 12 * cfg.params  # fp32 master, mu, nu in pinned host memory
  assert weights_and_grads + window <= off.memory.device <= 4.8 * cfg.params, off.memory
  assert plain.device - off.memory.device >= 6 * cfg.params - window, (plain, off.memory)
  # The update's copies in the whole step (docs/gpu.md, "In a training step"): each row slice has
  # three state arrays (fp32 master, mu, nu) and XLA:GPU keeps two copies in flight, so one of
  # each three arrives (and leaves) with no compute beside it: 112/174 in, 114/174 out measured.
  assert_step_copies(off.schedule, {"to_device": (112, 174), "to_host": (114, 174)})


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
  assert copies(schedule, "to_host")[2] == 2 * 2 * n  # bf16 gradients and params
  assert copies(schedule, "to_device")[2] == 4 * n  # fp32 updates
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
  assert memory.temp <= 80 * MiB and round(memory.temp / (80 * MiB), 2) <= 0.88, memory
  assert memory.host_temp == 0
  assert memory.host_alias == memory.host_output == 14 * n  # new params and state, donated
  # Grads come in; params and state both ways. In flight during an update (docs/layers.md): every
  # copy in, all but the last slice's last copy out (80/80, 63/64 measured).
  assert copies(schedule, "to_device") == (80, 80, 16 * n)
  hit, total, nbytes = copies(schedule, "to_host")
  assert (total, nbytes) == (64, 14 * n) and hit >= total - 1, (hit, total)


def test_a_stacked_llama_step_with_the_weights_offloaded_too():
  # The same step with the layer stack's bf16 weights and gradients in pinned host memory too
  # (offloaded_scan + update_and_apply on host params): the device no longer holds the stack's
  # weights and gradients (it streams a few layers of them, within what else the step frees:
  # measured 24.5 layers' worth less device memory); the host holds them beside the state.
  from benchmarks import gpu_memory
  from benchmarks import llama

  cfg = llama.Config(d=256, layers=24, ffn=768, heads=4, vocab=4096)
  stack = cfg.params - 2 * cfg.vocab * cfg.d - cfg.d
  window = 32 * MiB  # about 20 groups (compile time grows fast with the group count)
  state_program = gpu_memory.compile_step(cfg, "offload_state", "h100_24gb", window, seq=256)
  both_program = gpu_memory.compile_step(cfg, "offload_all", "h100_24gb", window, seq=256)
  state, both = state_program.memory, both_program.memory
  assert both.host >= 0.99 * (12 * cfg.params + 4 * stack)  # state, and the stack's weights + grads
  off_device = state.device - both.device
  # offload_all: the stack's weights arrive and its gradients leave beside the backward pass's
  # compute; only the update's first arrivals and last departures miss (593/596 in, 232/235 out,
  # a copy in offloaded_scan's loop once per layer).
  assert_step_copies(state_program.schedule, {"to_device": (44, 72), "to_host": (45, 72)})
  assert_step_copies(both_program.schedule, {"to_device": (593, 596), "to_host": (232, 235)})
  assert off_device >= 4 * stack, (state.device, both.device)


def test_tx_update_with_an_nvme_tier_compiles_for_the_gpu(tmp_path):
  # On one device (an explicit mesh) an NVMe-tier leaf's row slices are chunked as a host-tier
  # leaf's are: the fetched buffer (a callback's result, on no mesh) is typed on the gradients'
  # mesh before the chunks are written into it (without that the trace failed).
  from conftest import make_params
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), make_params())
  tx = oo.offload(
    optax.adam(1e-2), window_bytes=100_000, host_limit="200KiB", nvme_dir=str(tmp_path)
  )
  state = tx.init(params)
  try:

    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    program = gpu_program.compile_for_gpu(step, params, state, params, donate_argnums=(0, 1))
    assert program.schedule.callbacks  # 'big' on NVMe: its fetches and puts
    # The host tier's copies (the NVMe tier's go through the callbacks): 8 of 10 in flight during
    # an update each way.
    assert program.schedule.overlap("to_device", per_execution=True) == (8, 10)
    assert program.schedule.overlap("to_host", per_execution=True) == (8, 10)
  finally:
    oo.close_nvme(state)
