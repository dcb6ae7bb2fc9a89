"""The ``python -m optax_offload`` command, and the report it prints.

``plan``: bytes per tier for a model, whether they fit, and a step-time lower bound (see `estimate`).
Exit status: 0 when the plan fits, 1 when it does not, 2 for bad arguments. `report` renders an
`Estimate` as text; ``str(estimate)`` calls it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from optax_offload._src import estimate as estimate_lib
from optax_offload._src import layers as layers_lib
from optax_offload._src import measure
from optax_offload._src import plan as plan_lib
from optax_offload._src.units import format_bytes
from optax_offload._src.units import parse_bytes

_EPILOG = """\
examples:
  python -m optax_offload plan 7B --param-dtype bf16 --master-dtype fp32 \\
      --device-memory 24GiB --host-limit 64GiB --nvme-dir /nvme/run1
  python -m optax_offload plan 1.3e9 --optimizer lion --measure --nvme-dir /nvme/run1

sizes take a unit: 24GiB = 24 * 2**30 bytes, 24GB = 24 * 10**9 bytes. Bandwidths are bytes per
second (25GB = 25 * 10**9 B/s). A bare parameter count is one aggregate: every parameter in a leaf
of at least min_size elements; the Python API (optax_offload.estimate) takes shapes or a Flax model.
"""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m optax_offload", description="optax_offload command-line tools."
  )
  from optax_offload import __version__

  parser.add_argument("--version", action="version", version=f"optax_offload {__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  p = sub.add_parser(
    "plan",
    help="bytes per tier, whether they fit, and a step-time lower bound",
    description=(
      "Where offload() puts a model's optimizer state (device, pinned host, NVMe), whether it fits, "
      "and the fastest a step can be given the link and disk bandwidths."
    ),
    epilog=_EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("params", help="parameter count: 7e9, 7B, 1.3B, 350M (B = billion params)")
  opt = p.add_argument
  opt(
    "--param-dtype",
    default="fp32",
    metavar="DTYPE",
    help="params and grads: fp32 (default), bf16, fp16",
  )
  opt(
    "--optimizer",
    default="adamw",
    metavar="NAME",
    help=f"one of {', '.join(estimate_lib.OPTIMIZERS)} (default adamw)",
  )
  opt(
    "--master-dtype",
    metavar="DTYPE",
    help="offloaded master copy of narrower params, e.g. fp32 with --param-dtype bf16",
  )
  opt("--update-on", default="device", choices=("device", "host"), help="default device")
  opt(
    "--weights-on",
    default="device",
    choices=("device", "host"),
    help="host: the layer stack's weights and grads in pinned host memory too (offloaded_scan); "
    "needs --layers",
  )
  opt("--layers", type=int, metavar="N", help="layers in the streamed stack (--weights-on host)")
  opt(
    "--device-memory",
    metavar="SIZE",
    help="device memory JAX may use, e.g. 24GiB (JAX takes 75%% of a GPU by default); "
    "unchecked if omitted",
  )
  opt("--host-limit", metavar="SIZE", help="pinned-host budget, e.g. 64GiB; none if omitted")
  opt("--nvme-dir", metavar="DIR", help="NVMe tier directory (its free space is checked)")
  opt("--nvme-size", metavar="SIZE", help="disk space for the NVMe tier, e.g. 2TB")
  opt("--window-bytes", metavar="SIZE", help="default 10%% of --device-memory, or 1GiB")
  opt("--activations", default="0", metavar="SIZE", help="activation bytes to add on the device")
  bw = p.add_argument_group("bandwidths (bytes per second)").add_argument
  bw("--link-bandwidth", metavar="BPS", help="host<->device, one way (default 25GB)")
  bw("--nvme-read-bandwidth", metavar="BPS", help="default 3GB")
  bw("--nvme-write-bandwidth", metavar="BPS", help="default 2GB")
  bw("--host-memory-bandwidth", metavar="BPS", help="for --update-on host (default 40GB)")
  bw(
    "--measure",
    action="store_true",
    help="time a host<->device copy and, with --nvme-dir, the disk (overrides the defaults)",
  )
  bw("--measure-bytes", default="256MiB", metavar="SIZE", help="size of each measured transfer")
  p.add_argument("--json", action="store_true", help="print the numbers as JSON")
  return parser


def _bandwidths(args: argparse.Namespace) -> measure.Bandwidths:
  given = {}
  for field, flag in (
    ("link", "link_bandwidth"),
    ("nvme_read", "nvme_read_bandwidth"),
    ("nvme_write", "nvme_write_bandwidth"),
    ("host_memory", "host_memory_bandwidth"),
  ):
    value = parse_bytes(getattr(args, flag), "--" + flag.replace("_", "-"))
    if value is not None:
      if value == 0:
        raise ValueError(f"--{flag.replace('_', '-')} must be > 0.")
      given[field] = float(value)
  base = measure.Bandwidths(**given)
  if not args.measure:
    return base
  measured = measure.measure_bandwidths(args.nvme_dir, nbytes=args.measure_bytes, base=base)
  # A bandwidth given on the command line wins over a measured one.
  kept = tuple(m for m in measured.measured if m not in given)
  return dataclasses.replace(measured, **given, measured=kept)


def report(e: estimate_lib.Estimate) -> str:
  """The text report of `e` that ``python -m optax_offload plan`` prints (``str(e)``).

  Examples:
    >>> import optax_offload as oo
    >>> print(report(oo.estimate("1B", host_limit="64GiB")).splitlines()[0])
    optax_offload plan: 1,000,000,000 params (fp32), adamw with fp32 state, update on device
  """
  return "\n".join([*_summary(e), "", *_tiers(e), "", *_fit(e), "", *_step_time(e)])


def _summary(e: estimate_lib.Estimate) -> list[str]:
  """The model and optimizer, and for a bare count the bytes per parameter."""
  master = f", {e.master_dtype} master copy" if e.master_dtype else ""
  shapes = "" if e.plan is None else f" in {len(e.leaves)} leaves"
  lines = [
    f"optax_offload plan: {e.params:,} params ({e.param_dtype}){shapes}, {e.optimizer} with "
    f"{e.state_dtype} state{master}, update on {e.update_on}",
    "",
  ]
  if e.weights_on == "host":
    lines.insert(1, "weights and grads of the layer stack in pinned host memory (offloaded_scan)")
  if e.plan is None:
    opt = estimate_lib.OPTIMIZERS.get(e.optimizer)
    state_per = (e.offloaded_bytes - e.master_bytes) / e.params
    parts = [f"{e.master_bytes / e.params:g} B master"] if e.master_bytes else []
    parts.append(f"{state_per:g} B {e.optimizer}" + (f" ({opt.state})" if opt else ""))
    on_device = (
      f"{e.param_bytes / e.params:g} B param + {e.grad_bytes / e.params:g} B grad on device"
    )
    if e.weights_on == "host":
      on_device = f"{e.host_weight_bytes / e.params:g} B param + grad in host memory"
    lines.append(
      f"per parameter: {on_device}; {e.offloaded_bytes / e.params:g} B offloaded: {' + '.join(parts)}"
    )
  return lines


def _tiers(e: estimate_lib.Estimate) -> list[str]:
  """The table of bytes per tier and what each holds."""
  fmt = format_bytes
  lines = [f"{'tier':<8}{'bytes':>12}  holds"]
  device_parts = [f"params {fmt(e.param_bytes)}", f"grads {fmt(e.grad_bytes)}"]
  if e.weights_on == "host":
    device_parts = [
      f"params {fmt(e.param_bytes)} and grads {fmt(e.grad_bytes)} outside the stack",
      f"max(stack layers {fmt(e.stack_layer_bytes)} ({layers_lib.WEIGHT_LAYERS_ON_DEVICE} of "
      f"weights, {layers_lib.GRAD_LAYERS_ON_DEVICE} of grads), window {fmt(e.window_peak)})",
    ]
  if e.window_peak and e.weights_on != "host":
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
  host_note = f"offloaded state {limit}"
  if e.host_weight_bytes:
    host_note = (
      f"stack weights and grads {fmt(e.host_weight_bytes)} + offloaded state "
      f"{fmt(e.host_bytes)} {limit}"
    )
  if e.nvme_buffer_bytes:
    host_note += f"; plus {fmt(e.nvme_buffer_bytes)} of NVMe staging buffers"
  if e.nvme:
    nvme_note = (
      f"offloaded state beyond the host limit; disk needed {fmt(e.nvme_disk_bytes)} "
      f"({estimate_lib.NVME_DISK_FACTOR} generations)"
    )
  else:
    nvme_note = "no NVMe tier (--nvme-dir / --nvme-size)"
  for tier, nbytes, note in (
    ("device", e.device_bytes, " + ".join(device_parts)),
    ("host", e.host_bytes + e.host_weight_bytes, host_note),
    ("nvme", e.nvme_bytes, nvme_note),
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
  warning = plan_lib.pinned_pool_warning(e.host_bytes + e.host_weight_bytes)
  if warning:
    lines.append(f"on GPU (one device): {warning}")
  return lines


def _fit(e: estimate_lib.Estimate) -> list[str]:
  """Whether it fits, what was not checked, and each shortfall with its advice."""
  fmt = format_bytes
  checks = []
  if e.device_memory is None:
    checks.append("device not checked (pass --device-memory)")
  if e.nvme and e.nvme_capacity is None:
    checks.append("disk space not checked (pass --nvme-size)")
  unchecked = f" ({'; '.join(checks)})" if checks else ""
  if e.fits:
    lines = ["fits: yes" + unchecked]
    if e.device_memory is not None:
      lines.append(f"  device: {fmt(e.device_bytes)} of {fmt(e.device_memory)}")
    return lines
  lines = ["fits: NO" + unchecked]
  for s in e.shortfalls:
    lines.append(
      f"  {s.tier}: needs {fmt(s.needed)} but has {fmt(s.available)}: "
      f"{fmt(s.missing)} ({s.missing} bytes) missing; {s.advice}"
    )
  return lines


def _gbps(x: float) -> str:
  return f"{x / 1e9:.1f} GB/s"


def _step_time(e: estimate_lib.Estimate) -> list[str]:
  """The step-time lower bound and the time of each resource at its bandwidth."""
  fmt = format_bytes
  t, bw = e.step_times, e.bandwidths
  lines = [
    f"step time lower bound: {e.step_time_lower_bound:.3f} s ({e.bottleneck}; forward and backward "
    "excluded, transfers overlapped perfectly)",
  ]
  if e.update_on == "device":
    link_what = "each offloaded byte to the device and back"
    if e.weights_on == "host":
      link_what += "; stack weights 4x (forward, backward, update in and out), grads 2x"
  else:
    link_what = "grads to the host, updates back"
  lines.append(
    f"  link       {fmt(e.link_bytes):>12} / {_gbps(bw.link)} = {t['link']:.3f} s  ({link_what})"
  )
  if e.nvme_bytes:
    lines.append(
      f"  nvme read  {fmt(e.nvme_bytes):>12} / {_gbps(bw.nvme_read)} = {t['nvme_read']:.3f} s"
    )
    lines.append(
      f"  nvme write {fmt(e.nvme_bytes):>12} / {_gbps(bw.nvme_write)} = {t['nvme_write']:.3f} s"
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


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status (0 fits, 1 does not fit, 2 bad arguments)."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command != "plan":  # argparse rejects unknown commands; kept for new ones
    parser.error(f"unknown command {args.command!r}")
  try:
    result = estimate_lib.estimate(
      args.params,
      optimizer=args.optimizer,
      param_dtype=args.param_dtype,
      master_dtype=args.master_dtype,
      update_on=args.update_on,
      weights_on=args.weights_on,
      layers=args.layers,
      device_memory=args.device_memory,
      host_limit=args.host_limit,
      nvme_dir=args.nvme_dir,
      nvme_size=args.nvme_size,
      window_bytes=args.window_bytes,
      activation_bytes=args.activations,
      bandwidths=_bandwidths(args),
    )
  except (ValueError, TypeError, OSError) as e:
    parser.exit(2, f"{parser.prog} plan: error: {e}\n")
  if args.json:
    print(json.dumps(result.to_dict(), indent=2))
  else:
    print(result)
  return 0 if result.fits else 1


if __name__ == "__main__":
  sys.exit(main())
