"""The text report of an `Estimate`: what ``python -m optax_offload plan`` prints (``str(estimate)``).

Rendering only: every number comes from the `Estimate`. Neither `estimate` (the arithmetic) nor
`cli` (the command line) holds it, so that the two do not import each other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from optax_offload._src import named_optimizers
from optax_offload._src import offloaded_scan as scan_lib
from optax_offload._src import plan as plan_lib
from optax_offload._src.units import format_bytes

if TYPE_CHECKING:  # only for annotations: estimate imports this module
  from optax_offload._src.estimate import Estimate


def report(e: Estimate) -> str:
  """The text report of `e` that ``python -m optax_offload plan`` prints (``str(e)``).

  Examples:
    >>> import optax_offload as oo
    >>> print(report(oo.estimate("1B", host_limit="64GiB")).splitlines()[0])
    optax_offload plan: 1,000,000,000 params (fp32), adamw with fp32 state, update on device
  """
  summary = _summary(e)
  while summary[-1] == "":
    summary.pop()
  return "\n".join([*summary, "", *_tiers(e), "", *_placed(e), "", *_fit(e), "", *_step_time(e)])


def _summary(e: Estimate) -> list[str]:
  """The model and optimizer, and for a bare count the bytes per parameter."""
  master = f", {e.master_dtype} master copy" if e.master_dtype else ""
  if e.moment_dtype:
    master += f", moments in {e.moment_dtype}"
  shapes = "" if e.plan is None else f" in {len(e.leaves)} leaves"
  lines = [
    f"optax_offload plan: {e.params:,} params ({e.param_dtype}){shapes}, {e.optimizer} with "
    f"{e.state_dtype} state{master}, update on {e.update_on}",
    "",
  ]
  if e.weights_on == "nvme":
    lines.insert(
      1,
      "weights of the layer stack on NVMe (oo.write_nvme_stack; offloaded_scan reads a layer at a "
      f"time): {e.weights_on_reason}",
    )
    lines.insert(
      2,
      "update in the backward pass (oo.value_and_update), the stack's gradients never whole, its "
      "new weights written to the drive a block of layers at a time",
    )
  elif e.weights_on == "host":
    if e.update_in_backward:
      lines.insert(1, "weights of the layer stack in pinned host memory (offloaded_scan)")
      lines.insert(
        2,
        "update in the backward pass (oo.value_and_update), the stack's gradients never whole: "
        f"{e.update_in_backward_reason}",
      )
    else:
      lines.insert(1, "weights and grads of the layer stack in pinned host memory (offloaded_scan)")
      if e.step_s_in_backward is not None:
        lines.insert(
          2,
          "faster: the update in the backward pass (--update-in-backward yes, oo.value_and_update) "
          f"bounds a step at {e.step_s_in_backward:.1f} s instead of "
          f"{e.step_time_lower_bound:.1f} s: the stack's gradients never whole, fewer bytes "
          "moved",
        )
  if e.plan is None:
    opt = named_optimizers.OPTIMIZERS.get(e.optimizer)
    state_per = (e.offloaded_bytes - e.master_bytes) / e.params
    parts = [f"{e.master_bytes / e.params:g} B master"] if e.master_bytes else []
    parts.append(f"{state_per:g} B {e.optimizer}" + (f" ({opt.state})" if opt else ""))
    on_device = (
      f"{e.param_bytes / e.params:g} B param + {e.grad_bytes / e.params:g} B grad on device"
    )
    if e.weights_on == "host":
      on_device = f"{e.host_weight_bytes / e.params:g} B param + grad in host memory"
      if e.update_in_backward:
        on_device = f"{e.host_weight_bytes / e.params:g} B param in host memory, no whole grads"
    elif e.weights_on == "nvme":
      on_device = f"{e.nvme_weight_bytes / e.params:g} B param on NVMe, no whole grads"
    lines.append(
      f"per parameter: {on_device}; {e.offloaded_bytes / e.params:g} B offloaded: {' + '.join(parts)}"
    )
  return lines


def _tiers(e: Estimate) -> list[str]:
  """The table of bytes per tier and what each holds."""
  fmt = format_bytes
  lines = [f"{'tier':<8}{'bytes':>12}  holds"]
  device_parts = [f"params {fmt(e.param_bytes)}", f"grads {fmt(e.grad_bytes)}"]
  if e.weights_on != "device" and e.update_in_backward:
    device_parts = [
      f"stack layers {fmt(e.stack_layer_bytes)} ({plan_lib.FUSED_WEIGHT_LAYERS_ON_DEVICE} of weights, "
      f"{plan_lib.FUSED_GRAD_LAYERS_ON_DEVICE} of grads"
      + (
        f", {plan_lib.FUSED_ACCUMULATOR_LAYERS_ON_DEVICE} of {e.accumulator_dtype} accumulators)"
        if e.accumulator_bytes
        else ")"
      ),
      f"window {fmt(e.window_peak)} during the backward pass",
    ]
  elif e.weights_on == "host":
    device_parts = [
      f"max(stack layers {fmt(e.stack_layer_bytes)} ({scan_lib.WEIGHT_LAYERS_ON_DEVICE} of "
      f"weights, {scan_lib.GRAD_LAYERS_ON_DEVICE} of grads), window {fmt(e.window_peak)})",
    ]
  if e.weights_on != "device" and e.param_bytes:
    device_parts.insert(
      0,
      f"params {fmt(e.param_bytes)} and grads {fmt(e.grad_bytes)} outside the stack"
      + (
        f" (of them the stack's leaves kept on the device: {fmt(e.stack_device_bytes)} and "
        f"{fmt(e.stack_device_grad_bytes)})"
        if e.stack_device_bytes
        else ""
      ),
    )
  if e.window_peak and e.weights_on == "device":
    if e.update_on == "host":
      device_parts.append(f"updates returned at once, beyond the grads {fmt(e.window_peak)}")
    else:
      device_parts.append(f"window {fmt(e.window_peak)} (window_bytes {fmt(e.window_bytes)})")
  if e.device_state_bytes:
    device_parts.append(f"small-leaf state {fmt(e.device_state_bytes)}")
  if e.activation_bytes:
    device_parts.append(f"activations {fmt(e.activation_bytes)}")
  else:
    device_parts.append("activations not included")
  limit = "(no --host-limit)" if e.host_limit is None else f"up to --host-limit {fmt(e.host_limit)}"
  if e.host_memory is not None:
    limit = (
      f"(what --host-memory {fmt(e.host_memory)} leaves)" if e.nvme else "(all of it: no NVMe tier)"
    )
  host_note = f"offloaded state {limit}"
  if e.host_weight_bytes:
    stack = "stack weights" if e.update_in_backward else "stack weights and grads"
    acc = f" + grad accumulators {fmt(e.accumulator_bytes)}" if e.accumulator_bytes else ""
    host_note = (
      f"{stack} {fmt(e.host_weight_bytes)}{acc} + offloaded state {fmt(e.host_bytes)} {limit}"
    )
  elif e.accumulator_bytes:
    host_note = (
      f"grad accumulators {fmt(e.accumulator_bytes)} + offloaded state {fmt(e.host_bytes)} {limit}"
    )
  if e.nvme_buffer_bytes:
    host_note += f" + {fmt(e.nvme_buffer_bytes)} of NVMe staging buffers"
  if e.nvme:
    nvme_note = (
      f"offloaded state beyond the host budget; disk needed {fmt(e.nvme_disk_bytes)} "
      f"({plan_lib.NVME_DISK_FACTOR} generations)"
    )
    if e.nvme_weight_bytes:
      nvme_note = (
        f"stack weights {fmt(e.nvme_weight_bytes)} + offloaded state {fmt(e.nvme_bytes)} beyond "
        f"the host budget; disk needed {fmt(e.nvme_disk_bytes)} "
        f"(up to {plan_lib.NVME_DISK_FACTOR} generations of each)"
      )
  else:
    nvme_note = "no NVMe tier (--nvme-dir / --nvme-size)"
  for tier, nbytes, note in (
    ("device", e.device_bytes, " + ".join(device_parts)),
    ("host", e.host_total_bytes, host_note),
    ("nvme", e.bytes_per_tier["nvme"], nvme_note),
  ):
    lines.append(f"{tier:<8}{fmt(nbytes):>12}  {note}")
  master_note = f", incl. the master copy ({fmt(e.master_bytes)})" if e.master_bytes else ""
  lines.append(f"offloaded in all: {fmt(e.offloaded_bytes)}{master_note}")
  if e.plan is not None:
    counts = {t.value: sum(t is u for u in e.plan.tiers) for t in plan_lib.Tier}
    lines.append(
      f"leaves: {counts['device']} on device (< min_size), {counts['host']} host, "
      f"{counts['nvme']} nvme; {len(e.plan.groups)} groups"
    )
  if e.weights_on != "device" and e.plan is None:
    lines.append(
      f"window: offload needs window_bytes of at least {plan_lib.WINDOW_SLOTS} x one layer of the "
      "stack's largest leaf (its weights, gradients and state); a bare count cannot see the "
      "leaves: oo.estimate with the model's shapes checks it, as offload does at init"
    )
  lines.append(_pinned_pool(e))
  if e.nvme_bytes:
    lines.append(
      f"to run it: oo.offload(..., host_limit={e.host_bytes}, nvme_dir=DIR) (host_limit bounds "
      "the offloaded state in host memory"
      + ("; the stack's weights come on top)" if e.host_weight_bytes else ")")
    )
    asked = (e.update_in_backward_reason or "").startswith("as asked")
    short = any(f.tier == "host" for f in e.shortfalls)
    if e.host_memory is not None and e.update_on == "device" and not asked and not short:
      accumulate = (
        f", accumulate={e.accumulate}, accumulator_dtype={e.accumulator_dtype!r}"
        if e.accumulate > 1
        else ""
      )
      how = (
        "offload makes this plan at init from the params' shapes, as oo.estimate does"
        if e.plan is not None
        else "offload plans at init from the params' shapes and this device, which this count "
        "approximates"
      )
      lines.append(
        f"  or: oo.offload(..., host_memory={e.host_memory}, nvme_dir=DIR{accumulate}) ({how})"
      )
  if e.nvme_weight_bytes:
    lines.append(
      "the stack's weights on NVMe: write them once with oo.write_nvme_stack(directory, layers) "
      "(a function of the layer for a stack larger than RAM), put the leaves it returns in the "
      'params, and train with oo.value_and_update (docs/layers.md, "Training a stack on NVMe")'
    )
  return lines


def _pinned_pool(e: Estimate) -> str:
  """The setting JAX's GPU client needs to hold the pinned arrays, or that none is needed."""
  fmt = format_bytes
  pool = plan_lib.gpu_pinned_pool()
  given = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  source = f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={given}" if given else "JAX's default"
  head = f"pinned pool on GPU: {fmt(e.pinned_bytes)} of pinned arrays per device, pool {fmt(pool)} ({source})"
  if e.pinned_pool_setting is None:
    return f"{head}: no setting needed"
  return (
    f"{head}: set {e.pinned_pool_setting} (or more) before JAX starts, or lower the host budget"
  )


def _placed(e: Estimate) -> list[str]:
  """Each item of the plan with its tier, bytes and reason."""
  lines = ["placed (what each step touches most stays in RAM):"]
  for p in e.placements:
    lines.append(f"  {p.tier:<7}{format_bytes(p.nbytes):>11}  {p.what}: {p.reason}")
  return lines


def _fit(e: Estimate) -> list[str]:
  """Whether it fits, what was not checked, and each shortfall with its advice."""
  fmt = format_bytes
  checks = []
  if e.device_memory is None:
    checks.append("device not checked (pass --device-memory)")
  if e.host_memory is None:
    checks.append("host not checked (pass --host-memory)")
  if e.nvme and e.nvme_capacity is None:
    checks.append("disk space not checked (pass --nvme-size)")
  unchecked = f" ({'; '.join(checks)})" if checks else ""
  if e.fits:
    lines = ["fits: yes" + unchecked]
    if e.device_memory is not None:
      lines.append(f"  device: {fmt(e.device_bytes)} of {_device_memory(e)}")
    if e.host_memory is not None:
      lines.append(f"  host: {fmt(e.host_total_bytes)} of --host-memory {fmt(e.host_memory)}")
    if e.nvme_capacity is not None and e.nvme_bytes:
      lines.append(
        f"  disk: {fmt(e.nvme_disk_bytes)} of {fmt(e.nvme_capacity)} available"
        + ("" if e.nvme_space_note is None else f" ({e.nvme_space_note})")
      )
    return lines
  lines = ["fits: NO" + unchecked]
  if e.device_memory is not None:
    lines.append(f"  device memory: {_device_memory(e)}")
  for s in e.shortfalls:
    lines.append(
      f"  {s.tier}: needs {fmt(s.needed)} but has {fmt(s.available)}: "
      f"{fmt(s.missing)} ({s.missing} bytes) missing; {s.advice}"
    )
  return lines


def _device_memory(e: Estimate) -> str:
  """What the device budget is: the card's share JAX may take, or what was given."""
  fmt = format_bytes
  if e.memory_fraction is None:
    return f"{fmt(e.device_memory)} (device memory JAX may take, as given)"
  var = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
  source = (
    f"XLA_PYTHON_CLIENT_MEM_FRACTION={var}"
    if var
    else "JAX's default; XLA_PYTHON_CLIENT_MEM_FRACTION sets it"
  )
  return (
    f"{fmt(e.device_memory)} that JAX may take: {e.memory_fraction:g} of the "
    f"{fmt(e.device_card_memory)} card ({source})"
  )


def _gbps(x: float) -> str:
  return f"{x / 1e9:.1f} GB/s"


def _step_time(e: Estimate) -> list[str]:
  """The step-time lower bound and the time of each resource at its bandwidth."""
  fmt = format_bytes
  t, bw = e.step_times, e.bandwidths
  lines = [
    f"step time lower bound: {e.step_time_lower_bound:.3f} s ({e.bottleneck}; forward and backward "
    "excluded, transfers overlapped perfectly)",
  ]
  if e.update_on == "device":
    link_what = "each offloaded byte to the device and back"
    if e.weights_on != "device" and e.update_in_backward:
      link_what += (
        f"; stack weights {2 * e.accumulate + 1}x (forward and backward per micro-batch, new "
        "weights back), no grads"
      )
      if e.accumulator_bytes:
        link_what += f", accumulators {2 * (e.accumulate - 1)}x"
    elif e.weights_on == "host":
      link_what += "; stack weights 4x (forward, backward, update in and out), grads 2x"
  else:
    link_what = "grads to the host, updates back"
  lines.append(
    f"  link       {fmt(e.link_bytes):>12} / {_gbps(bw.link)} = {t['link']:.3f} s  ({link_what})"
  )
  if e.nvme_bytes or e.nvme_weight_bytes:
    weights = e.nvme_weight_bytes
    read, written = e.nvme_bytes + 2 * e.accumulate * weights, e.nvme_bytes + weights
    what = (
      f"  (state once; stack weights {2 * e.accumulate}x: forward and backward per micro-batch)"
      if weights
      else ""
    )
    lines.append(
      f"  nvme read  {fmt(read):>12} / {_gbps(bw.nvme_read)} = {t['nvme_read']:.3f} s{what}"
    )
    lines.append(
      f"  nvme write {fmt(written):>12} / {_gbps(bw.nvme_write)} = {t['nvme_write']:.3f} s"
      + ("  (state and stack weights once)" if weights else "")
    )
  if e.update_on == "host":
    touched = 2 * e.offloaded_bytes + e.link_bytes
    lines.append(
      f"  host update {fmt(touched):>11} / {_gbps(bw.host_memory)} = {t['host_update']:.3f} s "
      "(state read and written, grads read, updates written)"
    )
  if bw.measured:
    lines.append(f"  measured: {', '.join(bw.measured)}" + (f" ({bw.note})" if bw.note else ""))
  else:
    lines.append("  bandwidths: defaults or given; --measure times this machine")
  return lines
