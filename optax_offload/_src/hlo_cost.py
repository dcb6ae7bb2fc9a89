"""What one execution of an HLO instruction costs: FLOPs and the bytes it moves, by memory space.

The static half of the step-time model (`step_time` decides when each instruction runs). FLOPs of
dots and convolutions come from their shapes and dimension numbers (inside fused computations and
in cuBLAS custom-calls' backend configs); elementwise ops count one FLOP per element, reductions
one per input element. Bytes are a kernel's operands and results, except that an operand a fused
computation only slices (``slice``, ``dynamic-slice``, ``gather``) counts the slice, and an
in-place ``dynamic-update-slice`` counts the update: what XLA reads and writes.

Examples:
  >>> module = Module('''
  ... HloModule m
  ... ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  ...   %a = bf16[64,32]{1,0} parameter(0)
  ...   %b = bf16[32,16]{1,0:S(5)} parameter(1)
  ...   ROOT %c = bf16[64,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }''')
  >>> cost = module.kernel_cost(module.entry, "c")
  >>> cost.gemm_flops == 2 * 64 * 16 * 32, cost.device_bytes, cost.host_read_bytes
  (True, 6144.0, 1024.0)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from optax_offload._src import gpu_program

NO_WORK = frozenset(
  "parameter constant get-tuple-element tuple bitcast after-all add-dependency opt-barrier"
  " partition-id replica-id domain".split()
)
"""Opcodes that launch no kernel."""

_ELEMENTWISE_FLOP = frozenset(
  "add subtract multiply divide maximum minimum negate abs exponential exponential-minus-one log"
  " log-plus-one logistic tanh sqrt rsqrt cbrt power sine cosine tan atan2 erf remainder compare"
  " select clamp floor ceil round-nearest-afz round-nearest-even sign".split()
)
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")


def _dims(shape: str) -> list[int]:
  """Dimensions of the first array of an HLO shape."""
  m = gpu_program._ARRAY_RE.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _elements(shape: str) -> int:
  return sum(
    math.prod(int(d) for d in dims.split(",") if d)
    for dtype, dims, _ in gpu_program._ARRAY_RE.findall(shape)
    if dtype in gpu_program._DTYPE_BITS
  )


def _attr_dims(text: str, name: str) -> list[int]:
  m = re.search(r"\b" + name + r"=\{([0-9,]*)\}", text)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(instr: gpu_program.Instruction, shapes: Mapping[str, str]) -> float:
  """2 x output elements x contracted size, from the dot's dimension numbers."""
  lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
  contracting = _attr_dims(instr.text, "lhs_contracting_dims")
  k = math.prod(lhs[d] for d in contracting if d < len(lhs)) if lhs else 0
  return 2.0 * _elements(instr.shape) * k


def _conv_flops(instr: gpu_program.Instruction, shapes: Mapping[str, str]) -> float:
  """2 x output elements x (kernel elements per output feature) / feature groups."""
  rhs = _dims(shapes.get(instr.operands[1], "")) if len(instr.operands) > 1 else []
  labels = re.search(r"dim_labels=[^_]*_([0-9a-z]+)->", instr.text)
  if not rhs or not labels or "o" not in labels.group(1):
    return 0.0
  per_output = math.prod(rhs) / rhs[labels.group(1).index("o")]
  groups = re.search(r"feature_group_count=(\d+)", instr.text)
  return (
    2.0
    * _elements(gpu_program._split_top_level(instr.shape)[0])
    * per_output
    / (int(groups.group(1)) if groups else 1)
  )


def _custom_gemm_flops(instr: gpu_program.Instruction, shapes: Mapping[str, str]) -> float:
  """FLOPs of a cuBLAS/cuDNN GEMM custom-call, from its backend config's dimension numbers."""
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.text)
  lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
  if not m or not lhs:
    return 0.0
  contracting = [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')]
  out = gpu_program._split_top_level(instr.shape)[0]
  return 2.0 * _elements(out) * math.prod(lhs[d] for d in contracting if d < len(lhs))


@dataclasses.dataclass(frozen=True)
class Cost:
  """Static cost of one kernel: FLOPs and bytes by memory space."""

  gemm_flops: float = 0.0
  other_flops: float = 0.0
  device_bytes: float = 0.0
  host_read_bytes: float = 0.0
  host_write_bytes: float = 0.0

  @property
  def flops(self) -> float:
    return self.gemm_flops + self.other_flops


class Module:
  """A parsed HLO module and the static costs of its instructions (each computed once)."""

  def __init__(self, hlo: str):
    self.comps, self.entry = gpu_program.parse_computations(hlo)
    self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.comps.items()}
    self.index = {c: {i.name: k for k, i in enumerate(instrs)} for c, instrs in self.comps.items()}
    self._flops: dict[str, tuple[float, float]] = {}
    self._costs: dict[tuple[str, str], Cost] = {}

  def op_name(self, comp: str, name: str) -> str:
    """The ``op_name`` metadata of an instruction (the JAX operation it came from)."""
    m = re.search(r'op_name="([^"]*)"', self.comps[comp][self.index[comp][name]].text)
    return m.group(1) if m else ""

  def flops(self, comp: str) -> tuple[float, float]:
    """(matrix, other) FLOPs of one execution of a fused computation (nested fusions too)."""
    if comp not in self._flops:
      self._flops[comp] = (0.0, 0.0)  # guards against a (malformed) cycle
      shapes = self.shapes.get(comp, {})
      gemm = other = 0.0
      for i in self.comps.get(comp, ()):
        if i.opcode == "dot":
          gemm += _dot_flops(i, shapes)
        elif i.opcode == "convolution":
          gemm += _conv_flops(i, shapes)
        elif i.opcode == "custom-call" and any(t in i.text for t in _GEMM_TARGETS):
          gemm += _custom_gemm_flops(i, shapes)
        elif i.opcode in _ELEMENTWISE_FLOP:
          other += _elements(i.shape)
        elif i.opcode in ("reduce", "reduce-window"):
          other += _elements(shapes.get(i.operands[0], "")) if i.operands else 0
        elif i.opcode == "fusion":
          for c in i.calls:
            g, o = self.flops(c)
            gemm, other = gemm + g, other + o
      self._flops[comp] = (gemm, other)
    return self._flops[comp]

  def _touched(self, comp: str, name: str, users: Mapping[str, list], seen: set) -> float | None:
    """Bytes of value `name` a fused computation reads: a slice reads the slice, an in-place
    update reads nothing of its buffer; None means all of it."""
    total = 0.0
    for user, pos in users.get(name, ()):
      if user.name in seen:
        continue
      seen.add(user.name)
      if user.opcode in _SLICING and pos == 0:
        total += gpu_program.shape_bytes(user.shape)
      elif user.opcode == "dynamic-update-slice" and pos == 0:
        continue
      elif user.opcode == "bitcast":
        sub = self._touched(comp, user.name, users, seen)
        if sub is None:
          return None
        total += sub
      else:
        return None
    return total

  def _written(self, comp: str, name: str) -> float:
    """Bytes a fused computation writes for its output value `name` (an in-place update writes
    the update)."""
    instr = self.comps[comp][self.index[comp][name]]
    while instr.opcode == "bitcast" and instr.operands:
      instr = self.comps[comp][self.index[comp][instr.operands[0]]]
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
      return gpu_program.shape_bytes(self.shapes[comp][instr.operands[1]])
    return gpu_program.shape_bytes(instr.shape)

  def kernel_cost(self, comp: str, name: str) -> Cost:
    """FLOPs and bytes of one execution of a kernel instruction."""
    if (comp, name) not in self._costs:
      self._costs[comp, name] = self._kernel_cost(comp, name)
    return self._costs[comp, name]

  def _kernel_cost(self, comp: str, name: str) -> Cost:
    instr = self.comps[comp][self.index[comp][name]]
    shapes = self.shapes[comp]
    operand_shapes = [shapes.get(o, "") for o in instr.operands]
    out_shapes = gpu_program._split_top_level(instr.shape)
    if instr.opcode.endswith("-start") and len(out_shapes) > 1:
      out_shapes = [out_shapes[1]]  # (operands, results, context): the results are written
    gemm_flops = other_flops = 0.0
    reads: list[float] = []
    writes: list[float] = [gpu_program.shape_bytes(s) for s in out_shapes]
    fused = instr.calls[0] if instr.opcode == "fusion" and instr.calls else None
    if fused in self.comps:
      gemm_flops, other_flops = self.flops(fused)
      body = self.comps[fused]
      users: dict[str, list] = {}
      for i in body:
        for pos, o in enumerate(i.operands):
          users.setdefault(o, []).append((i, pos))
      params = {}
      for i in body:
        m = re.search(r"\bparameter\((\d+)\)", i.text) if i.opcode == "parameter" else None
        if m:
          params[int(m.group(1))] = i.name
      for k, shape in enumerate(operand_shapes):
        touched = self._touched(fused, params[k], users, set()) if k in params else None
        full = gpu_program.shape_bytes(shape)
        reads.append(full if touched is None else min(touched, full))
      root = body[-1] if body else None
      for i in body:
        if i.text.lstrip().startswith("ROOT"):
          root = i
      if root is not None:
        outs = root.operands if root.opcode == "tuple" else [root.name]
        if len(outs) == len(out_shapes):
          writes = [self._written(fused, o) for o in outs]
    else:
      reads = [gpu_program.shape_bytes(s) for s in operand_shapes]
      if instr.opcode == "dot":
        gemm_flops = _dot_flops(instr, shapes)
      elif instr.opcode == "convolution":
        gemm_flops = _conv_flops(instr, shapes)
      elif instr.opcode == "custom-call" and any(t in instr.text for t in _GEMM_TARGETS):
        gemm_flops = _custom_gemm_flops(instr, shapes)
        writes = writes[:1]  # the second result is cuBLAS's workspace
      elif instr.opcode in _ELEMENTWISE_FLOP:
        other_flops = _elements(instr.shape)
      elif instr.opcode in ("reduce", "reduce-window") and operand_shapes:
        other_flops = _elements(operand_shapes[0])
      if instr.opcode in _SLICING and reads:
        reads[0] = min(reads[0], gpu_program.shape_bytes(instr.shape))
      elif instr.opcode == "dynamic-update-slice" and len(reads) > 1:
        reads[0], writes = 0.0, [reads[1]]
    host = gpu_program._HOST_SPACE
    device = host_read = host_write = 0.0
    for shape, nbytes in zip(operand_shapes, reads):
      if host in shape:
        host_read += nbytes
      else:
        device += nbytes
    for shape, nbytes in zip(out_shapes, writes):
      if host in shape:
        host_write += nbytes
      else:
        device += nbytes
    return Cost(gemm_flops, other_flops, device, host_read, host_write)
