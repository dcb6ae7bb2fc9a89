"""The step-time model: hand-written programs whose time follows from the rates, compiled programs
that must keep the model's invariants, Triton (Pallas) kernels priced by the FLOPs their IR
executes, the shipped rates and their sources, and the 7B check against published MFU.

Expected times are computed here from the `Hardware` rates and the shapes, never copied from the
model's output.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import gpu_compile_or_skip

import optax_offload as oo
from optax_offload._src import gpu_program
from optax_offload._src import step_time

HW = step_time.hardware("h100_80gb")
MiB = 1 << 20


def gemm_s(flops: float, hw=HW) -> float:
  return flops / (hw.gemm_efficiency * hw.tensor_flops)


def memory_s(nbytes: float, hw=HW) -> float:
  return nbytes / (hw.memory_efficiency * hw.memory_bandwidth)


def module(*computations: str) -> str:
  return "HloModule m, is_scheduled=true\n\n" + "\n\n".join(computations) + "\n"


def copy_and_matmul(copy_rows: int, wait_first: bool) -> str:
  """A host->device copy of an f32[copy_rows,1024] host array and a 4096^3 bf16 matmul, the copy
  waited after the matmul (overlapped) or before it."""
  host = f"f32[{copy_rows},1024]{{1,0:S(5)}}"
  dev = f"f32[{copy_rows},1024]{{1,0}}"
  lines = [
    f"  %x = {host} parameter(0)",
    "  %a = bf16[4096,4096]{1,0} parameter(1)",
    f"  %cs = ({dev}, {host}, u32[]) copy-start(%x)",
    "  %mm = bf16[4096,4096]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    f"  %cd = {dev} copy-done(%cs)",
  ]
  if wait_first:
    lines[3], lines[4] = lines[4], lines[3]
  lines.append(f"  ROOT %t = (bf16[4096,4096]{{1,0}}, {dev}) tuple(%mm, %cd)")
  entry = f"ENTRY %main (x: f32[{copy_rows},1024], a: bf16[4096,4096]) -> (bf16[4096,4096], f32[{copy_rows},1024]) {{\n"
  return module(entry + "\n".join(lines) + "\n}")


MATMUL_FLOPS = 2 * 4096**3


@pytest.mark.parametrize("copy_rows", [256, 16384])
def test_a_copy_overlapping_a_matmul_costs_only_what_the_matmul_does_not_hide(copy_rows):
  t = step_time.timeline(copy_and_matmul(copy_rows, wait_first=False), HW)
  copy = copy_rows * 1024 * 4 / HW.h2d_bandwidth
  kernel = HW.launch_s + max(gemm_s(MATMUL_FLOPS), memory_s(3 * 4096 * 4096 * 2))
  assert t.bytes_to_device == copy_rows * 1024 * 4
  assert t.step_s == pytest.approx(max(copy, kernel))
  assert t.transfer_wait_s == pytest.approx(max(0.0, copy - kernel))
  assert t.compute_s == pytest.approx(kernel)


def test_a_copy_waited_before_any_compute_adds_its_whole_time():
  t = step_time.timeline(copy_and_matmul(256, wait_first=True), HW)
  copy = 256 * 1024 * 4 / HW.h2d_bandwidth
  assert t.transfer_wait_s == pytest.approx(copy)
  assert t.step_s == pytest.approx(copy + HW.launch_s + gemm_s(MATMUL_FLOPS))
  assert t.bottleneck == "gemm"


def loop(trip_count: int, inner: int | None = None) -> str:
  """A while loop of `trip_count` iterations whose body runs a 1024^3 matmul (and, with `inner`,
  a nested loop of `inner` iterations around it)."""
  state = "(s32[], bf16[1024,1024]{1,0})"
  matmul_body = (
    f"%body (p: {state}) -> {state} {{\n"
    f"  %p = {state} parameter(0)\n"
    "  %i = s32[] get-tuple-element(%p), index=0\n"
    "  %w = bf16[1024,1024]{1,0} get-tuple-element(%p), index=1\n"
    "  %mm = bf16[1024,1024]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
    f"  ROOT %out = {state} tuple(%i, %mm)\n}}"
  )
  cond = (
    f"%cond (p: {state}) -> pred[] {{\n  %p = {state} parameter(0)\n"
    "  %i = s32[] get-tuple-element(%p), index=0\n"
    "  %n = s32[] constant(1000)\n"
    "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}"
  )
  comps = [matmul_body, cond]
  body = "body"
  if inner is not None:
    comps.append(
      f"%outer (p: {state}) -> {state} {{\n  %p = {state} parameter(0)\n"
      f"  ROOT %w = {state} while(%p), condition=%cond, body=%body, "
      f'backend_config={{"known_trip_count":{{"n":"{inner}"}}}}\n}}'
    )
    body = "outer"
  entry = (
    "ENTRY %main (w: bf16[1024,1024]) -> bf16[1024,1024] {\n"
    "  %w = bf16[1024,1024]{1,0} parameter(0)\n"
    "  %zero = s32[] constant(0)\n"
    f"  %init = {state} tuple(%zero, %w)\n"
    f"  %loop = {state} while(%init), condition=%cond, body=%{body}, "
    f'backend_config={{"known_trip_count":{{"n":"{trip_count}"}}}}\n'
    "  ROOT %r = bf16[1024,1024]{1,0} get-tuple-element(%loop), index=1\n}"
  )
  return module(*comps, entry)


@pytest.mark.parametrize("trip_count, inner", [(5, None), (3, 4)])
def test_a_loop_runs_its_known_trip_count_and_nested_loops_multiply(trip_count, inner):
  t = step_time.timeline(loop(trip_count, inner), HW)
  runs = trip_count * (inner or 1)
  assert t.launches == runs
  assert t.gemm_flops == runs * 2 * 1024**3
  kernel = HW.launch_s + max(gemm_s(2 * 1024**3), memory_s(3 * 1024 * 1024 * 2))
  assert t.step_s == pytest.approx(runs * kernel)
  (cost,) = t.kernel_costs
  assert cost.executions == runs


def test_past_max_iterations_a_loop_repeats_its_last_iteration():
  simulated = step_time.timeline(loop(40), HW)
  extrapolated = step_time.timeline(loop(40), HW, max_iterations=8)
  assert extrapolated.step_s == pytest.approx(simulated.step_s)
  assert extrapolated.launches == simulated.launches == 40


def prefetching_loop(trip_count: int, rows: int) -> str:
  """Each iteration waits for the copy the previous one started, starts the next and runs a
  2048^3 matmul: the copy crosses the loop boundary in the loop state."""
  host = f"f32[{rows},1024]{{1,0:S(5)}}"
  pending = f"(f32[{rows},1024]{{1,0}}, {host}, u32[])"
  state = f"(s32[], {pending}, bf16[2048,2048]{{1,0}}, {host})"
  body = (
    f"%body (p: {state}) -> {state} {{\n"
    f"  %p = {state} parameter(0)\n"
    "  %i = s32[] get-tuple-element(%p), index=0\n"
    f"  %pending = {pending} get-tuple-element(%p), index=1\n"
    "  %w = bf16[2048,2048]{1,0} get-tuple-element(%p), index=2\n"
    f"  %src = {host} get-tuple-element(%p), index=3\n"
    f"  %arrived = f32[{rows},1024]{{1,0}} copy-done(%pending)\n"
    f"  %next = {pending} copy-start(%src)\n"
    "  %mm = bf16[2048,2048]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
    f"  ROOT %out = {state} tuple(%i, %next, %mm, %src)\n}}"
  )
  cond = (
    f"%cond (p: {state}) -> pred[] {{\n  %p = {state} parameter(0)\n"
    "  %i = s32[] get-tuple-element(%p), index=0\n"
    "  %n = s32[] constant(1000)\n"
    "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}"
  )
  entry = (
    f"ENTRY %main (x: f32[{rows},1024], w: bf16[2048,2048]) -> f32[{rows},1024] {{\n"
    f"  %x = {host} parameter(0)\n"
    "  %w = bf16[2048,2048]{1,0} parameter(1)\n"
    "  %zero = s32[] constant(0)\n"
    f"  %first = {pending} copy-start(%x)\n"
    f"  %init = {state} tuple(%zero, %first, %w, %x)\n"
    f"  %loop = {state} while(%init), condition=%cond, body=%body, "
    f'backend_config={{"known_trip_count":{{"n":"{trip_count}"}}}}\n'
    f"  %last = {pending} get-tuple-element(%loop), index=1\n"
    f"  ROOT %done = f32[{rows},1024]{{1,0}} copy-done(%last)\n}}"
  )
  return module(body, cond, entry)


@pytest.mark.parametrize("rows", [64, 4096])
def test_a_copy_started_in_one_iteration_and_waited_in_the_next(rows):
  n = 6
  t = step_time.timeline(prefetching_loop(n, rows), HW)
  c = rows * 1024 * 4 / HW.h2d_bandwidth
  k = HW.launch_s + max(gemm_s(2 * 2048**3), memory_s(3 * 2048 * 2048 * 2))
  assert t.bytes_to_device == (n + 1) * rows * 1024 * 4
  if c > k:  # copy-bound: every iteration waits for the copy the previous one started
    assert t.step_s == pytest.approx((n + 1) * c)
    assert t.transfer_wait_s == pytest.approx(c + n * (c - k))
  else:  # compute-bound: only the first copy is waited for
    assert t.step_s == pytest.approx(c + n * k)
    assert t.transfer_wait_s == pytest.approx(c)


def test_a_kernel_reading_host_memory_moves_its_bytes_over_the_link():
  fused = (
    "%fused (p0: f32[4096,4096]) -> f32[4096,4096] {\n"
    "  %p0 = f32[4096,4096]{1,0:S(5)} parameter(0)\n"
    "  ROOT %m = f32[4096,4096]{1,0} multiply(%p0, %p0)\n}"
  )
  entry = (
    "ENTRY %main (x: f32[4096,4096]) -> f32[4096,4096] {\n"
    "  %x = f32[4096,4096]{1,0:S(5)} parameter(0)\n"
    "  ROOT %f = f32[4096,4096]{1,0} fusion(%x), kind=kLoop, calls=%fused\n}"
  )
  t = step_time.timeline(module(fused, entry), HW)
  nbytes = 4096 * 4096 * 4
  assert t.bytes_to_device == nbytes
  assert t.other_s == pytest.approx(max(memory_s(nbytes), 4096 * 4096 / HW.vector_flops))
  assert t.step_s == pytest.approx(HW.launch_s + max(nbytes / HW.h2d_bandwidth, t.other_s))
  assert t.bottleneck == "link_to_device"


def test_a_fusion_counts_the_slice_it_reads_and_the_update_it_writes():
  fused = (
    "%fused (p0: bf16[32,4096,4096], p1: s32[], p2: bf16[1,4096,4096]) -> bf16[32,4096,4096] {\n"
    "  %p0 = bf16[32,4096,4096]{2,1,0} parameter(0)\n"
    "  %p1 = s32[] parameter(1)\n"
    "  %p2 = bf16[1,4096,4096]{2,1,0} parameter(2)\n"
    "  %z = s32[] constant(0)\n"
    "  ROOT %u = bf16[32,4096,4096]{2,1,0} dynamic-update-slice(%p0, %p2, %p1, %z, %z)\n}"
  )
  entry = (
    "ENTRY %main (a: bf16[32,4096,4096], i: s32[], b: bf16[1,4096,4096]) -> bf16[32,4096,4096] {\n"
    "  %a = bf16[32,4096,4096]{2,1,0} parameter(0)\n"
    "  %i = s32[] parameter(1)\n"
    "  %b = bf16[1,4096,4096]{2,1,0} parameter(2)\n"
    "  ROOT %f = bf16[32,4096,4096]{2,1,0} fusion(%a, %i, %b), kind=kLoop, calls=%fused\n}"
  )
  t = step_time.timeline(module(fused, entry), HW)
  (cost,) = t.kernel_costs
  assert cost.bytes == 2 * 4096 * 4096 * 2 + 4  # the update read and written, and the index


def callback_program(op_name: str) -> str:
  return module(
    "ENTRY %main (x: f32[1024,1024]) -> f32[1024,1024] {\n"
    "  %x = f32[1024,1024]{1,0} parameter(0)\n"
    "  ROOT %cb = f32[1024,1024]{1,0} custom-call(%x), "
    'custom_call_target="xla_ffi_python_gpu_callback", custom_call_has_side_effect=true, '
    f'metadata={{op_type="io_callback" op_name="{op_name}"}}\n}}'
  )


@pytest.mark.parametrize("disk_overlap", [True, False])
def test_a_callback_synchronises_and_charges_the_disk_traffic_it_is_given(disk_overlap):
  nbytes = 1024 * 1024 * 4
  read, write = 64 * MiB, 32 * MiB
  t = step_time.timeline(
    callback_program("jit(step)/nvme_read/io_callback"),
    HW,
    disk={"nvme_read": (read, write), "unrelated": (1, 1)},
    disk_overlap=disk_overlap,
  )
  down, up = nbytes / HW.d2h_bandwidth, nbytes / HW.h2d_bandwidth
  read_s, write_s = read / HW.nvme_read, write / HW.nvme_write
  assert t.callbacks == 1
  assert (t.disk_read_bytes, t.disk_write_bytes) == (read, write)
  assert t.disk_s == pytest.approx(read_s + write_s)
  if disk_overlap:  # the read was prefetched; the write is behind the callback
    returned = max(down + HW.callback_s, read_s) + up
    assert t.callback_s == pytest.approx(returned)
    assert t.step_s == pytest.approx(max(returned, max(down + HW.callback_s, read_s) + write_s))
  else:
    assert t.callback_s == pytest.approx(down + HW.callback_s + read_s + write_s + up)
    assert t.step_s == pytest.approx(t.callback_s)


def test_a_callback_without_disk_traffic_costs_its_overhead_and_bytes():
  t = step_time.timeline(callback_program("jit(step)/io_callback"), HW, disk={"nvme": (1, 1)})
  nbytes = 1024 * 1024 * 4
  assert t.disk_s == 0
  assert t.step_s == pytest.approx(
    nbytes / HW.d2h_bandwidth + HW.callback_s + nbytes / HW.h2d_bandwidth
  )


def test_a_host_computation_takes_its_bytes_at_host_bandwidth():
  n = 1 << 20
  program = module(
    f"%host_fn (a: f32[{n}]) -> f32[{n}] {{\n  %a = f32[{n}]{{0}} parameter(0)\n"
    f"  ROOT %m = f32[{n}]{{0}} multiply(%a, %a)\n}}",
    f"ENTRY %main (x: f32[{n}]) -> f32[{n}] {{\n  %x = f32[{n}]{{0}} parameter(0)\n"
    f"  %h = f32[{n}]{{0}} call(%x), to_apply=%host_fn, "
    'frontend_attributes={_xla_compute_type="host"}\n'
    f"  ROOT %y = f32[{n}]{{0}} add(%h, %h)\n}}",
  )
  hw = step_time.hardware("h100_80gb", host="server")
  t = step_time.timeline(program, hw)
  host = 2 * 4 * n / hw.host_bandwidth
  link = 4 * n / hw.d2h_bandwidth + 4 * n / hw.h2d_bandwidth
  assert t.host_s == pytest.approx(host)
  assert t.bytes_to_host == t.bytes_to_device == 4 * n
  assert t.host_wait_s == pytest.approx(host + link)
  kernel = hw.launch_s + max(memory_s(3 * 4 * n, hw), n / hw.vector_flops)
  assert t.step_s == pytest.approx(host + link + kernel)


def test_a_conditional_costs_its_costliest_branch():
  def branch(name, size):
    return (
      f"%{name} (p: bf16[{size},{size}]) -> bf16[{size},{size}] {{\n"
      f"  %p = bf16[{size},{size}]{{1,0}} parameter(0)\n"
      f"  ROOT %d = bf16[{size},{size}]{{1,0}} dot(%p, %p), "
      "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n}"
    )

  entry = (
    "ENTRY %main (c: pred[], a: bf16[512,512], b: bf16[4096,4096]) -> bf16[512,512] {\n"
    "  %c = pred[] parameter(0)\n"
    "  %a = bf16[512,512]{1,0} parameter(1)\n"
    "  %b = bf16[4096,4096]{1,0} parameter(2)\n"
    "  ROOT %r = bf16[512,512]{1,0} conditional(%c, %a, %b), "
    "true_computation=%small, false_computation=%big\n}"
  )
  t = step_time.timeline(module(branch("small", 512), branch("big", 4096), entry), HW)
  assert t.gemm_flops == MATMUL_FLOPS
  assert t.step_s == pytest.approx(HW.launch_s + gemm_s(MATMUL_FLOPS))


def test_gemm_flops_of_cublas_calls_and_convolutions():
  cublas = (
    "ENTRY %main (a: bf16[8,512,256], b: bf16[8,256,128]) -> bf16[8,512,128] {\n"
    "  %a = bf16[8,512,256]{2,1,0} parameter(0)\n"
    "  %b = bf16[8,256,128]{2,1,0} parameter(1)\n"
    "  %g = (bf16[8,512,128]{2,1,0}, s8[4194304]{0}) custom-call(%a, %b), "
    'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
    '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],'
    '"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],'
    '"rhs_batch_dimensions":["0"]}}}\n'
    "  ROOT %r = bf16[8,512,128]{2,1,0} get-tuple-element(%g), index=0\n}"
  )
  conv = (
    "ENTRY %main (x: f32[4,32,32,16], k: f32[3,3,16,64]) -> f32[4,32,32,64] {\n"
    "  %x = f32[4,32,32,16]{3,2,1,0} parameter(0)\n"
    "  %k = f32[3,3,16,64]{3,2,1,0} parameter(1)\n"
    "  ROOT %c = f32[4,32,32,64]{3,2,1,0} convolution(%x, %k), window={size=3x3 pad=1_1x1_1}, "
    "dim_labels=b01f_01io->b01f\n}"
  )
  t = step_time.timeline(module(cublas), HW)
  assert t.gemm_flops == 2 * 8 * 512 * 128 * 256
  (cost,) = t.kernel_costs
  assert cost.bytes == (8 * 512 * 256 + 8 * 256 * 128 + 8 * 512 * 128) * 2  # no workspace
  assert step_time.timeline(module(conv), HW).gemm_flops == 2 * 4 * 32 * 32 * 64 * (3 * 3 * 16)


# ----------------------------------------------------------------------------------------------
# Compiled programs.

_MESH = jax.sharding.Mesh(jax.devices("cpu")[:1], ("d",))
DEVICE = jax.sharding.NamedSharding(_MESH, jax.sharding.PartitionSpec())
HOST = DEVICE.with_memory_kind("pinned_host")


def _overlap_program(target="h100_80gb"):
  def f(a, x):
    return a @ a, jax.device_put(x, jax.memory.Space.Device) * 2

  a = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=DEVICE)
  x = jax.ShapeDtypeStruct((2048, 1024), jnp.float32, sharding=HOST)
  return gpu_program.compile_for_gpu(f, a, x, target=target)


def _scan_program():
  def f(xs, w):
    def body(c, x):
      return c @ (jax.device_put(x, jax.memory.Space.Device) * w), None

    return jax.lax.scan(body, jnp.ones((1024, 1024), jnp.bfloat16), xs)[0]

  xs = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16, sharding=HOST)
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=DEVICE)
  return gpu_program.compile_for_gpu(f, xs, w)


def _offload_program():
  params = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(8)}
  tx = oo.offload(optax.adamw(1e-3), window_bytes=16 * MiB)
  state = oo.abstract_state(tx, params)

  def step(params, state, grads):
    return oo.update_and_apply(tx, grads, state, params)

  return gpu_program.compile_for_gpu(step, params, state, params, donate_argnums=(0, 1))


PROGRAMS = {"overlap": _overlap_program, "scan": _scan_program, "offload": _offload_program}


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def compiled(request):
  gpu_compile_or_skip()
  return request.param, PROGRAMS[request.param]()


@pytest.mark.parametrize("host", step_time.HOSTS)
def test_compiled_programs_keep_the_invariants(compiled, host):
  name, program = compiled
  hw = step_time.hardware(program.target, host)
  t = program.timeline(hw)
  assert t.step_s >= t.compute_s > 0
  assert t.step_s >= t.bytes_to_device / hw.h2d_bandwidth
  assert t.step_s >= t.bytes_to_host / hw.d2h_bandwidth
  assert t.step_s >= t.flops / hw.tensor_flops
  assert t.compute_s == pytest.approx(t.gemm_s + t.other_s + t.launch_s)
  assert t.unknown_trip_counts == 0
  schedule = program.schedule
  for direction, moved in (("to_device", t.bytes_to_device), ("to_host", t.bytes_to_host)):
    copied = sum(
      c.nbytes * schedule.executions(c.computation)
      for c in schedule.copies
      if c.direction == direction
    )
    # The model moves what the schedule reader finds copied (and what kernels read from host).
    assert moved >= copied
    if name != "offload":
      assert moved == copied


def test_a_compiled_matmul_chain_has_its_exact_flops():
  gpu_compile_or_skip()
  a = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=DEVICE)
  b = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=DEVICE)
  c = jax.ShapeDtypeStruct((2048, 256), jnp.bfloat16, sharding=DEVICE)
  program = gpu_program.compile_for_gpu(lambda a, b, c: (a @ b) @ c, a, b, c)
  t = program.timeline()
  assert t.gemm_flops == 2 * 512 * 1024 * 2048 + 2 * 512 * 2048 * 256
  assert t.step_s >= gemm_s(t.gemm_flops)


def test_the_rtx4090_target_compiles_and_uses_its_rates():
  gpu_compile_or_skip()
  assert "rtx4090_24gb" in gpu_program.TARGETS
  program = _overlap_program("rtx4090_24gb")
  assert program.target == "rtx4090_24gb"
  hw = step_time.hardware("rtx4090_24gb")
  t = program.timeline()
  assert t.peak_flops == hw.tensor_flops
  assert t.bytes_to_device == 2048 * 1024 * 4
  slower = dataclasses.replace(hw, h2d_bandwidth=hw.h2d_bandwidth / 2)
  assert program.timeline(slower).link_to_device_s == pytest.approx(2 * t.link_to_device_s)


def _flash_program(seq: int, causal: bool, heads: int = 2, head_dim: int = 64):
  from jax.experimental.pallas.ops.gpu import attention

  q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16, sharding=DEVICE)

  def grads(q, k, v):
    def loss(q, k, v):
      out = attention.mha(q, k, v, None, sm_scale=head_dim**-0.5, causal=causal)
      return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return gpu_program.compile_for_gpu(grads, q, q, q)


@pytest.mark.parametrize("causal", [False, True])
def test_a_flash_attention_kernel_is_priced_by_the_flops_it_executes(causal):
  gpu_compile_or_skip()
  from jax.experimental.pallas.ops.gpu import attention

  seq, heads, e = 1024, 2, 64
  t = _flash_program(seq, causal, heads, e).timeline()
  blocks = attention.BlockSizes.get_default()

  def pairs(block: int) -> int:
    """(query, key) pairs the kernel computes: whole blocks on and below the diagonal."""
    n = seq // block
    return (n * (n + 1) // 2 if causal else n * n) * block * block

  # jax's kernels: the forward runs 2 matmuls (q k^T, p v) per pair of its 128-blocks; the
  # backward 4 for dk and dv (q k^T again, p^T do, do v^T, ds^T q) and 3 for dq, on 32-blocks.
  assert blocks.block_q == blocks.block_k and blocks.block_q_dkv == blocks.block_q_dq
  forward = 2 * 2 * e * pairs(blocks.block_q)
  backward = 7 * 2 * e * pairs(blocks.block_q_dkv)
  assert t.gemm_flops == heads * (forward + backward)
  if not causal:
    assert forward == 4 * seq * seq * e
  kernels = [k for k in t.kernel_costs if "pallas_call" in k.op_name and k.kind == "gemm"]
  assert sum(k.flops for k in kernels) >= t.gemm_flops
  # A Triton kernel is charged like a fused GEMM: its matmuls at the GEMM rate, its other FLOPs
  # (softmax, masking) at the vector rate, or its bytes if they take longer.
  for k in kernels:
    assert k.seconds >= k.executions * HW.launch_s + gemm_s(k.flops)
    assert k.seconds > k.executions * HW.launch_s + memory_s(k.bytes)  # compute-bound


def test_a_triton_call_without_readable_ir_is_charged_for_its_bytes():
  call = (
    "ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {\n"
    "  %a = f32[1024,1024]{1,0} parameter(0)\n"
    "  ROOT %k = f32[1024,1024]{1,0} custom-call(%a), "
    'custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 8 : i32, '
    'grid_y = 1 : i32, grid_z = 1 : i32, ir = "not bytecode", name = "k"}\n}'
  )
  t = step_time.timeline(module(call), HW)
  assert t.flops == 0
  assert t.step_s == pytest.approx(HW.launch_s + memory_s(2 * 1024 * 1024 * 4))


# ----------------------------------------------------------------------------------------------
# Rates.


@pytest.mark.parametrize("target", gpu_program.TARGETS)
@pytest.mark.parametrize("host", step_time.HOSTS)
def test_every_shipped_rate_is_positive_and_has_a_source(target, host):
  hw = step_time.hardware(target, host)
  for field in dataclasses.fields(hw):
    if field.name in ("name", "sources"):
      continue
    value = getattr(hw, field.name)
    assert value > 0 and math.isfinite(value), field.name
    assert "http" in hw.source(field.name), field.name  # every rate cites where it comes from
  assert 0 < hw.gemm_efficiency <= 1 and 0 < hw.memory_efficiency <= 1


def test_the_24gb_h100_has_the_80gb_rates():
  small, big = step_time.hardware("h100_24gb"), step_time.hardware("h100_80gb")
  assert dataclasses.replace(small, name=big.name) == big


def test_unknown_targets_and_hosts_are_refused():
  with pytest.raises(ValueError, match="h100_80gb"):
    step_time.hardware("a100")
  with pytest.raises(ValueError, match="desktop"):
    step_time.hardware("h100_80gb", host="laptop")


# ----------------------------------------------------------------------------------------------
# The 7B check against published MFU (docs/speed.md, "Compared with published MFU").

PUBLISHED_MFU = (0.40, 0.53)  # MaxText Llama-2-7B 49.7-53%, llm-foundry 7B 40-46%, NeMo ~49.5%


@pytest.fixture(scope="module")
def llama_7b():
  gpu_compile_or_skip()
  from benchmarks import gpu_memory
  from benchmarks import llama

  cfg = llama.CONFIGS["7B"]
  program = gpu_memory.compile_step(cfg, "plain_bf16", "h100_80gb", None)
  return cfg, program, program.timeline()


def test_the_7b_step_is_matmul_bound_and_recomputes(llama_7b):
  cfg, program, t = llama_7b
  tokens = 2048
  model_flops = 6 * cfg.params * tokens
  layer_params = cfg.params - 2 * cfg.vocab * cfg.d - cfg.d
  # jax.checkpoint recomputes each layer's forward: 8 FLOPs per layer parameter and token, less
  # the projections whose outputs the backward pass does not need.
  not_recomputed = 2 * cfg.layers * (cfg.d * cfg.d + cfg.d * cfg.ffn)  # outputs wo and w_down
  assert t.gemm_flops >= (8 * layer_params - not_recomputed) * tokens
  assert t.bottleneck == "gemm"
  # The step cannot beat its matrix multiplies at the measured GEMM rate.
  assert t.mfu(model_flops) <= HW.gemm_efficiency * model_flops / t.gemm_flops
  assert t.step_s >= t.compute_s


# The published run compared (docs/speed.md, "Compared with published MFU"): MaxText's Llama-2-7B
# on 8x H100 80 GB (NVIDIA JAX-Toolbox, docs/frameworks/maxtext): bf16, sequence 4,096, 2 sequences
# per GPU per step, FSDP over the 8 GPUs, cuDNN flash attention, remat policy minimal_flash, 0.721 s
# per step: 11,362 tokens/s per GPU, 46.4% MFU as 6 x params x tokens. Its per-GPU work for one
# step: 2 x 4,096 tokens and an eighth of the AdamW update. Here one GPU runs 8 micro-batches of
# 2 x 4,096 and one whole update (the same update per token), flash attention (Pallas Triton) and
# the projections' outputs saved.
MAXTEXT_7B = {"batch": 2, "seq": 4096, "micro_batches": 8}


@pytest.fixture(scope="module")
def maxtext_7b():
  gpu_compile_or_skip()
  from benchmarks import llama

  cfg = dataclasses.replace(llama.CONFIGS["7B"], attention="flash", remat="dots")
  return cfg, llama.extrapolated_step(cfg, "h100_80gb", **MAXTEXT_7B, depths=(2, 4))


def test_the_7b_step_lands_in_the_published_mfu_band(maxtext_7b):
  _, figures = maxtext_7b
  assert PUBLISHED_MFU[0] <= figures["mfu"] <= PUBLISHED_MFU[1]


def test_the_step_time_is_linear_in_the_layers(maxtext_7b):
  # What the extrapolation to 32 layers rests on: a third depth lies on the line of the two.
  from benchmarks import llama

  cfg, figures = maxtext_7b
  program = llama.compile_train_step(cfg.with_layers(3), "h100_80gb", **MAXTEXT_7B)
  two = figures["depths"][2]["step_s"]
  assert program.timeline().step_s == pytest.approx(two + figures["layer_s"], rel=1e-3)


def disk_program(*parts: str) -> str:
  """Callbacks on an int32[3] token ('cb': an NVMe callback named by its scope) and 4096^3 bf16
  matmuls ('mm'), in this order: nothing but the disk and the matmuls takes time."""
  lines = ["  %t0 = s32[3]{0} parameter(0)", "  %a = bf16[4096,4096]{1,0} parameter(1)"]
  token = "%t0"
  for k, part in enumerate(parts):
    if part == "mm":
      lines.append(
        f"  %mm{k} = bf16[4096,4096]{{1,0}} dot(%a, %a), lhs_contracting_dims={{1}}, "
        "rhs_contracting_dims={0}"
      )
    else:
      lines.append(
        f"  %cb{k} = s32[3]{{0}} custom-call({token}), "
        'custom_call_target="xla_ffi_python_gpu_callback", custom_call_has_side_effect=true, '
        f'metadata={{op_type="io_callback" op_name="jit(step)/{part}/io_callback"}}'
      )
      token = f"%cb{k}"
  lines.append(f"  ROOT %out = (s32[3]{{0}}) tuple({token})")
  entry = "ENTRY %main (t0: s32[3], a: bf16[4096,4096]) -> (s32[3]) {\n"
  return module(entry + "\n".join(lines) + "\n}")


NO_OVERHEAD = dataclasses.replace(HW, callback_s=0.0)
LINK_S = 1e-8  # the tokens' 12 bytes over the link, a few times: nanoseconds


def test_the_disk_reads_ahead_no_further_than_its_buffers():
  # Two fetches with a matmul between: the second fetch's read-ahead starts when the first
  # returns, bounded by read_ahead_bytes; the rest is read while the stream waits.
  program = disk_program("nvme_fetch", "mm", "nvme_fetch")
  m = step_time.timeline(program, NO_OVERHEAD).compute_s  # the matmul (and its launch)
  r = 2 * m  # each fetch reads for twice the matmul's time
  read = r * NO_OVERHEAD.nvme_read

  def step(ahead):
    t = step_time.timeline(
      program, NO_OVERHEAD, disk={"nvme_fetch": (read, 0)}, read_ahead_bytes=ahead
    )
    assert t.disk_read_bytes == 2 * read and t.disk_s == pytest.approx(2 * r)
    return t

  assert step(0).step_s == pytest.approx(2 * r + m, abs=LINK_S)  # nothing read ahead
  assert step(0).disk_wait_s == pytest.approx(2 * r, abs=LINK_S)
  assert step(read / 4).step_s == pytest.approx(2 * r + m - r / 4, abs=LINK_S)  # r/4 hidden
  assert step(read).step_s == pytest.approx(2 * r, abs=LINK_S)  # the disk never idles
  assert step(None).step_s == pytest.approx(2 * r, abs=LINK_S)


def test_a_put_returns_once_at_most_write_behind_bytes_are_left_to_write():
  program = disk_program("nvme_put", "mm", "nvme_put")
  m = step_time.timeline(program, NO_OVERHEAD).compute_s
  w = m  # each put writes for as long as the matmul takes
  write = w * NO_OVERHEAD.nvme_write

  def step(behind):
    return step_time.timeline(
      program, NO_OVERHEAD, disk={"nvme_put": (0, write)}, write_behind_bytes=behind
    ).step_s

  assert step(None) == pytest.approx(2 * w, abs=LINK_S)  # written behind the matmul
  assert step(0) == pytest.approx(2 * w + m, abs=LINK_S)  # each put waits for its write
  assert step(write / 2) == pytest.approx(2.5 * w, abs=LINK_S)  # the first put waits w / 2


def test_negative_disk_bounds_are_refused():
  with pytest.raises(ValueError, match="read_ahead_bytes must be >= 0"):
    step_time.timeline(disk_program("nvme_fetch"), HW, read_ahead_bytes=-1)


def test_a_compiled_nvme_step_charges_every_nvme_byte_within_the_stores_buffers(tmp_path):
  # The fused step of a tiny decoder with all its state on NVMe (gpu_speed's fused_nvme path):
  # the callbacks' shapes account for the plan's NVMe bytes, read once and written once, and the
  # modelled step is no shorter than the disk's time, longer the less the store reads ahead.
  gpu_compile_or_skip()
  from benchmarks import gpu_speed
  from benchmarks import llama

  cfg = llama.Config(d=64, layers=6, ffn=128, heads=4, vocab=256)
  window = 512 * 1024
  common = dict(min_size=256, window_bytes=window, host_limit=0, nvme_dir=str(tmp_path))
  tx = oo.offload(optax.adamw(1e-2), master_dtype=jnp.float32, **common)
  c = gpu_speed.compile_variant(cfg, "fused_nvme", "rtx4090_24gb", 1, 1, window, tx=tx)
  disk, runs = gpu_speed.nvme_disk_io(c.hlo)
  # 6 layers, 2 a block, one callback per NVMe leaf of the block's groups (9) a block
  assert runs["nvme_layer_fetch"] == runs["nvme_layer_put"] == 9 * 3
  e = oo.estimate(
    gpu_speed._params(cfg, "fused_nvme"),
    optimizer=optax.adamw(1e-2),
    master_dtype="fp32",
    update_in_backward=True,
    **common,
  )
  slow = dataclasses.replace(step_time.hardware("rtx4090_24gb"), nvme_read=1e7, nvme_write=1e7)

  def model(ahead):
    return step_time.timeline(c.hlo, slow, disk=disk, read_ahead_bytes=ahead)

  group = e.nvme_group_bytes
  none, one, unbounded = model(0), model(group), model(None)
  for t in (none, one, unbounded):
    assert t.disk_read_bytes == t.disk_write_bytes == e.nvme_bytes > 0
    assert t.step_s >= t.disk_s == pytest.approx(2 * e.nvme_bytes / 1e7)
  assert none.disk_wait_s >= e.nvme_bytes / 1e7  # every read waited for
  assert none.step_s >= one.step_s >= unbounded.step_s


def test_accumulating_micro_batches_touch_the_disk_once_a_step(tmp_path):
  # gpu_speed's fused_nvme with k micro-batches a step (bf16 accumulators in host memory): the
  # NVMe callbacks run in the last micro-batch only (once a step, whatever k: the program re-timed
  # with the micro-batch loop's trip count raised keeps them), they move the plan's NVMe bytes,
  # and each further micro-batch adds its compute to the modelled step.
  gpu_compile_or_skip()
  from benchmarks import gpu_speed
  from benchmarks import llama

  cfg = llama.Config(d=64, layers=6, ffn=128, heads=4, vocab=256)
  window = 512 * 1024
  common = dict(min_size=256, window_bytes=window, host_limit=0, nvme_dir=str(tmp_path))
  k = 7  # its micro-batch loop runs 5 trips, the only loop of 5 (the layer loops run 2 and 3)
  tx = oo.offload(optax.adamw(1e-2), master_dtype=jnp.float32, **common)
  c = gpu_speed.compile_variant(
    cfg, "fused_nvme", "rtx4090_24gb", 1, k, window, tx=tx, acc_dtype=jnp.bfloat16
  )
  assert c.loop_trip == k - 2
  e = oo.estimate(
    gpu_speed._params(cfg, "fused_nvme"),
    optimizer=optax.adamw(1e-2),
    master_dtype="fp32",
    update_in_backward=True,
    accumulate=k,
    accumulator_dtype="bf16",
    **common,
  )
  stack = jax.tree.leaves(gpu_speed._params(cfg, "fused_nvme")["layers"])
  assert e.accumulator_bytes == 2 * sum(x.size for x in stack)
  times = {}
  for trips in (k - 2, k + 8):
    hlo = gpu_speed.with_trip_count(c.hlo, k - 2, trips)
    disk, runs = gpu_speed.nvme_disk_io(hlo)
    # once a step, 2 layers a block, one callback per NVMe leaf of the block's groups (9) a block
    assert runs["nvme_layer_fetch"] == runs["nvme_layer_put"] == 9 * 3
    t = step_time.timeline(hlo, HW, disk=disk)
    assert t.disk_read_bytes == t.disk_write_bytes == e.nvme_bytes > 0
    times[trips] = t
  short, long = times[k - 2], times[k + 8]
  assert long.compute_s > short.compute_s and long.disk_s == pytest.approx(short.disk_s)
