"""What one execution of an HLO instruction costs: FLOPs and the bytes it moves, by memory space.

The static half of the step-time model (`step_time` decides when each instruction runs). FLOPs of
dots and convolutions come from their shapes and dimension numbers (inside fused computations and
in cuBLAS custom-calls' backend configs); elementwise ops count one FLOP per element, reductions
one per input element. Bytes are a kernel's operands and results, except that an operand a fused
computation only slices (``slice``, ``dynamic-slice``, ``gather``) counts the slice, and an
in-place ``dynamic-update-slice`` counts the update: what XLA reads and writes.

A Triton kernel (a Pallas ``pallas_call`` lowered for the GPU: ``__gpu$xla.gpu.triton``) carries
its Triton IR in the custom call's backend config; `triton_flops` reads it and counts what one
launch executes: every program of its grid runs the kernel body with its loops' trip counts
evaluated from the program ids (a causal flash-attention kernel skips the blocks above the
diagonal), ``tt.dot`` counts 2 x M x N x K, and float elementwise ops and reductions one FLOP per
element, as in a fused computation. Without the IR (or jaxlib's Triton dialect) such a kernel is
charged for its bytes only.

Length: over the ~500 lines we aim for: the Triton IR reader is what one more kind of kernel
costs, and it needs nothing else of this package.

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
import functools
import itertools
import math
import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

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
TRITON_TARGET = "__gpu$xla.gpu.triton"
"""The custom-call target of a Triton kernel (what a Pallas ``pallas_call`` lowers to on GPU)."""


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
        elif i.opcode == "custom-call" and gpu_program._custom_call_target(i) == TRITON_TARGET:
          g, o = triton_flops(i.text) or (0.0, 0.0)
          gemm, other = gemm + g, other + o
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
      elif (
        instr.opcode == "custom-call" and gpu_program._custom_call_target(instr) == TRITON_TARGET
      ):
        gemm_flops, other_flops = triton_flops(instr.text) or (0.0, 0.0)
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


# --------------------------------------------------------------------------------------------
# Triton kernels: FLOPs from the kernel's own IR.

_TT_ELEMENTWISE = frozenset(
  "arith.addf arith.subf arith.mulf arith.divf arith.remf arith.negf arith.maximumf arith.minimumf"
  " arith.maxnumf arith.minnumf arith.cmpf arith.cmpi arith.select math.exp math.exp2 math.log"
  " math.log2 math.log1p math.expm1 math.sqrt math.rsqrt math.tanh math.erf math.absf math.fma"
  " math.sin math.cos math.powf tt.extern_elementwise tt.precise_sqrt tt.precise_divf".split()
)
"""Ops counted one FLOP per element (as `_ELEMENTWISE_FLOP` in a fusion); integer index
arithmetic, casts and data movement are not counted."""
_SCALAR_INT = {
  "arith.addi": lambda a, b: a + b,
  "arith.subi": lambda a, b: a - b,
  "arith.muli": lambda a, b: a * b,
  "arith.divsi": lambda a, b: int(a / b),
  "arith.divui": lambda a, b: a // b,
  "arith.remsi": lambda a, b: a - b * int(a / b),
  "arith.remui": lambda a, b: a % b,
  "arith.ceildivsi": lambda a, b: -(-a // b),
  "arith.ceildivui": lambda a, b: -(-a // b),
  "arith.floordivsi": lambda a, b: a // b,
  "arith.maxsi": max,
  "arith.maxui": max,
  "arith.minsi": min,
  "arith.minui": min,
}
_CMPI = {
  0: lambda a, b: a == b,
  1: lambda a, b: a != b,
  2: lambda a, b: a < b,
  3: lambda a, b: a <= b,
  4: lambda a, b: a > b,
  5: lambda a, b: a >= b,
  6: lambda a, b: a < b,
  7: lambda a, b: a <= b,
  8: lambda a, b: a > b,
  9: lambda a, b: a >= b,
}
_CASTS = frozenset(
  "arith.index_cast arith.index_castui arith.extsi arith.extui arith.trunci".split()
)


def _tensor_dims(type_str: str) -> list[int] | None:
  """Dimensions of an MLIR ``tensor<...>`` type; None for a scalar."""
  if not type_str.startswith("tensor<"):
    return None
  dims = []
  for part in type_str[len("tensor<") :].split("x"):
    if not part.isdigit():
      break
    dims.append(int(part))
  return dims


def _attr_int(op, name: str) -> int | None:
  try:
    return int(str(op.attributes[name]).split(":")[0].strip())
  except (KeyError, ValueError):
    return None


@dataclasses.dataclass
class _Block:
  """A region's block, reduced to what the count needs: the FLOPs of its tensor ops (one
  execution), and in order the scalar integer ops and the control flow that decide how often
  nested blocks run. Values are numbered; `args` are the block's arguments."""

  args: list[int]
  gemm: float = 0.0
  other: float = 0.0
  steps: list[tuple] = dataclasses.field(default_factory=list)


class _TritonKernel:
  """A Triton kernel's IR reduced to `_Block`s, run over a grid with Python integers."""

  def __init__(self, ir_bytes: bytes):
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    self.ids: dict[Any, int] = {}
    with ir.Context() as ctx:
      dialect.register_dialect(ctx)
      module = ir.Module.parse(ir_bytes)
      funcs = [op for op in module.body.operations if op.operation.name == "tt.func"]
      if len(funcs) != 1:
        raise ValueError(f"expected one tt.func, found {len(funcs)}")
      self.body = self._block(funcs[0].operation.regions[0].blocks[0])

  def _id(self, value) -> int:
    return self.ids.setdefault(value, len(self.ids))

  def _block(self, block) -> _Block:
    out = _Block([self._id(a) for a in block.arguments])
    for wrapped in block.operations:
      op = wrapped.operation
      name = op.name
      ins = [self._id(v) for v in op.operands]
      outs = [self._id(v) for v in op.results]
      types = [str(r.type) for r in op.results]
      dims = _tensor_dims(types[0]) if types else None
      if name == "scf.for":
        out.steps.append(("for", ins[:3], outs, self._block(op.regions[0].blocks[0])))
      elif name == "scf.if":
        branches = [self._block(r.blocks[0]) for r in op.regions if len(r.blocks)]
        out.steps.append(("if", ins[:1], outs, branches))
      elif name == "scf.while":  # no trip count to evaluate: runs once
        for region in op.regions:
          inner = self._block(region.blocks[0])
          out.steps.append(("once", [], [], inner))
      elif name == "tt.dot" and dims is not None:
        k = _tensor_dims(str(op.operands[0].type))
        out.gemm += 2.0 * math.prod(dims) * (k[-1] if k else 0)
      elif name == "tt.reduce" and op.operands:
        src = _tensor_dims(str(op.operands[0].type))
        out.other += math.prod(src) if src else 0.0
      elif name in _TT_ELEMENTWISE and dims is not None:
        out.other += math.prod(dims)
      elif dims is None and types and types[0] in ("i1", "i32", "i64", "index"):
        if name == "arith.constant":
          value = _attr_int(op, "value")
          if value is None and "true" in str(op.attributes["value"]):
            value = 1
          out.steps.append(("const", [], outs, value or 0))
        elif name == "tt.get_program_id":
          out.steps.append(("pid", [], outs, _attr_int(op, "axis") or 0))
        elif name in _SCALAR_INT:
          out.steps.append(("int", ins, outs, _SCALAR_INT[name]))
        elif name == "arith.cmpi":
          out.steps.append(("int", ins, outs, _CMPI.get(_attr_int(op, "predicate"))))
        elif name == "arith.select":
          out.steps.append(("select", ins, outs, None))
        elif name in _CASTS:
          out.steps.append(("int", ins, outs, lambda a: a))
    return out

  def run(self, block: _Block, env: dict[int, int | None], pid: Sequence[int]) -> list[float]:
    """[matrix, other] FLOPs of one execution of `block`."""
    cost = [block.gemm, block.other]
    for kind, ins, outs, payload in block.steps:
      if kind == "const":
        env[outs[0]] = payload
      elif kind == "pid":
        env[outs[0]] = pid[payload] if payload < len(pid) else 0
      elif kind in ("int", "select"):
        args = [env.get(i) for i in ins]
        if any(a is None for a in args) or payload is None and kind == "int":
          env[outs[0]] = None
        elif kind == "select":
          env[outs[0]] = args[1] if args[0] else args[2]
        else:
          env[outs[0]] = int(payload(*args))
      elif kind == "for":
        lo, hi, step = (env.get(i) for i in ins)
        if None in (lo, hi, step) or step <= 0:
          trips = 1  # bounds the program ids do not determine: counted once
        else:
          trips = max(0, -(-(hi - lo) // step))
        iv = payload.args[0]
        if any(k in ("for", "if") for k, *_ in payload.steps) and lo is not None and step:
          for t in range(trips):  # nested control flow may depend on the induction variable
            env[iv] = lo + t * step
            inner = self.run(payload, env, pid)
            cost = [cost[0] + inner[0], cost[1] + inner[1]]
        else:
          env[iv] = None
          inner = self.run(payload, env, pid)
          cost = [cost[0] + trips * inner[0], cost[1] + trips * inner[1]]
      elif kind == "if":
        cond = env.get(ins[0])
        runs = [self.run(b, env, pid) for b in payload]
        if cond is not None and len(runs) == 2:
          chosen = runs[0] if cond else runs[1]
        else:
          chosen = max(runs, key=sum, default=[0.0, 0.0])
        cost = [cost[0] + chosen[0], cost[1] + chosen[1]]
      elif kind == "once":
        inner = self.run(payload, env, pid)
        cost = [cost[0] + inner[0], cost[1] + inner[1]]
    return cost

  def _prune(self) -> set[int]:
    """Drops the scalar ops that no loop bound or branch condition depends on; returns the
    program-id axes that remain (the only ones the FLOPs can depend on)."""
    blocks, stack = [], [self.body]
    while stack:
      block = stack.pop()
      blocks.append(block)
      for kind, _, _, payload in block.steps:
        if kind in ("for", "once"):
          stack.append(payload)
        elif kind == "if":
          stack.extend(payload)
    steps = [step for block in blocks for step in block.steps]
    needed = {i for kind, ins, _, _ in steps if kind in ("for", "if") for i in ins}
    grown = True
    while grown:
      grown = False
      for kind, ins, outs, _ in steps:
        if kind not in ("for", "if", "once") and needed.intersection(outs):
          if not needed.issuperset(ins):
            needed.update(ins)
            grown = True
    for block in blocks:
      block.steps = [
        step for step in block.steps if step[0] in ("for", "if", "once") or needed & set(step[2])
      ]
    return {payload for block in blocks for kind, _, _, payload in block.steps if kind == "pid"}

  def launch(self, grid: Sequence[int]) -> tuple[float, float]:
    """(matrix, other) FLOPs of one launch over `grid` (x, y, z program ids): the body runs for
    every combination of the program ids its loop bounds depend on, times the other axes' sizes."""
    used = sorted(a for a in self._prune() if a < len(grid))
    repeat = math.prod(n for a, n in enumerate(grid) if a not in used)
    gemm = other = 0.0
    for ids in itertools.product(*(range(grid[a]) for a in used)):
      pid = [0] * len(grid)
      for a, i in zip(used, ids):
        pid[a] = i
      g, o = self.run(self.body, {}, pid)
      gemm, other = gemm + g, other + o
    return gemm * repeat, other * repeat


def _mlir_string(text: str, start: int) -> bytes:
  r"""The bytes of the MLIR string literal whose first character is at `start` (after the quote):
  printable characters as they are, others as ``\XX`` hex escapes."""
  out = bytearray()
  k = start
  while text[k] != '"':
    if text[k] == "\\":
      if text[k + 1] in '\\"':
        out.append(ord(text[k + 1]))
        k += 2
      else:
        out.append(int(text[k + 1 : k + 3], 16))
        k += 3
    else:
      out += text[k].encode()
      k += 1
  return bytes(out)


def triton_flops(instr_text: str) -> tuple[float, float] | None:
  """(matrix, other) FLOPs of one launch of a Triton custom call, read from its IR and grid.

  Args:
    instr_text: the custom call's HLO text (its backend config holds ``grid_x``, ``grid_y``,
      ``grid_z`` and the kernel's IR as MLIR bytecode, ``ir = "..."``).

  Returns:
    The FLOPs, or None when the instruction carries no IR or jaxlib cannot read it (then the
    kernel is charged for its bytes only).

  Examples:
    >>> print(triton_flops('%k = f32[8]{0} custom-call(), custom_call_target="__gpu$xla.gpu.triton"'))
    None
  """
  grid = [re.search(rf"\bgrid_{a} = (\d+)", instr_text) for a in "xyz"]
  start = instr_text.find('ir = "')
  if start < 0 or not all(grid):
    return None
  ir_bytes = _mlir_string(instr_text, start + len('ir = "'))
  return _launch_flops(ir_bytes, tuple(int(g.group(1)) for g in grid))


@functools.lru_cache(maxsize=64)
def _launch_flops(ir_bytes: bytes, grid: tuple[int, ...]) -> tuple[float, float] | None:
  try:
    kernel = _TritonKernel(ir_bytes)
  except Exception:  # an IR this jaxlib cannot parse, or no Triton dialect: bytes only
    return None
  return kernel.launch(grid)
