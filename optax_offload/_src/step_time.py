"""A step-time model of a compiled GPU program: the yardstick for speed claims without a GPU.

`timeline` walks the scheduled HLO that XLA:GPU built for a step (`gpu_program.compile_for_gpu`) in
schedule order and charges every operation to the resource that runs it, at rates read from
documented measurements (`hardware`):

* the compute stream runs kernels one after another: a kernel with matrix multiplies takes
  ``gemm_flops / (gemm_efficiency x tensor_flops)``, any kernel at least
  ``bytes / (memory_efficiency x memory_bandwidth)`` and ``other_flops / vector_flops``, each
  plus a launch cost; bytes are what the kernel reads and writes (a slice of an operand counts
  the slice, an in-place update the update);
* a kernel that reads or writes host memory (``S(5)`` in its layout) moves those bytes over the
  link, whose engines are shared with the copies;
* host<->device copies (``copy-start``/``copy-done``, the dynamic-slice and
  dynamic-update-slice starts between memory spaces) run on one engine queue per direction at
  the link's rate, from where XLA starts them (or when the engine is free); the compute stream
  blocks at the done until the copy has finished;
* host computations (``_xla_compute_type="host"``, ``HostExecute``) take their bytes at host
  DRAM bandwidth on one host queue, their device operands and results cross the link, and the
  stream waits for them where their results are needed;
* a host callback synchronises the stream: its device operands go to the host, it costs a fixed
  overhead (plus disk time when the caller says what it reads and writes), its results come back.

While loops run their known trip count (``known_trip_count`` in the backend config; nested loops
multiply), iteration by iteration, so that a copy started in one iteration and waited in the next
is modelled; a conditional costs its costliest branch. Every figure it returns is a model of the
program on the hardware, not a measurement. What an instruction costs (FLOPs, bytes by memory
space) is `hlo_cost`'s; docs/speed.md lists the assumptions and the rates' sources.

Length: over the ~500 lines we aim for: the rates, the timeline and the simulation that fills it
are one model, and a third is docstrings.

Examples:
  >>> hlo = '''
  ... HloModule m, is_scheduled=true
  ... ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096]) -> bf16[4096,4096] {
  ...   %a = bf16[4096,4096]{1,0} parameter(0)
  ...   %b = bf16[4096,4096]{1,0} parameter(1)
  ...   ROOT %c = bf16[4096,4096]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }
  ... '''
  >>> hw = hardware("h100_80gb")
  >>> t = timeline(hlo, hw)
  >>> t.flops == 2 * 4096**3, t.bottleneck
  (True, 'gemm')
  >>> t.step_s == t.flops / (hw.gemm_efficiency * hw.tensor_flops) + hw.launch_s
  True
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import functools
import os
import re
import tomllib
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from optax_offload._src import gpu_program
from optax_offload._src import hlo_cost

_DATA_DIR = os.path.join(os.path.dirname(__file__), "gpu_targets")
_HOSTS_FILE = os.path.join(_DATA_DIR, "hosts.toml")
_GPU_RATES = (
  "tensor_flops",
  "gemm_efficiency",
  "vector_flops",
  "memory_bandwidth",
  "memory_efficiency",
  "launch_s",
  "h2d_bandwidth",
  "d2h_bandwidth",
)
_HOST_RATES = ("host_bandwidth", "nvme_read", "nvme_write", "callback_s")
TO_DEVICE, TO_HOST = "to_device", "to_host"


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Rates of a GPU and its host, in SI units (FLOP/s, B/s, s), each from a cited source.

  Attributes:
    name: what the rates describe.
    tensor_flops: peak dense BF16 tensor-core FLOP/s (FP32 accumulate).
    gemm_efficiency: fraction of `tensor_flops` large BF16 GEMMs achieve (measured).
    vector_flops: peak FP32 non-tensor FLOP/s, for kernels without matrix multiplies.
    memory_bandwidth: device memory bandwidth (B/s).
    memory_efficiency: fraction of `memory_bandwidth` a streaming kernel achieves.
    launch_s: cost of launching one kernel (s).
    h2d_bandwidth: host-to-device link rate of pinned memory (B/s).
    d2h_bandwidth: device-to-host link rate (B/s).
    host_bandwidth: host DRAM bandwidth for host-side computations (B/s).
    nvme_read: NVMe read rate (B/s).
    nvme_write: NVMe write rate (B/s).
    callback_s: fixed cost of one host callback (s).
    sources: (rate, source) pairs: where each number comes from.
  """

  name: str
  tensor_flops: float
  gemm_efficiency: float
  vector_flops: float
  memory_bandwidth: float
  memory_efficiency: float
  launch_s: float
  h2d_bandwidth: float
  d2h_bandwidth: float
  host_bandwidth: float
  nvme_read: float
  nvme_write: float
  callback_s: float
  sources: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False, compare=False)

  def link(self, direction: str) -> float:
    """The link rate in `direction` (``"to_device"`` or ``"to_host"``)."""
    return self.h2d_bandwidth if direction == TO_DEVICE else self.d2h_bandwidth

  def source(self, rate: str) -> str:
    """Where `rate` comes from."""
    return dict(self.sources).get(rate, "")


HOSTS = ("desktop", "server")
"""Host profiles shipped in ``gpu_targets/hosts.toml``."""


def _read_toml(path: str) -> dict[str, Any]:
  with open(path, "rb") as f:
    return tomllib.load(f)


def _rates(table: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, tuple]:
  out = {}
  for name in names:
    entry = table.get(name)
    if not isinstance(entry, Mapping) or "value" not in entry or not entry.get("source"):
      raise ValueError(f"{where}: rate {name!r} needs a value and a source")
    source = entry["source"] + (f" ({entry['url']})" if entry.get("url") else "")
    out[name] = (float(entry["value"]), source)
  return out


def _gpu_table(target: str) -> dict[str, Any]:
  if target.endswith((".toml", ".txtpb")):
    path = os.path.splitext(target)[0] + ".toml"
  else:
    path = os.path.join(_DATA_DIR, f"{target}.toml")
  if not os.path.exists(path):
    raise ValueError(
      f"No rates for GPU target {target!r}: use one of {gpu_program.TARGETS} or a target whose "
      "GpuTargetConfigProto has a .toml of rates next to it."
    )
  table = _read_toml(path)
  if "inherit" in table:
    base = _gpu_table(os.path.join(os.path.dirname(path), table["inherit"] + ".toml"))
    table = {**base, **{k: v for k, v in table.items() if k != "inherit"}}
  return table


@functools.cache
def hardware(target: str = "h100_80gb", host: str = "desktop") -> Hardware:
  """The rates of a GPU target and a host profile, read from the files shipped with the package.

  Args:
    target: a GPU target of `gpu_program.TARGETS` (its rates are ``gpu_targets/<target>.toml``,
      next to its ``GpuTargetConfigProto``) or a path to such a ``.toml`` (or to a ``.txtpb``
      with a ``.toml`` beside it).
    host: a profile of ``gpu_targets/hosts.toml`` (`HOSTS`): host DRAM, NVMe and callbacks.

  Returns:
    A `Hardware`; change a rate with `dataclasses.replace`.

  Raises:
    ValueError: for an unknown target or host, or a rate without a value or a source.

  Examples:
    >>> hw = hardware("rtx4090_24gb", host="desktop")
    >>> hw.tensor_flops / 1e12, hw.memory_bandwidth / 1e9
    (165.2, 1008.0)
    >>> "Ada" in hw.source("tensor_flops")
    True
  """
  gpu = _gpu_table(target)
  hosts = _read_toml(_HOSTS_FILE)
  if host not in hosts:
    raise ValueError(f"Unknown host profile {host!r}: use one of {tuple(hosts)}.")
  rates = {**_rates(gpu, _GPU_RATES, target), **_rates(hosts[host], _HOST_RATES, host)}
  return Hardware(
    name=f"{gpu['name']} + {hosts[host]['name']}",
    **{k: v for k, (v, _) in rates.items()},
    sources=tuple((k, s) for k, (_, s) in rates.items()),
  )


@dataclasses.dataclass(frozen=True)
class KernelCost:
  """What one scheduled instruction cost over the whole step (all its executions); `op_name` is
  the JAX operation it came from (HLO metadata)."""

  name: str
  computation: str
  kind: str
  executions: int
  seconds: float
  flops: float
  bytes: float
  op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Timeline:
  """The modelled time of one step and where it goes. A model, not a measurement.

  Attributes:
    step_s: modelled step time: until the compute stream, both link engines, the host and the
      disk are done.
    compute_s: the same program with every transfer, host computation, callback and disk access
      free: the kernels alone (`gemm_s` + `other_s` + `launch_s`).
    gemm_s: kernels with matrix multiplies.
    other_s: all other kernels.
    launch_s: kernel launch costs.
    launches: kernels launched.
    flops: FLOPs counted from the program's kernels (matrix multiplies and elementwise work).
    gemm_flops: of which matrix multiplies and convolutions.
    bytes_to_device, bytes_to_host: bytes over the link per direction (copies, kernels that
      touch host memory, host computations and callbacks).
    link_to_device_s, link_to_host_s: seconds each link engine was busy.
    transfer_wait_s: seconds the compute stream waited on transfers.
    host_s: seconds of host computation.
    host_wait_s: seconds the stream waited on host computations.
    callbacks: host callbacks run; callback_s: seconds the stream spent in them.
    disk_s: seconds the disk was busy; disk_read_bytes, disk_write_bytes: what it moved.
    disk_wait_s: seconds callbacks held the stream waiting on the disk (reads not read ahead,
      writes beyond the write-behind bound).
    bottleneck: the busiest resource: ``"gemm"``, ``"memory"`` (the other kernels), ``"launch"``,
      ``"link_to_device"``, ``"link_to_host"``, ``"host"``, ``"callback"`` or ``"disk"``.
    peak_flops: the hardware's `Hardware.tensor_flops`.
    unknown_trip_counts: while loops without a known trip count (run once each).
    kernel_costs: per instruction, costliest first.
  """

  step_s: float
  compute_s: float
  gemm_s: float
  other_s: float
  launch_s: float
  launches: int
  flops: float
  gemm_flops: float
  bytes_to_device: float
  bytes_to_host: float
  link_to_device_s: float
  link_to_host_s: float
  transfer_wait_s: float
  host_s: float
  host_wait_s: float
  callbacks: int
  callback_s: float
  disk_s: float
  disk_read_bytes: float
  disk_write_bytes: float
  disk_wait_s: float
  bottleneck: str
  peak_flops: float
  unknown_trip_counts: int
  kernel_costs: tuple[KernelCost, ...] = dataclasses.field(default=(), repr=False, compare=False)

  def mfu(self, model_flops: float) -> float:
    """Model FLOPs utilisation: `model_flops` per modelled step over the peak tensor rate."""
    return model_flops / self.step_s / self.peak_flops

  def summary(self) -> dict[str, Any]:
    """The figures as plain numbers (and the bottleneck's name)."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("kernel_costs",)
    }


# --------------------------------------------------------------------------------------------
# The simulation.


@dataclasses.dataclass
class _Pending:
  """An asynchronous operation in flight: when it is done, and whether it is host work."""

  end: float
  host: bool = False


@dataclasses.dataclass
class _State:
  """Clocks of every resource and the accumulated totals (mutable; copied for branches)."""

  stream: float = 0.0
  link: dict[str, float] = dataclasses.field(default_factory=lambda: {TO_DEVICE: 0.0, TO_HOST: 0.0})
  host: float = 0.0
  disk: float = 0.0
  # The NVMe tier's read window: when the last read callback returned (the store then reads
  # ahead), and the disk's clock at that moment.
  window_open: float = 0.0
  window_disk: float = 0.0
  totals: dict[str, float] = dataclasses.field(default_factory=dict)
  kernels: dict[tuple[str, str], list] = dataclasses.field(default_factory=dict)

  def add(self, key: str, value: float) -> None:
    self.totals[key] = self.totals.get(key, 0.0) + value

  def clocks(self) -> list[float]:
    return [
      self.stream,
      self.link[TO_DEVICE],
      self.link[TO_HOST],
      self.host,
      self.disk,
      self.window_open,
      self.window_disk,
    ]

  def shift(self, deltas: Sequence[float]) -> None:
    self.stream += deltas[0]
    self.link[TO_DEVICE] += deltas[1]
    self.link[TO_HOST] += deltas[2]
    self.host += deltas[3]
    self.disk += deltas[4]
    self.window_open += deltas[5]
    self.window_disk += deltas[6]


def _shift_value(value: Any, dt: float) -> Any:
  if isinstance(value, _Pending):
    return _Pending(value.end + dt, value.host)
  if isinstance(value, tuple):
    return tuple(_shift_value(v, dt) for v in value)
  return value


class _Simulator:
  def __init__(
    self,
    program: hlo_cost.Module,
    hw: Hardware,
    disk: Mapping[str, tuple[float, float]],
    disk_overlap: bool,
    max_iterations: int,
    read_ahead_bytes: float | None = None,
    write_behind_bytes: float | None = None,
  ):
    self.p = program
    self.hw = hw
    self.disk_io = disk
    self.disk_overlap = disk_overlap
    self.read_ahead_bytes = read_ahead_bytes
    self.write_behind_bytes = write_behind_bytes
    self.max_iterations = max_iterations
    self.unknown_trip_counts: set[str] = set()

  # Resources -------------------------------------------------------------------------------

  def _link(self, s: _State, direction: str, nbytes: float, ready: float) -> float:
    """Queues `nbytes` on the link engine of `direction` no earlier than `ready`; its end."""
    if nbytes <= 0:
      return ready
    start = max(ready, s.link[direction])
    seconds = nbytes / self.hw.link(direction)
    s.link[direction] = start + seconds
    s.add(f"bytes_{direction}", nbytes)
    s.add(f"link_{direction}_s", seconds)
    return start + seconds

  def _record(
    self, s: _State, comp: str, name: str, kind: str, seconds: float, cost: hlo_cost.Cost
  ):
    entry = s.kernels.setdefault((comp, name), [kind, 0, 0.0, 0.0, 0.0])
    entry[1] += 1
    entry[2] += seconds
    entry[3] += cost.flops
    entry[4] += cost.device_bytes + cost.host_read_bytes + cost.host_write_bytes

  def _kernel(self, s: _State, comp: str, name: str) -> None:
    hw = self.hw
    cost = self.p.kernel_cost(comp, name)
    memory_s = cost.device_bytes / (hw.memory_efficiency * hw.memory_bandwidth)
    math_s = cost.gemm_flops / (hw.gemm_efficiency * hw.tensor_flops)
    math_s += cost.other_flops / hw.vector_flops
    device_s = max(memory_s, math_s)
    kind = "gemm" if cost.gemm_flops > 0 else "other"
    s.add(f"{kind}_s", device_s)
    s.add("launch_s", hw.launch_s)
    s.add("launches", 1)
    s.add("flops", cost.flops)
    s.add("gemm_flops", cost.gemm_flops)
    start = s.stream
    end = start + hw.launch_s + device_s
    # Bytes read from or written to host memory cross the link, on the engines the copies use.
    if cost.host_read_bytes:
      end = max(end, self._link(s, TO_DEVICE, cost.host_read_bytes, start + hw.launch_s))
    if cost.host_write_bytes:
      end = max(end, self._link(s, TO_HOST, cost.host_write_bytes, start + hw.launch_s))
    s.add("transfer_wait_s", end - (start + hw.launch_s + device_s))
    s.stream = end
    self._record(s, comp, name, kind, end - start, cost)

  def _wait(self, s: _State, value: Any, key: str) -> None:
    if isinstance(value, _Pending) and value.end > s.stream:
      s.add(key, value.end - s.stream)
      s.stream = value.end

  def _host_work(self, s: _State, instr: gpu_program.Instruction, comp: str) -> float:
    """Runs a host computation: device operands down the link, host DRAM time, results back."""
    shapes = self.p.shapes[comp]
    host = gpu_program._HOST_SPACE
    ins = [a for o in instr.operands for a in gpu_program._arrays(shapes.get(o, ""))]
    out_shape = instr.shape
    if instr.opcode.endswith("-start"):
      parts = gpu_program._split_top_level(instr.shape)
      out_shape = parts[1] if len(parts) > 1 else ""
    outs = gpu_program._arrays(out_shape)
    to_host = sum(gpu_program.shape_bytes(a) for a in ins if host not in a)
    to_device = sum(gpu_program.shape_bytes(a) for a in outs if host not in a)
    total = sum(gpu_program.shape_bytes(a) for a in ins + outs)
    ready = self._link(s, TO_HOST, to_host, s.stream)
    start = max(ready, s.host)
    seconds = total / self.hw.host_bandwidth
    s.host = start + seconds
    s.add("host_s", seconds)
    return self._link(s, TO_DEVICE, to_device, s.host)

  def _disk_bytes(self, instr: gpu_program.Instruction) -> tuple[float, float]:
    op_name = re.search(r'op_name="([^"]*)"', instr.text)
    label = instr.name + " " + (op_name.group(1) if op_name else "")
    read = write = 0.0
    for key, (r, w) in self.disk_io.items():
      if key in label:
        read, write = read + r, write + w
    return read, write

  def _callback(self, s: _State, instr: gpu_program.Instruction, comp: str) -> None:
    """A host callback: the stream stops until its operands are on the host, it ran, its disk
    reads are in and its results are back."""
    hw = self.hw
    shapes = self.p.shapes[comp]
    host = gpu_program._HOST_SPACE
    ins = [a for o in instr.operands for a in gpu_program._arrays(shapes.get(o, ""))]
    to_host = sum(gpu_program.shape_bytes(a) for a in ins if host not in a)
    to_device = sum(
      gpu_program.shape_bytes(a) for a in gpu_program._arrays(instr.shape) if host not in a
    )
    start = s.stream
    t = self._link(s, TO_HOST, to_host, start) + hw.callback_s
    read, write = self._disk_bytes(instr)
    read_s, write_s = read / hw.nvme_read, write / hw.nvme_write
    if read or write:
      s.add("disk_s", read_s + write_s)
      s.add("disk_read_bytes", read)
      s.add("disk_write_bytes", write)
    if self.disk_overlap:
      ready = t
      if read:
        # Read-ahead: the store reads up to `read_ahead_bytes` of the next reads from when the
        # previous read callback returned (its window then opened), behind the disk work queued
        # until that moment; the rest of this callback's reads are read once it asks for them,
        # behind everything queued. Unbounded (None): every read is read ahead.
        ahead = read if self.read_ahead_bytes is None else min(read, self.read_ahead_bytes)
        ahead_s = ahead / hw.nvme_read
        ahead_end = max(s.window_open, s.window_disk) + ahead_s
        s.disk = max(s.disk + ahead_s, ahead_end)  # work queued since waits behind it
        t = max(t, ahead_end)
        if read > ahead:
          s.disk = max(s.disk, ready) + (read - ahead) / hw.nvme_read
          t = max(t, s.disk)
      if write:
        # Write-behind: the write is queued once the data is on the host; the callback returns
        # once at most `write_behind_bytes` are left to write (None: at once).
        s.disk = max(s.disk, t) + write_s
        if self.write_behind_bytes is not None:
          t = max(t, s.disk - self.write_behind_bytes / hw.nvme_write)
      if t > ready:
        s.add("disk_wait_s", t - ready)
    elif read or write:
      s.disk = max(s.disk, t) + read_s + write_s
      s.add("disk_wait_s", s.disk - t)
      t = s.disk
    end = self._link(s, TO_DEVICE, to_device, t)
    if read:
      s.window_open, s.window_disk = end, s.disk
    s.add("callbacks", 1)
    s.add("callback_s", end - start)
    s.stream = end

  # Walking the schedule --------------------------------------------------------------------

  def run(self, s: _State, comp: str, args: Sequence[Any]) -> Any:
    """Executes computation `comp` once from state `s`; returns the value of its root."""
    env: dict[str, Any] = {}
    root_value = None
    shapes = self.p.shapes[comp]
    for instr in self.p.comps[comp]:
      op = instr.opcode
      value = None
      if op == "parameter":
        m = re.search(r"\bparameter\((\d+)\)", instr.text)
        k = int(m.group(1)) if m else 0
        value = args[k] if k < len(args) else None
      elif op == "tuple":
        value = tuple(env.get(o) for o in instr.operands)
      elif op == "get-tuple-element":
        m = re.search(r"\bindex=(\d+)", instr.text)
        src = env.get(instr.operands[0]) if instr.operands else None
        if isinstance(src, tuple) and m and int(m.group(1)) < len(src):
          value = src[int(m.group(1))]
      elif op in ("opt-barrier", "bitcast"):
        value = env.get(instr.operands[0]) if instr.operands else None
      elif op in hlo_cost.NO_WORK:
        pass
      elif op == "while":
        value = self._while(s, instr, env)
      elif op == "conditional":
        value = self._conditional(s, instr, env)
      elif op == "call" and not gpu_program._is_host_compute(instr):
        for c in instr.calls[:1]:
          value = self.run(s, c, [env.get(o) for o in instr.operands])
      elif op.endswith("-start"):
        value = self._start(s, instr, comp, env)
      elif op.endswith("-done"):
        source = env.get(instr.operands[0]) if instr.operands else None
        if isinstance(source, _Pending):
          key = "host_wait_s" if source.host else "transfer_wait_s"
          self._wait(s, source, key)
        elif op == "copy-done" and source is None and instr.operands:
          start_shape = shapes.get(instr.operands[0], "")
          if gpu_program._HOST_SPACE not in start_shape:
            self._kernel(s, comp, instr.name)  # a copy within device memory
      elif gpu_program._is_host_compute(instr):
        end = self._host_work(s, instr, comp)
        self._wait(s, _Pending(end), "host_wait_s")
      elif op == "custom-call" and any(
        t in gpu_program._custom_call_target(instr) for t in gpu_program._CALLBACK_TARGETS
      ):
        self._callback(s, instr, comp)
      elif op == "custom-call" and any(
        t in gpu_program._custom_call_target(instr) for t in gpu_program._NOT_COMPUTE_TARGETS
      ):
        value = env.get(instr.operands[0]) if instr.operands else None
      elif op == "copy" and instr.operands:
        transfer = gpu_program._transfer(instr.shape, [shapes.get(instr.operands[0], "")])
        if transfer is None:
          self._kernel(s, comp, instr.name)
        else:
          end = self._link(s, transfer[0], transfer[1], s.stream)
          self._wait(s, _Pending(end), "transfer_wait_s")
      else:
        self._kernel(s, comp, instr.name)
      env[instr.name] = value
      if instr.text.lstrip().startswith("ROOT"):
        root_value = value
    return root_value

  def _start(self, s: _State, instr, comp: str, env: Mapping[str, Any]) -> Any:
    shapes = self.p.shapes[comp]
    if "host-call" in instr.name or gpu_program._is_host_compute(instr):
      return _Pending(self._host_work(s, instr, comp), host=True)
    parts = gpu_program._split_top_level(instr.shape)
    out = parts[0] if instr.opcode == "copy-start" else (parts[1] if len(parts) > 1 else "")
    transfer = gpu_program._transfer(out, [shapes.get(o, "") for o in instr.operands])
    if transfer is not None:
      return _Pending(self._link(s, transfer[0], transfer[1], s.stream))
    if instr.opcode == "copy-start":
      return None  # a copy within device memory: charged at its done
    # Other asynchronous work runs on the compute stream here: a wrapped computation as its
    # kernels, anything else (a fusion, a single-device collective) as one kernel of its bytes.
    if instr.opcode in ("async-start", "call-start") and instr.calls:
      self.run(s, instr.calls[0], [env.get(o) for o in instr.operands])
    else:
      self._kernel(s, comp, instr.name)
    return None

  def _while(self, s: _State, instr, env: Mapping[str, Any]) -> Any:
    body = re.search(r"\bbody=%?([\w.\-]+)", instr.text)
    cond = re.search(r"\bcondition=%?([\w.\-]+)", instr.text)
    trip = re.search(r'known_trip_count":\{"n":"(\d+)"', instr.text)
    state = env.get(instr.operands[0]) if instr.operands else None
    if body is None:
      return state
    if trip is None:
      self.unknown_trip_counts.add(instr.name)
      n = 1
    else:
      n = int(trip.group(1))
    for k in range(n):
      if trip is None and cond is not None:
        self.run(s, cond.group(1), [state])
      if k == self.max_iterations and n > k + 1:
        # Steady state: repeat the last iteration's deltas for the remaining iterations.
        before_clocks, before_totals = s.clocks(), dict(s.totals)
        before_kernels = {key: list(v) for key, v in s.kernels.items()}
        state = self.run(s, body.group(1), [state])
        remaining = n - k - 1
        deltas = [a - b for a, b in zip(s.clocks(), before_clocks)]
        s.shift([d * remaining for d in deltas])
        for key, v in s.totals.items():
          s.totals[key] = v + (v - before_totals.get(key, 0.0)) * remaining
        for key, v in s.kernels.items():
          old = before_kernels.get(key, [v[0], 0, 0.0, 0.0, 0.0])
          for j in range(1, 5):
            v[j] += (v[j] - old[j]) * remaining
        return _shift_value(state, max(deltas) * remaining)
      state = self.run(s, body.group(1), [state])
    return state

  def _conditional(self, s: _State, instr, env: Mapping[str, Any]) -> Any:
    """Runs every branch from the same state and keeps the one that ends last."""
    names = re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", instr.text)
    m = re.search(r"branch_computations=\{([^}]*)\}", instr.text)
    if m:
      names = [c.strip(" %") for c in m.group(1).split(",") if c.strip()]
    best, best_value = None, None
    for k, name in enumerate(names):
      trial = _copy.deepcopy(s)
      arg = env.get(instr.operands[k + 1]) if k + 1 < len(instr.operands) else None
      value = self.run(trial, name, [arg])
      if best is None or max(trial.clocks()) > max(best.clocks()):
        best, best_value = trial, value
    if best is not None:
      s.__dict__.update(best.__dict__)
    return best_value


def timeline(
  program: gpu_program.GpuProgram | str,
  hardware: Hardware,
  *,
  disk: Mapping[str, tuple[float, float]] | None = None,
  disk_overlap: bool = True,
  read_ahead_bytes: float | None = None,
  write_behind_bytes: float | None = None,
  max_iterations: int = 128,
) -> Timeline:
  """Models the time of one step of a compiled program on `hardware`.

  Args:
    program: a `GpuProgram` or its scheduled HLO text (`GpuProgram.hlo`).
    hardware: rates, e.g. ``hardware("h100_80gb")`` (the function of the same name).
    disk: NVMe traffic of host callbacks: key -> (bytes read, bytes written) per execution of
      every callback whose instruction name or ``op_name`` contains the key (name callbacks with
      `jax.named_scope`). The compiled program cannot show what a callback does on the host.
    disk_overlap: with True (the NVMe tier's prefetch and write-behind threads), a callback's
      reads are read ahead (within `read_ahead_bytes`) and the callback waits for them, and its
      writes are queued (within `write_behind_bytes`); with False, a callback does its reads and
      writes while the stream waits.
    read_ahead_bytes: with `disk_overlap`, the most bytes the disk reads ahead of the callback
      that needs them: they are read from when the previous reading callback returned (the
      store's prefetch window opens at each fetch), and the rest when the callback asks. The NVMe
      tier reads ahead ``prefetch_depth`` store groups. None: no bound (each callback's reads
      all read ahead from that moment: more than any store's buffers allow).
    write_behind_bytes: with `disk_overlap`, the most bytes left to write when a writing
      callback returns (the NVMe tier's ``write_depth`` store groups: its ``put`` blocks beyond
      them). None: no bound.
    max_iterations: loop iterations simulated one by one; past them a loop repeats its last
      iteration's time (a steady state).

  Returns:
    A `Timeline`.
  """
  hw = hardware
  hlo = program.hlo if isinstance(program, gpu_program.GpuProgram) else program
  parsed = hlo_cost.Module(hlo)
  if not parsed.entry:
    raise ValueError("No ENTRY computation in the HLO text.")
  for name, value in (
    ("read_ahead_bytes", read_ahead_bytes),
    ("write_behind_bytes", write_behind_bytes),
  ):
    if value is not None and value < 0:
      raise ValueError(f"timeline: {name} must be >= 0 or None, got {value}.")
  sim = _Simulator(
    parsed, hw, disk or {}, disk_overlap, max_iterations, read_ahead_bytes, write_behind_bytes
  )
  s = _State()
  sim.run(s, parsed.entry, [])
  t = s.totals
  busy = {
    "gemm": t.get("gemm_s", 0.0),
    "memory": t.get("other_s", 0.0),
    "launch": t.get("launch_s", 0.0),
    "link_to_device": t.get("link_to_device_s", 0.0),
    "link_to_host": t.get("link_to_host_s", 0.0),
    "host": t.get("host_s", 0.0),
    "callback": t.get("callbacks", 0.0) * hw.callback_s,
    "disk": t.get("disk_s", 0.0),
  }
  kernel_costs = tuple(
    sorted(
      (
        KernelCost(name, comp, kind, int(n), seconds, flops, nbytes, parsed.op_name(comp, name))
        for (comp, name), (kind, n, seconds, flops, nbytes) in s.kernels.items()
      ),
      key=lambda k: -k.seconds,
    )
  )
  compute_s = t.get("gemm_s", 0.0) + t.get("other_s", 0.0) + t.get("launch_s", 0.0)
  # Each resource's busy time is a lower bound of its clock; taking them too keeps the invariants
  # exact when the clocks summed the same durations in another order.
  busy_times = [compute_s] + [busy[k] for k in ("link_to_device", "link_to_host", "host", "disk")]
  return Timeline(
    step_s=max(s.clocks() + busy_times),
    compute_s=compute_s,
    gemm_s=t.get("gemm_s", 0.0),
    other_s=t.get("other_s", 0.0),
    launch_s=t.get("launch_s", 0.0),
    launches=int(t.get("launches", 0)),
    flops=t.get("flops", 0.0),
    gemm_flops=t.get("gemm_flops", 0.0),
    bytes_to_device=t.get(f"bytes_{TO_DEVICE}", 0.0),
    bytes_to_host=t.get(f"bytes_{TO_HOST}", 0.0),
    link_to_device_s=t.get(f"link_{TO_DEVICE}_s", 0.0),
    link_to_host_s=t.get(f"link_{TO_HOST}_s", 0.0),
    transfer_wait_s=t.get("transfer_wait_s", 0.0),
    host_s=t.get("host_s", 0.0),
    host_wait_s=t.get("host_wait_s", 0.0),
    callbacks=int(t.get("callbacks", 0)),
    callback_s=t.get("callback_s", 0.0),
    disk_s=t.get("disk_s", 0.0),
    disk_read_bytes=t.get("disk_read_bytes", 0.0),
    disk_write_bytes=t.get("disk_write_bytes", 0.0),
    disk_wait_s=t.get("disk_wait_s", 0.0),
    bottleneck=max(busy, key=busy.get),
    peak_flops=hw.tensor_flops,
    unknown_trip_counts=len(sim.unknown_trip_counts),
    kernel_costs=kernel_costs,
  )
