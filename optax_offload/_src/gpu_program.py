"""The program XLA:GPU builds for a jitted step, compiled on a machine without a GPU.

On the CPU backend an in-jit transfer between memory kinds compiles to nothing, so a CPU run cannot
show streaming, overlap or device memory. XLA:GPU can compile for an NVIDIA target on any machine
with the CUDA PJRT plugin installed (no GPU or driver): `compile_for_gpu` lowers a step for CUDA,
keeping the memory kinds of its inputs, compiles it for a target config (an H100 SXM 80 GB, or the
same chip with 24 GiB), and returns its device and host bytes and its scheduled HLO. `Schedule`
reads that HLO: which copies between host and device memory are in flight while compute runs.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from optax_offload._src.gpu_program import compile_for_gpu
  >>> host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0], memory_kind="pinned_host")
  >>> x = jax.device_put(jnp.ones((1024, 256)), host)
  >>> program = compile_for_gpu(lambda x: jax.device_put(x, jax.memory.Space.Device) * 2, x)
  >>> program.memory.host_argument, program.memory.output
  (1048576, 1048576)
  >>> [c.direction for c in program.schedule.copies]
  ['to_device']

Length: over the ~500 lines we aim for: the compile harness and the HLO schedule reader belong
together (every test and benchmark of the GPU program uses both), and a third is docstrings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax

from optax_offload._src import _compat
from optax_offload._src import program_cache
from optax_offload._src import stream
from optax_offload._src import units

if TYPE_CHECKING:  # step_time imports this module
  from optax_offload._src import step_time

TARGETS = ("h100_80gb", "h100_24gb", "rtx4090_24gb")
"""Target configs shipped with the package (``GpuTargetConfigProto`` text): XLA's H100 SXM spec, the
same with 24 GiB, and an RTX 4090 (sm_89) derived from XLA's A6000 spec with the 4090's figures.
Each has a ``.toml`` of rates beside it for `step_time.hardware`."""

_TARGET_DIR = os.path.join(os.path.dirname(__file__), "gpu_targets")

_DTYPE_BITS = {
  "pred": 8,
  "s4": 4,
  "u4": 4,
  "s8": 8,
  "u8": 8,
  "f8e4m3fn": 8,
  "f8e5m2": 8,
  "f8e4m3b11fnuz": 8,
  "f8e4m3fnuz": 8,
  "f8e5m2fnuz": 8,
  "s16": 16,
  "u16": 16,
  "f16": 16,
  "bf16": 16,
  "s32": 32,
  "u32": 32,
  "f32": 32,
  "s64": 64,
  "u64": 64,
  "f64": 64,
  "c64": 64,
  "c128": 128,
}
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_OPCODE_RE = re.compile(r"(?:^|[\s)\]}])([a-z][a-z0-9\-]*)\(")
_CALLS_RE = re.compile(
  r"\b(?:calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_HOST_SPACE = "S(5)"

# Opcodes that are work on the device's compute stream (a while/call/conditional counts when its
# body holds some).
_COMPUTE_OPCODES = {"fusion", "custom-call", "convolution", "dot"}
_CONTROL_OPCODES = {"while", "call", "conditional"}
_NOT_COMPUTE_TARGETS = ("annotate_device_placement", "MoveToHost", "MoveToDevice", "Sharding")
_CALLBACK_TARGETS = ("callback",)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """Bytes of a compiled program, from XLA's buffer assignment (``memory_analysis()``).

  ``peak_memory_in_bytes`` of XLA's report adds pinned-host buffers to device ones; here device
  and host are apart. `device` is what the accelerator must hold: arguments + outputs - aliased
  (donated) + temporaries.
  """

  argument: int
  output: int
  alias: int
  temp: int
  host_argument: int
  host_output: int
  host_alias: int
  host_temp: int

  @property
  def device(self) -> int:
    return self.argument + self.output - self.alias + self.temp

  @property
  def host(self) -> int:
    return self.host_argument + self.host_output - self.host_alias + self.host_temp


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a scheduled HLO computation."""

  name: str
  opcode: str
  shape: str
  operands: tuple[str, ...]
  calls: tuple[str, ...]
  text: str


@dataclasses.dataclass(frozen=True)
class Copy:
  """A transfer between device and host memory, and what the device computes while it is in flight.

  Attributes:
    name: the copy-start (or synchronous copy) instruction.
    direction: ``"to_device"`` or ``"to_host"``.
    nbytes: bytes moved.
    computation: the HLO computation it is scheduled in.
    start: position of its start in that computation's schedule.
    done: position of its done (equal to `start` for a synchronous copy).
    overlapped: compute instructions scheduled between start and done.
  """

  name: str
  direction: str
  nbytes: int
  computation: str
  start: int
  done: int
  overlapped: tuple[str, ...]

  @property
  def in_flight_during_compute(self) -> bool:
    return bool(self.overlapped)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The copies, compute and callbacks of a scheduled HLO module.

  Attributes:
    computations: name -> instructions in schedule order.
    entry: the entry computation's name.
    copies: every host<->device transfer.
    callbacks: host callback custom-calls (each synchronises the GPU stream).
    host_compute: instructions that run on the host (``compute_on("device_host")``).
  """

  computations: dict[str, tuple[Instruction, ...]]
  entry: str
  copies: tuple[Copy, ...]
  callbacks: tuple[str, ...]
  host_compute: tuple[str, ...]

  def overlap(
    self,
    direction: str,
    *,
    per_execution: bool = False,
    matmul: bool = False,
    computation: str | None = None,
  ) -> tuple[int, int]:
    """(copies in flight during some compute, all copies) in one direction.

    Args:
      direction: ``"to_device"`` or ``"to_host"``.
      per_execution: count a copy in a loop body once per iteration (`executions`).
      matmul: count a copy as in flight during compute only when a matmul (`is_matmul`) runs
        while it is, not any kernel.
      computation: only the copies scheduled in this computation.
    """
    hit = total = 0
    for c in self.copies:
      if c.direction != direction or computation not in (None, c.computation):
        continue
      times = self.executions(c.computation) if per_execution else 1
      total += times
      if matmul:
        names = set(c.overlapped)
        hit += times * any(
          is_matmul(i) for i in self.computations[c.computation] if i.name in names
        )
      else:
        hit += times * c.in_flight_during_compute
    return hit, total

  def loops(self) -> dict[str, int]:
    """Loop bodies -> their known trip count (1 when XLA does not know it)."""
    out = {}
    for instrs in self.computations.values():
      for i in instrs:
        body = re.search(r"\bbody=%?([\w.\-]+)", i.text) if i.opcode == "while" else None
        if body:
          n = re.search(r'known_trip_count":\{"n":"(\d+)"', i.text)
          out[body.group(1)] = int(n.group(1)) if n else 1
    return out

  def executions(self, computation: str) -> int:
    """How often a computation runs per execution of the module: the product of the trip counts
    of the loops it is nested in (1 when no loop holds it)."""
    loops = self.loops()
    caller = {
      c: comp for comp, instrs in self.computations.items() for i in instrs for c in i.calls
    }
    times, seen = 1, set()
    while computation in caller and computation not in seen:
      seen.add(computation)
      times *= loops.get(computation, 1)
      computation = caller[computation]
    return times

  def overlap_fraction(self, direction: str) -> float:
    """The fraction of the copies in one direction in flight during some compute.

    Raises:
      ValueError: the schedule has no copies in that direction (a fraction of none would read as
        perfect overlap).
    """
    hit, total = self.overlap(direction)
    if not total:
      raise ValueError(f"no {direction} copies in this schedule: no overlap to report")
    return hit / total

  def max_bytes_in_flight(self, direction: str | None = None) -> int:
    """Most bytes of copies started and not yet done at one point of any computation."""
    best = 0
    for comp in self.computations:
      chosen = [
        c for c in self.copies if c.computation == comp and direction in (None, c.direction)
      ]
      for c in chosen:
        best = max(best, sum(o.nbytes for o in chosen if o.start <= c.start < o.done or o is c))
    return best

  def listing(self, computation: str | None = None) -> str:
    """The schedule of a computation (default: the entry) as one line per instruction that moves
    or computes data: position, opcode, name, shape and operands."""
    lines = []
    for k, i in enumerate(self.computations[computation or self.entry]):
      if i.opcode in ("parameter", "get-tuple-element", "constant", "bitcast", "tuple"):
        continue
      shape = re.sub(r"\{[^}]*\}", "", i.shape)
      lines.append(
        f"{k:4d} {i.opcode:12s} {i.name:40s} {shape[:48]:48s} {', '.join(i.operands)[:80]}"
      )
    return "\n".join(lines)

  def summary(self) -> dict[str, Any]:
    """The figures a test or benchmark reports, as plain numbers: copies and their bytes per run
    of the program (a loop body's once per iteration, `executions`)."""
    out: dict[str, Any] = {}
    for d in ("to_device", "to_host"):
      hit, total = self.overlap(d, per_execution=True)
      out[f"copies_{d}"] = total
      out[f"copies_{d}_overlapped"] = hit
      out[f"bytes_{d}"] = sum(
        c.nbytes * self.executions(c.computation) for c in self.copies if c.direction == d
      )
    out["max_bytes_in_flight"] = self.max_bytes_in_flight()
    out["callbacks"] = len(self.callbacks)
    out["host_compute"] = len(self.host_compute)
    return out


@dataclasses.dataclass(frozen=True)
class GpuProgram:
  """A step compiled for an NVIDIA target: memory, scheduled HLO and compile time."""

  target: str
  memory: DeviceMemory
  hlo: str  # the scheduled module's text, `without_source_frames` (megabytes: not in the repr)
  compile_seconds: float  # XLA's compile time (where `cached`, of the compile that was kept)
  cached: bool = False  # read from JAX's compilation cache dir (`program_cache`), not compiled

  def __repr__(self) -> str:
    return (
      f"GpuProgram(target={self.target!r}, device={units.format_bytes(self.memory.device)}, "
      f"host={units.format_bytes(self.memory.host)}, hlo={len(self.hlo):,} characters, "
      f"compile_seconds={self.compile_seconds:.1f}{', cached' if self.cached else ''})"
    )

  @functools.cached_property
  def schedule(self) -> Schedule:
    return parse_schedule(self.hlo)

  @property
  def instruction_count(self) -> int:
    """Instructions of the compiled module, in every computation (fusion bodies and loop bodies
    once each): the program's size, which XLA's scheduling time grows with."""
    return sum(len(instrs) for instrs in self.schedule.computations.values())

  def timeline(
    self, hardware: step_time.Hardware | None = None, **kwargs: Any
  ) -> step_time.Timeline:
    """The modelled step time of this program (`step_time.timeline`): a model, not a
    measurement. `hardware` defaults to the rates of this program's target with a desktop host.
    """
    from optax_offload._src import step_time

    hw = hardware if hardware is not None else step_time.hardware(self.target)
    return step_time.timeline(self, hw, **kwargs)


def target_config(target: str) -> str:
  """The ``GpuTargetConfigProto`` text of a shipped target (`TARGETS`) or of a ``.txtpb`` path."""
  path = target if target.endswith(".txtpb") else os.path.join(_TARGET_DIR, f"{target}.txtpb")
  if not os.path.exists(path):
    raise ValueError(
      f"Unknown GPU target {target!r}: use one of {TARGETS} or a path to a GpuTargetConfigProto "
      "text file (XLA ships them in xla/tools/hlo_opt/gpu_specs/)."
    )
  with open(path) as f:
    return f.read()


@functools.cache
def _topology_device(target: str):
  """The compile-only device of `target`, and the config text it was made from."""
  from jax.experimental import topologies

  config = target_config(target)
  topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
  return topo.devices[0], config


def compile_for_gpu(
  fn: Callable[..., Any],
  *args: Any,
  target: str = "h100_80gb",
  donate_argnums: int | Sequence[int] = (),
  xla_flags: dict[str, Any] | None = None,
  **kwargs: Any,
) -> GpuProgram:
  """Compiles ``fn(*args, **kwargs)`` for an NVIDIA GPU target without a GPU.

  Arguments keep their memory kinds: pass arrays or `jax.ShapeDtypeStruct`s of this machine's
  devices whose shardings say where they live (``memory_kind="pinned_host"`` for host memory),
  e.g. the state returned by ``tx.init``.

  Args:
    fn: a function, or a `jax.jit`-wrapped one (then `donate_argnums` must be set on it).
    *args: its arguments.
    target: a name in `TARGETS` or a path to a ``GpuTargetConfigProto`` text file.
    donate_argnums: as in `jax.jit`, when `fn` is not jitted yet.
    xla_flags: XLA debug options for this compile, e.g.
      ``{"xla_gpu_enable_latency_hiding_scheduler": True}``.
    **kwargs: keyword arguments of `fn`.

  Returns:
    A `GpuProgram`. Where JAX's persistent compilation cache is on (``JAX_COMPILATION_CACHE_DIR``),
    one compiled before from the same lowered module, target, options, ``XLA_FLAGS`` and versions
    is read from it (``cached``) instead (`program_cache`).

  Raises:
    RuntimeError: when the CUDA plugin is missing or jax is outside the supported range.
  """
  _compat.check_gpu_compile_support()
  device, config = _topology_device(target)
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn, donate_argnums=donate_argnums)
  with stream.traced_for("cuda"):  # the update's form for a GPU (`stream._Run.chunks`)
    traced = jitted.trace(*args, **kwargs)
  with _compat.lowering_backend(device.client):
    lowered = traced.lower(lowering_platforms=("cuda",))
  options = _compat.compile_options(list((xla_flags or {}).items()))
  cache_dir, key = program_cache.directory(), None
  if cache_dir is not None:
    module = program_cache.module_key_text(lowered.as_text(debug_info=True))
    key = program_cache.entry_key(module, config, options.SerializeAsString())
    cached = _cached_program(target, program_cache.load(cache_dir, key))
    if cached is not None:
      return cached
  t0 = time.perf_counter()
  executable = _compat.compile_for_topology(lowered, device, options)
  seconds = time.perf_counter() - t0
  stats = executable.get_compiled_memory_stats()
  memory = DeviceMemory(
    argument=stats.argument_size_in_bytes,
    output=stats.output_size_in_bytes,
    alias=stats.alias_size_in_bytes,
    temp=stats.temp_size_in_bytes,
    host_argument=stats.host_argument_size_in_bytes,
    host_output=stats.host_output_size_in_bytes,
    host_alias=stats.host_alias_size_in_bytes,
    host_temp=stats.host_temp_size_in_bytes,
  )
  hlo = without_source_frames("\n".join(m.to_string() for m in executable.hlo_modules()))
  if key is not None:
    entry = {"memory": dataclasses.asdict(memory), "hlo": hlo, "compile_seconds": seconds}
    program_cache.store(cache_dir, key, entry)
  return GpuProgram(target, memory, hlo, seconds)


def _cached_program(target: str, entry: Any) -> GpuProgram | None:
  """The program a cache entry holds, or None where it holds none (a miss)."""
  try:
    fields = [f.name for f in dataclasses.fields(DeviceMemory)]
    memory = DeviceMemory(**{name: int(entry["memory"][name]) for name in fields})
    hlo, seconds = entry["hlo"], float(entry["compile_seconds"])
  except (KeyError, TypeError, ValueError, OverflowError):  # None, or another format
    return None
  return GpuProgram(target, memory, hlo, seconds, cached=True) if isinstance(hlo, str) else None


_SOURCE_TABLES_RE = re.compile(
  r"^(?:(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:\d+ .*\n)*\n)+\n?", re.M
)  # the tables, each and a blank line, and the blank line XLA prints after the last
_STACK_FRAME_RE = re.compile(r" stack_frame_id=\d+|(?<=\{)stack_frame_id=\d+ ?")
_EMPTY_METADATA_RE = re.compile(r", metadata=\{\}")


def without_source_frames(hlo: str) -> str:
  r"""HLO text without its tables of Python source frames and the instructions' indices into them
  (``stack_frame_id``): they follow the Python call stack that lowered the step, not the
  program. An instruction whose metadata held only an index (XLA copies one onto constants and
  expanded scatters) is then printed without metadata, as when it was lowered without frames.

  Examples:
    >>> tables = 'FileNames\n1 "a.py"\n\nStackFrames\n1 {file_location_id=1}\n\n\n'
    >>> without_source_frames('HloModule m\n\n' + tables + '%x = f32[] add(%a, %b), '
    ...                       'metadata={op_name="add" stack_frame_id=1}')
    'HloModule m\n\n%x = f32[] add(%a, %b), metadata={op_name="add"}'
    >>> without_source_frames('%c = s32[] constant(9), metadata={stack_frame_id=2}')
    '%c = s32[] constant(9)'
  """
  return _EMPTY_METADATA_RE.sub("", _STACK_FRAME_RE.sub("", _SOURCE_TABLES_RE.sub("", hlo)))


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (a tuple counts all its arrays).

  Examples:
    >>> shape_bytes("f32[1024,1024]{1,0:S(5)}"), shape_bytes("(bf16[4,8], s32[])")
    (4194304, 68)
  """
  total = 0
  for dtype, dims, _ in _ARRAY_RE.findall(shape):
    if dtype in _DTYPE_BITS:
      total += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BITS[dtype] // 8
  return total


def _split_top_level(shape: str) -> list[str]:
  """The elements of a tuple shape ``(a, b, ...)``; a non-tuple shape is one element."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, current = [], 0, ""
  for ch in shape[1:-1]:
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(current.strip())
      current = ""
    else:
      current += ch
  parts.append(current.strip())
  return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTR_RE.match(line)
  if not m:
    return None
  name, rest = m.groups()
  op = _OPCODE_RE.search(rest)
  if not op:
    return None
  opcode = op.group(1)
  shape = rest[: op.start(1)].strip()
  depth, end = 0, len(rest)
  for k in range(op.end(1), len(rest)):
    depth += {"(": 1, ")": -1}.get(rest[k], 0)
    if depth == 0:
      end = k
      break
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end(1) : end]))
  calls = []
  for group in _CALLS_RE.findall(rest[end:]):
    calls.extend(c.strip(" {}%") for c in group.split(",") if c.strip(" {}"))
  return Instruction(name, opcode, shape, operands, tuple(calls), line)


def parse_computations(hlo: str) -> tuple[dict[str, tuple[Instruction, ...]], str]:
  """Computations of an HLO module text (in schedule order when it is scheduled) and the entry."""
  comps: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if header and not line.startswith(" "):
      current = header.group(2)
      comps[current] = []
      if header.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      instr = _parse_instruction(line)
      if instr is not None:
        comps[current].append(instr)
  return {k: tuple(v) for k, v in comps.items()}, entry


def is_matmul(instr: Instruction) -> bool:
  """Whether an instruction is a matrix multiply (a dot, a cuBLAS/cuDNN call or a GEMM fusion).

  Examples:
    >>> hlo = "%gemm_fusion_dot.1 = bf16[8,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%c"
    >>> is_matmul(_parse_instruction(hlo))
    True
  """
  if instr.opcode in ("dot", "convolution") or "gemm" in instr.name:
    return True
  return instr.opcode in ("custom-call", "fusion") and any(
    t in instr.text for t in ("__cublas", "__cudnn", "triton_gemm", "gemm_fusion")
  )


def _custom_call_target(instr: Instruction) -> str:
  m = re.search(r'custom_call_target="([^"]+)"', instr.text)
  return m.group(1) if m else ""


def _is_host_compute(instr: Instruction) -> bool:
  return '_xla_compute_type="host"' in instr.text or "HostExecute" in instr.text


def _arrays(shape: str) -> list[str]:
  return [m.group(0) for m in _ARRAY_RE.finditer(shape)]


def _transfer(result: str, operands: Sequence[str]) -> tuple[str, int] | None:
  """(direction, bytes) when an op with these operand shapes and result moves data between host
  and device memory (a copy, or a slice / in-place update of a host array), else None."""
  out = [a for a in _arrays(result) if "[]" not in a]
  ins = [a for shape in operands for a in _arrays(shape) if "[]" not in a]
  if not out or not ins:
    return None
  out_host = any(_HOST_SPACE in a for a in out)
  if out_host and any(_HOST_SPACE not in a for a in ins):
    return "to_host", sum(shape_bytes(a) for a in ins if _HOST_SPACE not in a)
  if not out_host and any(_HOST_SPACE in a for a in ins):
    return "to_device", sum(shape_bytes(a) for a in out)
  return None


def parse_schedule(hlo: str) -> Schedule:
  """Reads copies, compute, callbacks and host compute out of a scheduled HLO module text."""
  comps, entry = parse_computations(hlo)

  @functools.cache
  def has_compute(comp: str) -> bool:
    return any(is_compute(i) for i in comps.get(comp, ()))

  def is_compute(instr: Instruction) -> bool:
    if _is_host_compute(instr):
      return False
    if instr.opcode == "custom-call":
      target = _custom_call_target(instr)
      return not any(t in target for t in _NOT_COMPUTE_TARGETS + _CALLBACK_TARGETS)
    if instr.opcode in _COMPUTE_OPCODES:
      return True
    if instr.opcode in _CONTROL_OPCODES or instr.opcode.endswith("-start"):
      return any(has_compute(c) for c in instr.calls)
    return False

  copies, callbacks, host_compute = [], [], []
  for comp, instrs in comps.items():
    shapes = {i.name: i.shape for i in instrs}
    for k, instr in enumerate(instrs):
      if instr.opcode == "custom-call" and any(
        t in _custom_call_target(instr) for t in _CALLBACK_TARGETS
      ):
        callbacks.append(instr.name)
      if _is_host_compute(instr) and instr.opcode not in ("parameter", "get-tuple-element"):
        host_compute.append(instr.name)
      if instr.opcode.endswith("-start"):
        done_opcode = instr.opcode.removesuffix("-start") + "-done"
        done = next(
          (
            j
            for j in range(k + 1, len(instrs))
            if instrs[j].opcode == done_opcode and instr.name in instrs[j].operands
          ),
          None,
        )
        if done is None:
          continue
        between = tuple(i.name for i in instrs[k + 1 : done] if is_compute(i))
        if "host-call" in instr.name or _is_host_compute(instr):
          # A host computation reads device operands and writes device results itself: each is a
          # transfer, in flight while the call runs.
          ins = [a for o in instr.operands for a in _arrays(shapes.get(o, ""))]
          outs = _arrays(instrs[done].shape)
          for direction, arrays in (("to_host", ins), ("to_device", outs)):
            for a in arrays:
              if _HOST_SPACE not in a and "[]" not in a:
                copies.append(Copy(instr.name, direction, shape_bytes(a), comp, k, done, between))
          continue
        transfer = _transfer(instrs[done].shape, [shapes.get(o, "") for o in instr.operands])
        if transfer is None:
          continue
        direction, nbytes = transfer
        copies.append(Copy(instr.name, direction, nbytes, comp, k, done, between))
      elif instr.opcode == "copy" and instr.operands:
        transfer = _transfer(instr.shape, [shapes.get(instr.operands[0], "")])
        if transfer is not None:
          copies.append(Copy(instr.name, *transfer, comp, k, k, ()))
  return Schedule(comps, entry, tuple(copies), tuple(callbacks), tuple(host_compute))
