"""Modelled training speed on a GPU, from compiled programs: tokens/s per model, card and variant.

Compiles the training step of the Llama-style decoder of `benchmarks.llama` for a GPU target
without a GPU (`oo.compile_for_gpu`) and models its time with `oo.timeline` at the card's rates
(`oo.hardware`: every rate with its source). **Every time here is a model of the compiled program,
not a measurement.** Variants (bf16 weights; AdamW with fp32 first moment for plain optax, with an
fp32 master copy for the others):

* ``plain_bf16``: plain optax on the device (``optax.adamw(mu_dtype=fp32)``), the micro-batches'
  gradients accumulated on the device in fp32, one update per step;
* ``offload_state``: ``oo.offload(adamw, master_dtype=fp32)``, gradients accumulated on the
  device as for plain optax, then ``oo.update_and_apply`` (the state streams through the window);
* ``offload_all``: the layer stack's weights and gradients in pinned host memory too
  (``oo.offloaded_scan``, ``oo.update_and_apply``); one micro-batch per step (the gradients of a
  stack in host memory are not accumulated by this path);
* ``fused_state``: ``oo.value_and_update(..., accumulate=k)``: weights on the device, the stack's
  gradients accumulated into host memory inside each backward pass and the update run inside the
  last one;
* ``fused_all``: as ``fused_state`` with the stack's weights in pinned host memory.
* ``fused_nvme``: as ``fused_all`` with the optimizer state (master copy and moments) placed by
  the one-host-budget plan (`oo.estimate(..., host_memory=--host-memory, update_in_backward=True)`):
  what the stack's weights and the NVMe tier's staging buffers leave of ``--host-memory`` holds
  state in pinned host memory, the rest is on NVMe (``offload(host_limit=..., nvme_dir=...)``),
  fetched and put by the tier's callbacks once per group of each block of layers of the last
  micro-batch's backward pass. One micro-batch per step unless ``--accumulate K`` (K
  micro-batches, the stack's gradients accumulated in host memory in ``--accumulator-dtype``, planned with them: at 48 GiB
  they do not fit beside the stack's weights, and `plan` says so), compiled at the model's full
  depth with the micro-batch loop's real trip count (the plan places whole leaves, so a shallower
  model's placement is not the same), ``--moment-dtype bf16`` (or ``int8``) for bf16 (8-bit)
  moments.

How a row is obtained (all modelled): each variant is compiled for the target at two depths of
the model's width (`--depths`, default 4 and 6 layers) with a micro-batch loop of `ACCUMULATE`
micro-batches; the time for k micro-batches re-times the same scheduled program with that loop's
trip count set to k (XLA's schedule of a loop body does not depend on its trip count), and the
time, device bytes and link bytes of the model's full depth are extrapolated linearly from the two
depths (the decoder's layers are one scanned loop body; the grouped update's groups grow linearly
with the layers). `--full-depth` compiles the real depth instead. Host and NVMe bytes are counted
from the shapes (what the plan puts there).

The disk (``fused_nvme``): XLA's program shows where the NVMe tier's callbacks run, not what they
do on the host. Each callback's disk bytes are the NVMe arrays it returns (a fetch) or hands over
(a put), read off its shapes in the HLO (their sum over the step is checked against the plan's
NVMe bytes), at the host profile's NVMe read and write rates (`hosts.toml`: a PCIe 4.0 drive). The
store reads ahead ``prefetch_depth`` store groups (from when the previous fetch returned) and
lets ``write_depth`` groups wait to be written: `oo.timeline`'s ``read_ahead_bytes`` and
``write_behind_bytes`` are those counts times the largest NVMe group, so the model lets the disk
run no further ahead than the buffers allow.

    python benchmarks/gpu_speed.py --json bench_out/gpu_speed.jsonl      # the default rows
    python benchmarks/gpu_speed.py --models 13B --targets rtx4090_24gb --variants fused_all
    python benchmarks/gpu_speed.py --models 13B --targets rtx4090_24gb --variants fused_nvme \
        --host-memory 48GiB --micro-batch 7 [--moment-dtype bf16|int8]
    python benchmarks/gpu_speed.py --models 13B --targets rtx4090_24gb --variants fused_nvme \
        --host-memory 58GiB --micro-batch 3 --accumulate 40 --accumulator-dtype bf16
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax_offload as oo  # noqa: E402
from benchmarks import llama  # noqa: E402
from benchmarks.stream_layers import streamed_loss_fn  # noqa: E402
from optax_offload._src import cli  # noqa: E402
from optax_offload._src import gpu_program  # noqa: E402
from optax_offload._src import hlo_cost  # noqa: E402
from optax_offload._src import nvme_stack  # noqa: E402
from optax_offload._src import units  # noqa: E402
from optax_offload._src.nvme_tier import callbacks as nvme_callbacks  # noqa: E402
from optax_offload._src.nvme_tier import layers as nvme_layers  # noqa: E402

VARIANTS = ("plain_bf16", "offload_state", "offload_all", "fused_state", "fused_all", "fused_nvme")
STACK_ON_HOST = ("offload_all", "fused_all", "fused_nvme")
DEFAULT_MODELS = "1B"
DEFAULT_TARGETS = "rtx4090_24gb"
DEFAULT_VARIANTS = "plain_bf16,fused_all"
"""The default run: two variants of the 1B model on the consumer card, within 10 minutes on a
2-core machine; docs/speed.md gives the commands of the full table (13B: ~3 minutes a compile)."""
ACCUMULATE = 9
"""Micro-batches of the compiled programs; other counts re-time the same program (module
docstring). Its loop's trip count (9, or 7 for the fused variants) is distinct from the layer
loops' at the compiled depths."""
SEQ = 2048
GiB = 1 << 30
MEMORY = {"h100_80gb": 84978434048, "h100_24gb": 24 * GiB, "rtx4090_24gb": 24 * GiB}
USABLE = 0.95
SLOP_FACTOR_HELP = (
  "XLA's xla_gpu_memory_limit_slop_factor (default 95): XLA:GPU schedules (and rematerializes) "
  "for 80%% of the card, less the program's device inputs and outputs, times this percentage; "
  "stack leaves kept on the device are inputs, so raise it with them (e.g. 115) or the copies "
  "stop overlapping compute"
)


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What a row needs from one compiled program."""

  hlo: str
  memory: Any  # the program's `oo.DeviceMemory` (memory_analysis: device and host apart)
  compile_s: float
  loop_trip: int | None  # the micro-batch loop's trip count in the HLO (None: no loop)
  cached: bool = False  # read from JAX's compilation cache dir (compile_s: the reading)

  @property
  def device_bytes(self) -> int:
    return self.memory.device

  @property
  def host_bytes(self) -> int:
    """XLA's pinned-host buffers."""
    return self.memory.host


def device_leaves_arg(text: str) -> tuple[str, ...]:
  """``--device-leaves wq,wo``: the names, checked against the stack's leaves."""
  names = tuple(x for x in text.split(",") if x)
  unknown = sorted(set(names) - set(llama.abstract_params(llama.CONFIGS["1B"])["layers"]))
  if unknown:
    raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a leaf of the layer stack")
  return names


def _params(cfg: llama.Config, variant: str, device_leaves: tuple[str, ...] = ()) -> dict:
  """The abstract bf16 params of `variant`; with the stack in host memory, its leaves named in
  `device_leaves` stay on the device (with a fused step, their accumulators too)."""
  on_host = variant in STACK_ON_HOST
  params = llama.abstract_params(
    cfg, jnp.bfloat16, sharding=llama.DEVICE, stack_sharding=llama.HOST if on_host else None
  )
  layers = {
    name: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=llama.DEVICE) if name in device_leaves else x
    )
    for name, x in params["layers"].items()
  }
  return dict(params, layers=layers)


def offloaded_adamw(window: int):
  """The offloaded optimizer every variant but plain_bf16 runs: AdamW, fp32 master weights."""
  return oo.offload(optax.adamw(1e-4), master_dtype=jnp.float32, window_bytes=window)


def variant_step(cfg: llama.Config, variant: str, tx, k: int, acc_dtype=jnp.float32):
  """The training step of `variant` over k micro-batches: ``step(params, state, tokens)`` with
  tokens of shape (k, micro_batch, seq + 1), returning (params, state, loss); a fused step
  accumulates in `acc_dtype`."""
  streamed = variant in ("offload_all", "fused_all", "fused_state", "fused_nvme")

  def loss(p, t):
    return streamed_loss_fn(cfg, p, t) if streamed else llama.loss_fn(cfg, p, t)

  if variant.startswith("fused"):

    def step(params, state, tokens):
      batch = tokens if k > 1 else tokens[0]  # accumulate=1 takes one micro-batch
      fused = oo.value_and_update(loss, tx, accumulate=k, accumulator_dtype=acc_dtype)
      value, params, state = fused(params, state, batch)
      return params, state, value

    return step
  if variant == "offload_all":
    if k != 1:
      raise ValueError("offload_all runs one micro-batch per step")

    def step(params, state, tokens):
      value, grads = jax.value_and_grad(loss)(params, tokens[0])
      params, state = oo.update_and_apply(tx, grads, state, params)
      return params, state, value

    return step

  def step(params, state, tokens):
    def grads_of(i):
      return jax.value_and_grad(loss)(params, tokens[i])

    if k == 1:
      value, grads = grads_of(0)
    else:

      def body(i, carry):
        total, acc = carry
        value, g = grads_of(i)
        return total + value, jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
      total, acc = jax.lax.fori_loop(0, k, body, (jnp.zeros((), jnp.float32), zeros))
      value = total / k
      grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    if variant == "plain_bf16":
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    else:
      params, state = oo.update_and_apply(tx, grads, state, params)
    return params, state, value

  return step


def compile_variant(
  cfg,
  variant: str,
  target: str,
  micro_batch: int,
  k: int,
  window: int,
  tx=None,
  acc_dtype=jnp.float32,
  device_leaves: tuple[str, ...] = (),
  slop_factor: int | None = None,
  stack_on_nvme: bool = False,
):
  """The training step of `variant` for k micro-batches of `micro_batch` sequences, compiled
  (`tx`: the offloaded optimizer, default `offloaded_adamw`; `acc_dtype`: a fused step's
  accumulators; `device_leaves`: stack leaves kept on the device, `_params`; `slop_factor`:
  XLA's ``xla_gpu_memory_limit_slop_factor``, `SLOP_FACTOR_HELP`; `stack_on_nvme`: the stack's
  leaves in host memory on NVMe instead, `oo.NvmeStackLeaf` stand-ins: nothing is read while
  compiling)."""
  tokens = jax.ShapeDtypeStruct((k, micro_batch, SEQ + 1), jnp.int32, sharding=llama.DEVICE)
  params = _params(cfg, variant, device_leaves)
  if stack_on_nvme:
    gen = jax.ShapeDtypeStruct((), jnp.int32, sharding=llama.DEVICE)
    params["layers"] = {
      name: nvme_stack.NvmeStackLeaf(gen, "/compile-only", f"['{name}']", x.shape, x.dtype)
      if name not in device_leaves
      else x
      for name, x in params["layers"].items()
    }
  options = oo.STREAM_XLA_OPTIONS if variant != "plain_bf16" else None
  if slop_factor is not None:
    options = {**(options or {}), "xla_gpu_memory_limit_slop_factor": slop_factor}
  if tx is not None:
    state = oo.abstract_state(tx, params)
  elif variant == "plain_bf16":
    tx = optax.adamw(1e-4, mu_dtype=jnp.float32)
    state = jax.eval_shape(tx.init, params)
  else:
    tx = offloaded_adamw(window)
    state = oo.abstract_state(tx, params)
  step = variant_step(cfg, variant, tx, k, acc_dtype)
  # The micro-batch loop whose trip count `rows_for` rewrites (None: no such loop).
  if variant.startswith("fused"):
    trip = k - 2 if k > 2 else None
  elif variant == "offload_all":
    trip = None
  else:
    trip = k if k > 1 else None

  t0 = time.perf_counter()
  program = oo.compile_for_gpu(
    step, params, state, tokens, donate_argnums=(0, 1), target=target, xla_flags=options
  )
  return Compiled(program.hlo, program.memory, time.perf_counter() - t0, trip, program.cached)


def with_trip_count(hlo: str, old: int, new: int) -> str:
  """The HLO with the micro-batch loop's known trip count `old` set to `new` (one loop only)."""
  pattern = f'"known_trip_count":{{"n":"{old}"}}'
  if hlo.count(pattern) != 1:
    raise ValueError(f"expected one loop with trip count {old}, found {hlo.count(pattern)}")
  return hlo.replace(pattern, f'"known_trip_count":{{"n":"{new}"}}')


def _host_bytes(cfg, variant: str, k: int) -> int:
  """Pinned host bytes from the shapes: the offloaded state (fp32 master and moments, 12 B per
  param: every leaf of the decoder is above `min_size`), plus the stack's bf16 weights (and, for
  `offload_all`, its gradients) when they live in host memory, plus the stack's fp32
  accumulators while a fused step accumulates several micro-batches."""
  if variant == "plain_bf16":
    return 0
  stack = cfg.layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d)
  total = 12 * cfg.params
  if variant == "offload_all":
    total += 4 * stack
  if variant == "fused_all":
    total += 2 * stack
  if variant.startswith("fused") and k > 1:
    total += 4 * stack
  return total


def _per_layer_device_bytes(cfg, variant: str, micro_batch: int, k: int) -> int:
  """A lower bound of the device bytes each layer adds: its saved input (bf16, the backward's
  residual under full remat), and for a stack on the device its bf16 weights, plus the bf16
  gradients and their fp32 accumulator where the gradients exist whole on the device."""
  layer = 4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d
  total = micro_batch * SEQ * cfg.d * 2
  if variant in ("plain_bf16", "offload_state", "fused_state"):
    total += 2 * layer
  if variant in ("plain_bf16", "offload_state"):
    total += 2 * layer + (4 * layer if k > 1 else 0)
  if variant == "plain_bf16":
    total += 6 * layer  # fp32 mu, bf16 nu
  return total


NVME_SCOPES = {
  nvme_layers.FETCH_SCOPE: "read",
  nvme_callbacks.FETCH_SCOPE: "read",
  nvme_stack.FETCH_SCOPE: "read",
  nvme_layers.PUT_SCOPE: "write",
  nvme_callbacks.PUT_SCOPE: "write",
  nvme_stack.PUT_SCOPE: "write",
}
"""The `jax.named_scope`s of the NVMe callbacks (the tier's, nvme_tier/layers.py, callbacks.py,
and a layer stack's on NVMe, nvme_stack.py): a fetch's results are the NVMe arrays it read, a
put's operands those it writes."""


def nvme_tx(
  cfg, target: str, args, window: int, options=None, accumulate: int = 1, accumulator_dtype="fp32"
):
  """(`nvme_plan`, the offloaded AdamW it places: fp32 master, the state beyond the plan's host
  bytes in ``args.nvme_dir``)."""
  e = nvme_plan(cfg, target, args, window, accumulate, accumulator_dtype)
  moments = {} if args.moment_dtype == "fp32" else {"moment_dtype": args.moment_dtype}
  tx = oo.offload(
    optax.adamw(1e-4),
    master_dtype=jnp.float32,
    window_bytes=window,
    host_limit=e.host_bytes,
    nvme_dir=args.nvme_dir,
    nvme_options=options,
    **moments,
  )
  return e, tx


def compile_nvme(cfg, target: str, args, window: int, options, k: int):
  """(`nvme_plan`, the compiled `fused_nvme` step of k micro-batches that it places: the stack's
  weights on NVMe where the plan puts them there), with the row's ``--accumulator-dtype``,
  ``--device-leaves`` and ``--xla-slop-factor``."""
  e, tx = nvme_tx(cfg, target, args, window, options, k, args.accumulator_dtype)
  c = compile_variant(
    cfg,
    "fused_nvme",
    target,
    args.micro_batch,
    k,
    window,
    tx=tx,
    acc_dtype=units.parse_accumulator_dtype(args.accumulator_dtype),
    device_leaves=args.device_leaves,
    slop_factor=args.xla_slop_factor,
    stack_on_nvme=e.weights_on == "nvme",
  )
  return e, c


def nvme_plan(
  cfg, target: str, args, window: int, accumulate: int = 1, accumulator_dtype="fp32"
) -> oo.Estimate:
  """The one-host-budget plan of the model (its shapes) for `--host-memory` on `target`, with
  `accumulate` micro-batches a step (accumulators in `accumulator_dtype`)."""
  if args.host_memory is None:
    raise ValueError("fused_nvme needs --host-memory (e.g. 48GiB): the plan places the state by it")
  return oo.estimate(
    _params(cfg, "fused_nvme", getattr(args, "device_leaves", ())),
    optimizer=optax.adamw(1e-4),
    master_dtype="fp32",
    moment_dtype=None if args.moment_dtype == "fp32" else args.moment_dtype,
    device_memory=MEMORY[target],
    window_bytes=window,
    host_memory=args.host_memory,
    nvme_dir=args.nvme_dir,
    update_in_backward=True,
    accumulate=accumulate,
    accumulator_dtype=accumulator_dtype,
    nvme_options=cli.nvme_options_of(args),
    weights_on=getattr(args, "weights_on", "device"),
  )


def nvme_disk_io(hlo: str) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
  """Disk bytes per execution of each NVMe callback, read off its shapes (the NVMe arrays a fetch
  returns or a put takes; not the int32 token and row index), keyed for `oo.timeline`'s ``disk``
  by the instruction's name and a space (a key matches ``"<name> <op_name>"``: this one
  instruction); and how often each scope's callbacks run per step."""
  module = hlo_cost.Module(hlo)
  schedule = gpu_program.parse_schedule(hlo)
  disk: dict[str, tuple[float, float]] = {}
  runs: dict[str, int] = {}
  for comp, instrs in schedule.computations.items():
    for instr in instrs:
      scope = (
        [k for k in NVME_SCOPES if k in instr.text] if instr.name in schedule.callbacks else []
      )
      if not scope:
        continue
      if len(scope) > 1:
        raise ValueError(
          f"callback {instr.name} carries the scopes {scope}: a disk callback must carry one of "
          f"{sorted(NVME_SCOPES)} (nvme_tier/layers.py, callbacks.py), to be read or written"
        )
      (scope,) = scope
      if NVME_SCOPES[scope] == "read":
        arrays = gpu_program._arrays(instr.shape)
      else:
        arrays = [a for o in instr.operands for a in gpu_program._arrays(module.shapes[comp][o])]
      nbytes = sum(gpu_program.shape_bytes(a) for a in arrays if not a.startswith("s32"))
      disk[instr.name + " "] = (nbytes, 0) if NVME_SCOPES[scope] == "read" else (0, nbytes)
      runs[scope] = runs.get(scope, 0) + schedule.executions(comp)
  return disk, runs


def rows_for_nvme(name: str, target: str, args) -> list[dict]:
  """The `fused_nvme` rows, one per ``--accumulate`` value (default 1)."""
  ks = args.accumulate or (1,)
  return [row for k in ks for row in _nvme_rows(name, target, args, k)]


def _nvme_rows(name: str, target: str, args, k: int) -> list[dict]:
  """The `fused_nvme` row of k micro-batches a step: the full-depth program with the plan's NVMe
  placement (and with k > 1 its accumulators in host memory), its disk charged by the timeline
  within the store's read-ahead and write-behind buffers. The micro-batch loop runs its real trip
  count (k - 2: the first and last micro-batches are outside it)."""
  cfg = dataclasses.replace(llama.CONFIGS[name], attention=args.attention, remat=args.remat)
  hw = oo.hardware(target, args.host)
  window = int(args.window_fraction * MEMORY[target])
  nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="gpu_speed_nvme_")
  if not args.nvme_dir:
    atexit.register(shutil.rmtree, nvme_dir, ignore_errors=True)
  args = argparse.Namespace(**{**vars(args), "nvme_dir": nvme_dir})
  options = cli.nvme_options_of(args)
  e, c = compile_nvme(cfg, target, args, window, options, k)
  disk, runs = nvme_disk_io(c.hlo)
  group = e.nvme_group_bytes
  read_ahead, write_behind = options.prefetch_depth * group, options.write_depth * group
  if args.disk_unbounded:  # a what-if: the disk reads everything ahead, writes everything behind
    read_ahead = write_behind = None
  t = oo.timeline(
    c.hlo, hw, disk=disk, read_ahead_bytes=read_ahead, write_behind_bytes=write_behind
  )
  # The callbacks' shapes account for every NVMe byte of the plan: the state read once and
  # written once; a stack's weights on NVMe written once and read a layer per read callback (the
  # layer read again where a pass turns is counted too, though the store serves it from memory).
  layer = e.nvme_weight_bytes // cfg.layers
  stack_reads = runs.get(nvme_stack.FETCH_SCOPE, 0) * layer
  for moved, want in (
    (t.disk_read_bytes, e.nvme_bytes + stack_reads),
    (t.disk_write_bytes, e.nvme_bytes + e.nvme_weight_bytes),
  ):
    if abs(moved - want) > 1e-6 * want:
      raise AssertionError(f"the callbacks move {moved:.0f} bytes, the plan {want} on NVMe")
  # Host bytes: the plan's (stack weights, state, the tier's buffers for these depths).
  host = e.host_total_bytes
  schedule = gpu_program.parse_schedule(c.hlo)
  tokens = args.micro_batch * SEQ * k
  fits = c.device_bytes <= USABLE * MEMORY[target] and host <= args.host_memory
  row = {
    "model": name,
    "params": cfg.params,
    "target": target,
    "host": args.host,
    "variant": "fused_nvme",
    "moment_dtype": args.moment_dtype,
    "tokens_per_step": tokens,
    "micro_batch": args.micro_batch * SEQ,
    "accumulation": k,
    "accumulator_dtype": args.accumulator_dtype if k > 1 else None,
    "accumulator_bytes": e.accumulator_bytes,
    "device_leaves": list(args.device_leaves),
    "xla_slop_factor": args.xla_slop_factor,
    "fits": bool(fits),
    "device_bytes": c.device_bytes,
    "host_bytes": host,
    "xla_host_bytes": c.host_bytes,
    "host_memory": args.host_memory,
    "host_limit": e.host_bytes,
    "nvme_bytes": e.nvme_bytes,
    "weights_on": e.weights_on,
    "nvme_weight_bytes": e.nvme_weight_bytes,
    "step_s": t.step_s,
    "compute_s": t.compute_s,
    "disk_s": t.disk_s,
    "disk_wait_s": t.disk_wait_s,
    "disk_read_Bps": hw.nvme_read,
    "disk_write_Bps": hw.nvme_write,
    "prefetch_depth": options.prefetch_depth,
    "write_depth": options.write_depth,
    "read_ahead_bytes": read_ahead,
    "write_behind_bytes": write_behind,
    "callbacks_per_step": t.callbacks,
    "nvme_callbacks_per_step": runs,
    "copies_overlapped": {
      d: schedule.overlap(d, per_execution=True, matmul=True) for d in ("to_device", "to_host")
    },
    "link_bytes": t.bytes_to_device + t.bytes_to_host,
    "link_Bps": hw.h2d_bandwidth,
    "peak_flops": hw.tensor_flops,
    "tokens_per_s": tokens / t.step_s,
    "model_tflops": 6 * cfg.params * tokens / t.step_s / 1e12,
    "mfu": 6 * cfg.params * tokens / t.step_s / hw.tensor_flops,
    "step_over_compute": t.step_s / t.compute_s,
    "bottleneck": t.bottleneck,
    "compile_s": c.compile_s,
    "cached": c.cached,
    "depths": [cfg.layers],
    "modelled": True,
  }
  assert t.step_s >= t.compute_s * (1 - 1e-9) and row["mfu"] <= 1.0, row
  _print_nvme_row(row)
  return [row]


def _print_nvme_row(row) -> None:
  print(
    f"{row['model']:>4} {row['target']:13s} fused_nvme({row['moment_dtype']})"
    f" tokens/step {row['tokens_per_step']:>7d} step {row['step_s']:8.2f}s"
    f" compute {row['compute_s']:8.2f}s disk {row['disk_s']:7.2f}s"
    f" (waited {row['disk_wait_s']:.2f}s) {row['model_tflops']:6.1f} TFLOPS"
    f" {row['tokens_per_s']:8.0f} tok/s device {row['device_bytes'] / GiB:6.1f} GiB host"
    f" {row['host_bytes'] / GiB:6.2f} GiB nvme"
    f" {(row['nvme_bytes'] + row.get('nvme_weight_bytes', 0)) / GiB:6.2f} GiB"
    f" (weights on {row.get('weights_on', 'host')})"
    f" fits {row['fits']!s:5s} [{row['bottleneck']}] compile {row['compile_s']:.0f}s",
    flush=True,
  )


DEFAULT_ACCUMULATE = (8, 64)
"""Micro-batches per step of every variant but ``fused_nvme`` (1) and ``offload_all`` (1)."""


def rows_for(name: str, variant: str, target: str, args) -> list[dict]:
  if variant == "fused_nvme":
    return rows_for_nvme(name, target, args)
  cfg = dataclasses.replace(llama.CONFIGS[name], attention=args.attention, remat=args.remat)
  hw = oo.hardware(target, args.host)
  window = int(args.window_fraction * MEMORY[target])
  ks = [1] if variant == "offload_all" else list(args.accumulate or DEFAULT_ACCUMULATE)
  depths = [cfg.layers] if args.full_depth else [int(d) for d in args.depths.split(",")]
  k_compiled = 1 if ks == [1] else ACCUMULATE
  per_depth = []
  compile_s = 0.0
  for depth in depths:
    c = compile_variant(
      cfg.with_layers(depth), variant, target, args.micro_batch, k_compiled, window
    )
    compile_s += c.compile_s
    times = {}
    for k in ks:
      if c.loop_trip is None:
        hlo = c.hlo
      else:
        trip_k = k - 2 if variant.startswith("fused") else k
        if trip_k < 1:
          hlo = None  # compiled apart below
        else:
          hlo = with_trip_count(c.hlo, c.loop_trip, trip_k)
      if hlo is None:
        c1 = compile_variant(cfg.with_layers(depth), variant, target, args.micro_batch, k, window)
        compile_s += c1.compile_s
        hlo = c1.hlo
      times[k] = oo.timeline(hlo, hw)
    per_depth.append((depth, c.device_bytes, times))

  def extrapolate(values):
    if len(values) == 1:
      return values[0][1]
    (d1, v1), (d2, v2) = values[0], values[-1]
    return v1 + (cfg.layers - d1) * (v2 - v1) / (d2 - d1)

  rows = []
  micro_tokens = args.micro_batch * SEQ
  for k in ks:
    compute_s = extrapolate([(d, t[k].compute_s) for d, _, t in per_depth])
    # The time the step spends past its compute (copies it waits for) is not linear in depth: at
    # shallow depths the first fetch and last write of each loop are a large part of it, and more
    # layers hide more of them. It is extrapolated linearly where it grows with depth (the link
    # bound per layer) and held at the deepest compiled depth's where it shrinks (conservative:
    # never less than what a compiled program showed), and the step is at least each link's busy
    # time.
    exposed = [(d, t[k].step_s - t[k].compute_s) for d, _, t in per_depth]
    exposed_s = max(exposed[-1][1], extrapolate(exposed))
    link_busy = max(
      extrapolate([(d, getattr(t[k], f"link_to_{w}_s")) for d, _, t in per_depth])
      for w in ("device", "host")
    )
    step_s = max(compute_s + exposed_s, link_busy)
    link = extrapolate([(d, t[k].bytes_to_device + t[k].bytes_to_host) for d, _, t in per_depth])
    device = per_depth[-1][1]
    if len(per_depth) > 1:  # the measured growth, at least what each layer must add
      (d1, b1, _), (d2, b2, _) = per_depth[0], per_depth[-1]
      floor = _per_layer_device_bytes(cfg, variant, args.micro_batch, k)
      device = int(b2 + (cfg.layers - d2) * max((b2 - b1) / (d2 - d1), floor))
    host = _host_bytes(cfg, variant, k)
    tokens = micro_tokens * k
    fits = device <= USABLE * MEMORY[target]
    if args.host_memory is not None:
      fits = fits and host <= args.host_memory
    row = {
      "model": name,
      "params": cfg.params,
      "target": target,
      "host": args.host,
      "variant": variant,
      "tokens_per_step": tokens,
      "micro_batch": micro_tokens,
      "accumulation": k,
      "fits": bool(fits),
      "device_bytes": device,
      "host_bytes": host,
      "nvme_bytes": 0,
      "step_s": step_s,
      "compute_s": compute_s,
      "link_bytes": link,
      "link_Bps": hw.h2d_bandwidth,
      "peak_flops": hw.tensor_flops,
      "tokens_per_s": tokens / step_s,
      "model_tflops": 6 * cfg.params * tokens / step_s / 1e12,
      "mfu": 6 * cfg.params * tokens / step_s / hw.tensor_flops,
      "step_over_compute": step_s / compute_s,
      "bottleneck": per_depth[-1][2][k].bottleneck,
      "compile_s": compile_s,
      "depths": depths,
      "modelled": True,
    }
    # Honesty: no step faster than its compute or than the peak (the model also floors the step
    # at each link's busy time).
    assert step_s >= compute_s * (1 - 1e-9), row
    assert row["mfu"] <= 1.0, row
    rows.append(row)
    print(
      f"{name:>4} {target:13s} {variant:14s} tokens/step {tokens:>7d} (k={k:3d})"
      f" step {step_s:8.2f}s compute {compute_s:8.2f}s  {row['model_tflops']:6.1f} TFLOPS"
      f" {row['tokens_per_s']:8.0f} tok/s device {device / GiB:6.1f} GiB fits {fits!s:5s}"
      f" [{row['bottleneck']}]",
      flush=True,
    )
  return rows


def micro_batch_counts(text: str) -> tuple[int, ...]:
  """``--accumulate``'s value: micro-batch counts, e.g. ``"8,64"`` -> ``(8, 64)``, each >= 1."""
  try:
    ks = sorted({int(k) for k in text.split(",")})
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"{text!r}: give counts separated by commas, e.g. 8,64"
    ) from None
  if ks[0] < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: every micro-batch count must be >= 1")
  return tuple(ks)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(llama.CONFIGS)}")
  parser.add_argument("--targets", default=DEFAULT_TARGETS)
  parser.add_argument(
    "--variants",
    default=None,
    help=f"of {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS}, and fused_nvme with --host-memory)",
  )
  parser.add_argument("--host", default="desktop", help="host profile: desktop or server")
  parser.add_argument(
    "--host-memory", default=None, help="pinned host memory available, e.g. 48GiB"
  )
  parser.add_argument(
    "--micro-batch", type=int, default=4, help="sequences of 2048 per micro-batch"
  )
  parser.add_argument(
    "--accumulate",
    default=None,
    type=micro_batch_counts,
    help="micro-batches per step, e.g. 8,64 (default 8,64; fused_nvme: 1)",
  )
  parser.add_argument(
    "--accumulator-dtype",
    default=None,
    choices=("fp32", "bf16"),
    help="fused_nvme with --accumulate above 1: the stack's accumulators in host memory (fp32)",
  )
  parser.add_argument(
    "--device-leaves",
    default=(),
    type=device_leaves_arg,
    help="fused_nvme: stack leaves kept on the device with their accumulators, e.g. wq,wo",
  )
  parser.add_argument(
    "--xla-slop-factor", type=int, default=None, help=f"fused_nvme: {SLOP_FACTOR_HELP}"
  )
  parser.add_argument("--depths", default="4,6", help="compiled depths (layers), extrapolated")
  parser.add_argument("--full-depth", action="store_true", help="compile the model's real depth")
  parser.add_argument("--window-fraction", type=float, default=0.1, help="offload window / card")
  parser.add_argument("--attention", default="flash", choices=llama.ATTENTION)
  parser.add_argument(
    "--remat", default="full", choices=llama.REMAT, help="plain and offload_state"
  )
  parser.add_argument(
    "--moment-dtype", default="fp32", choices=("fp32", "bf16", "int8"), help="fused_nvme's moments"
  )
  parser.add_argument("--nvme-dir", default=None, help="fused_nvme: NVMe tier directory (temp)")
  parser.add_argument(
    "--weights-on",
    default="host",
    choices=("host", "nvme"),
    help="fused_nvme: the stack's bf16 weights in pinned host memory, or on NVMe (trained there)",
  )
  parser.add_argument("--prefetch-depth", type=int, default=1, help="fused_nvme: NvmeOptions")
  parser.add_argument("--write-depth", type=int, default=1, help="fused_nvme: NvmeOptions")
  parser.add_argument(
    "--disk-unbounded",
    action="store_true",
    help="fused_nvme what-if: no bound on the disk's read-ahead and write-behind (no store has it)",
  )
  parser.add_argument("--json", default=None, help="write one JSON object per row here")
  args = parser.parse_args(argv)
  args.host_memory = oo.parse_bytes(args.host_memory, "--host-memory")
  if args.variants is None:
    args.variants = DEFAULT_VARIANTS + (",fused_nvme" if args.host_memory is not None else "")
  for v in args.variants.split(","):
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
  if args.accumulator_dtype is not None and args.variants != "fused_nvme":
    parser.error(
      "--accumulator-dtype applies to the fused_nvme rows only (the other variants accumulate in "
      "fp32, as their host bytes count): give --variants fused_nvme with it"
    )
  args.accumulator_dtype = args.accumulator_dtype or "fp32"
  if (args.device_leaves or args.xla_slop_factor) and args.variants != "fused_nvme":
    parser.error(
      "--device-leaves and --xla-slop-factor apply to the fused_nvme rows only: give "
      "--variants fused_nvme"
    )
  rows = []
  t0 = time.perf_counter()
  for target in args.targets.split(","):
    for name in args.models.split(","):
      for variant in args.variants.split(","):
        rows.extend(rows_for(name, variant, target, args))
  print(
    f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s (every time a model, not a measurement)"
  )
  if args.json:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  return rows


if __name__ == "__main__":
  main()
