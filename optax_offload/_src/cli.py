"""The ``python -m optax_offload`` command, and the report it prints.

``plan``: bytes per tier for a model, whether they fit, and a step-time lower bound (see `estimate`).
Exit status: 0 when the plan fits, 1 when it does not, 2 for bad arguments. It prints
``str(estimate)``, which `report.report` renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from optax_offload._src import estimate as estimate_lib
from optax_offload._src import host_budget
from optax_offload._src import measure
from optax_offload._src import named_optimizers
from optax_offload._src import step_time
from optax_offload._src.nvme import options as nvme_options
from optax_offload._src.units import parse_bytes

_EPILOG = """\
examples:
  # a 24 GB GPU, 64 GB of RAM (48 GiB of it for training), a 2 TB NVMe drive mounted at /nvme
  # (a Llama-2-13B layer's largest leaf needs a window of at least 2.37 GiB: docs/consumer.md):
  python -m optax_offload plan 13B --param-dtype bf16 --master-dtype fp32 --weights-on host \\
      --layers 40 --device-memory 24GiB --window-bytes 2.5GiB --host-memory 48GiB \\
      --nvme-dir /nvme/run1
  # 7B, 128 GB of RAM (96 GiB for training): the plan names the pinned-pool setting it needs
  python -m optax_offload plan 7B --param-dtype bf16 --master-dtype fp32 --weights-on host \\
      --layers 32 --device-memory 24GiB --host-memory 96GiB --nvme-dir /nvme/run1
  python -m optax_offload plan 1.3e9 --optimizer lion --measure --nvme-dir /nvme/run1
  python -m optax_offload plan 13B --param-dtype bf16 --master-dtype fp32 --moment-dtype bf16 \\
      --device-memory 24GiB --window-bytes 2.5GiB --weights-on host --layers 40 \\
      --host-memory 48GiB --nvme-size 2TB

--host-memory is all the host RAM the run may pin (weights, gradients, optimizer state, NVMe
buffers): leave the OS and your data loader the rest. --device-memory is the card's memory; JAX
takes 75% of it (XLA_PYTHON_CLIENT_MEM_FRACTION changes that) and the plan checks that share.

sizes take a unit: 24GiB (or 24G, as in free -g) = 24 * 2**30 bytes, 24GB = 24 * 10**9 bytes; a
number without one is bytes, and refused under a MiB (24 for 24GiB). Bandwidths are bytes per second (25GB = 25 * 10**9 B/s). A bare
parameter count is one aggregate: every parameter in a leaf of at least min_size elements; the
Python API (optax_offload.estimate) takes shapes or a Flax model.
"""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    allow_abbrev=False,
    prog="python -m optax_offload",
    description="optax_offload command-line tools.",
  )
  from optax_offload import __version__

  parser.add_argument("--version", action="version", version=f"optax_offload {__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  p = sub.add_parser(
    "plan",
    allow_abbrev=False,  # a mistyped option is refused, not taken for one it begins
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
    help=f"one of {', '.join(named_optimizers.OPTIMIZERS)} (default adamw)",
  )
  opt(
    "--master-dtype",
    metavar="DTYPE",
    help="offloaded master copy of narrower params, e.g. fp32 with --param-dtype bf16",
  )
  opt(
    "--moment-dtype",
    metavar="DTYPE",
    help="keep the optimizer's moments in this dtype on every tier: bf16 (half the bytes) or "
    "int8 (8-bit block-quantized: a byte per element + an fp32 scale per 256)",
  )
  opt("--update-on", default="device", choices=("device", "host"), help="default device")
  opt(
    "--weights-on",
    default="device",
    choices=("device", "host", "nvme"),
    help="host: the layer stack's weights and grads in pinned host memory too (offloaded_scan); "
    "nvme: its weights on NVMe (oo.write_nvme_stack, trained by oo.value_and_update); host moves "
    "them there itself when they do not fit in --host-memory beside an NVMe tier; needs --layers",
  )
  opt("--layers", type=int, metavar="N", help="layers in the streamed stack (--weights-on host)")
  opt(
    "--stack-on-device",
    metavar="SIZE",
    help="with --weights-on host: bytes of the stack's weights kept on the card (whole leaves, "
    "e.g. 3.91GiB for a 13B's wq and wo): they and their accumulators leave the host budget "
    "for the card's memory (value_and_update uses them in place)",
  )
  opt(
    "--device-memory",
    metavar="SIZE",
    help="the GPU card's memory, e.g. 24GiB for a 24 GB card (24GB is 10**9 bytes each: 22.35 "
    "GiB); the plan checks the share JAX may "
    "take: XLA_PYTHON_CLIENT_MEM_FRACTION if set, else JAX's default 75%%; unchecked if omitted",
  )
  opt(
    "--host-memory",
    metavar="SIZE",
    help="host RAM the run may use in all (stack weights, gradients, optimizer state, NVMe "
    "buffers), e.g. 48GiB on a 64 GB machine; what does not fit goes to --nvme-dir; unchecked if "
    "omitted",
  )
  opt(
    "--host-limit",
    metavar="SIZE",
    help="older, narrower bound: the optimizer state in host memory only (offload's host_limit); "
    "weights and gradients come on top. Prefer --host-memory",
  )
  opt(
    "--update-in-backward",
    default="auto",
    choices=("auto", "yes", "no"),
    help="update the layer stack inside the backward pass (oo.value_and_update): its gradients "
    "never exist whole. auto (default): when the stack's weights and gradients do not fit in "
    "--host-memory (with the NVMe buffers beside them), or with --accumulate above 1",
  )
  opt(
    "--accumulate",
    type=int,
    default=1,
    metavar="K",
    help="micro-batches per optimizer step with --update-in-backward (gradient accumulators in "
    "host memory, --accumulator-dtype); default 1",
  )
  opt(
    "--accumulator-dtype",
    default=None,
    choices=("fp32", "bf16"),
    help="with --accumulate above 1: dtype of the gradient accumulators (value_and_update's "
    "accumulator_dtype): fp32 (default, 4 B per stack parameter, as optax.MultiSteps) or bf16 "
    "(2 B)",
  )
  opt(
    "--nvme-dir",
    metavar="DIR",
    help="NVMe tier directory: must be a writable directory or creatable; its free space is checked",
  )
  opt(
    "--nvme-size",
    metavar="SIZE",
    help="disk space the NVMe tier may use, e.g. 2TB (with --nvme-dir: at most its free space)",
  )
  opt(
    "--prefetch-depth",
    type=int,
    metavar="N",
    help="NVMe store groups read ahead (offload's nvme_options; default 1): each takes a group of "
    "host memory",
  )
  opt(
    "--write-depth",
    type=int,
    metavar="N",
    help="NVMe store groups written behind (offload's nvme_options; default 1): each takes a group "
    "of host memory",
  )
  opt(
    "--window-bytes",
    metavar="SIZE",
    help="the update's window on the device; default 10%% of what JAX may take of "
    "--device-memory, or 1GiB",
  )
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
  speed = p.add_argument_group(
    "speed (a bound from the card's rates; benchmarks/gpu_speed.py models the compiled program)"
  ).add_argument
  speed("--target", metavar="CARD", help=f"GPU target whose rates to use: {', '.join(_TARGETS)}")
  speed(
    "--tokens-per-step", type=int, metavar="N", help="tokens per optimizer step (needs --target)"
  )
  speed(
    "--remat",
    default="full",
    choices=("full", "none"),
    help="full (default): the forward pass runs twice, 8 x params FLOPs per token; none: 6 x",
  )
  p.add_argument("--json", action="store_true", help="print the numbers as JSON")
  return parser


_TARGETS = ("rtx4090_24gb", "h100_80gb", "h100_24gb")


def speed_bound(result, target: str, tokens: int, remat: str = "full") -> dict[str, Any]:
  """The most tokens/s a step can reach: its GEMMs at the card's achievable rate, or the link and
  disk time of `result` (`Estimate.step_time_lower_bound`), whichever is longer.

  A bound from rates, not a model of the compiled program: attention, elementwise kernels and
  copies the schedule fails to hide all make the real step slower (``benchmarks/gpu_speed.py``
  models the compiled program, docs/speed.md).

  Examples:
    >>> from optax_offload._src import estimate
    >>> e = estimate.estimate("13B", param_dtype="bf16", master_dtype="fp32")
    >>> b = speed_bound(e, "rtx4090_24gb", 65536)
    >>> b["bottleneck"], round(b["compute_s"], 1)
    ('compute', 42.9)
  """
  hw = step_time.hardware(target)
  flops = (8 if remat == "full" else 6) * result.params * tokens
  compute_s = flops / (hw.tensor_flops * hw.gemm_efficiency)
  transfer_s = result.step_time_lower_bound
  step_s = max(compute_s, transfer_s)
  return {
    "target": target,
    "tokens_per_step": tokens,
    "compute_s": compute_s,
    "transfer_s": transfer_s,
    "step_s": step_s,
    "tokens_per_s": tokens / step_s,
    "model_tflops": 6 * result.params * tokens / step_s / 1e12,
    "bottleneck": "compute" if compute_s >= transfer_s else result.bottleneck,
  }


def _speed_text(b: dict[str, Any]) -> str:
  return (
    f"speed bound on {b['target']} at {b['tokens_per_step']:,} tokens per step: at most "
    f"{b['tokens_per_s']:,.0f} tokens/s ({b['model_tflops']:.1f} model TFLOPS, 6 x params x tokens/s)"
    f"\n  compute  {b['compute_s']:.3f} s (GEMMs at the card's achievable rate)"
    f"\n  transfer {b['transfer_s']:.3f} s (the lower bound above, overlapped with compute)"
    f"\n  bound by {b['bottleneck']}; a bound from rates, not the compiled program: "
    "benchmarks/gpu_speed.py models that (docs/speed.md)"
  )


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
  if getattr(args, "target", None) in _TARGETS and "link" not in given:
    # The card's host-to-device rate: the slower direction on both cards (step_time's sources).
    given["link"] = step_time.hardware(args.target).h2d_bandwidth
  base = measure.Bandwidths(**given)
  if not args.measure:
    return base
  measured = measure.measure_bandwidths(args.nvme_dir, nbytes=args.measure_bytes, base=base)
  # A bandwidth given on the command line wins over a measured one.
  kept = tuple(m for m in measured.measured if m not in given)
  return dataclasses.replace(measured, **given, measured=kept)


_SIZES = (
  "device_memory", "host_memory", "host_limit", "stack_on_device", "nvme_size", "window_bytes",
  "activations", "measure_bytes",
)  # fmt: skip
_BANDWIDTHS = (
  "link_bandwidth", "nvme_read_bandwidth", "nvme_write_bandwidth", "host_memory_bandwidth"
)  # fmt: skip
_BARE_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+([eE][+-]?[0-9]+)?\s*$")


def _check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Refuses what a user most likely mistyped: a size or bandwidth under a MiB without a unit
  (bytes, where 24 meant 24GiB), a negative one, a parameter count below a thousand without a suffix (13 for
  13B), and a token count that is not positive."""
  for name in (*_SIZES, *_BANDWIDTHS):
    value = getattr(args, name, None)
    flag = "--" + name.replace("_", "-")
    if not isinstance(value, str):
      continue
    if value.strip().startswith("-"):
      parser.error(f"{flag} {value}: a size must be positive, e.g. 48GiB.")
    if _BARE_NUMBER.match(value) and 0 < float(value) < 2**20:  # (a bare count is bytes)
      per = " per second" if name in _BANDWIDTHS else ""
      n = value.strip() if re.fullmatch(r"[0-9.]+", value.strip()) else "24"
      parser.error(
        f"{flag} {value}: a number without a unit is bytes; give a unit, e.g. {n}GiB (2**30 "
        f"bytes{per}) or {n}GB (10**9 bytes{per})."
      )
  if _BARE_NUMBER.match(args.params) and float(args.params) <= 0:
    parser.error(f"params {args.params}: the model needs a positive count, e.g. 7B.")
  if _BARE_NUMBER.match(args.params) and float(args.params) < 1000:
    parser.error(
      f"params {args.params}: a bare number is a count of parameters; write {args.params.strip()}B "
      f"for {args.params.strip()} billion, {args.params.strip()}M for millions."
    )
  if args.tokens_per_step is not None and args.tokens_per_step < 1:
    parser.error(
      f"--tokens-per-step must be a positive count of tokens, got {args.tokens_per_step}."
    )


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status (0 fits, 1 does not fit, 2 bad arguments)."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command != "plan":  # argparse rejects unknown commands; kept for new ones
    parser.error(f"unknown command {args.command!r}")
  _check_numbers(parser, args)
  if args.accumulator_dtype is not None and args.accumulate < 2:
    parser.error(
      "--accumulator-dtype is the dtype of the accumulators of several micro-batches a step: give "
      "--accumulate K (K >= 2) with it, or leave it out."
    )
  try:
    result = estimate_lib.estimate(
      args.params,
      optimizer=args.optimizer,
      param_dtype=args.param_dtype,
      master_dtype=args.master_dtype,
      moment_dtype=args.moment_dtype,
      update_on=args.update_on,
      weights_on=args.weights_on,
      layers=args.layers,
      stack_on_device=args.stack_on_device,
      device_memory=args.device_memory,
      host_limit=args.host_limit,
      host_memory=args.host_memory,
      update_in_backward={"auto": None, "yes": True, "no": False}[args.update_in_backward],
      accumulate=args.accumulate,
      accumulator_dtype=args.accumulator_dtype or "fp32",
      memory_fraction=(
        None if args.device_memory is None else host_budget.memory_fraction_from_env()
      ),
      nvme_dir=args.nvme_dir,
      nvme_size=args.nvme_size,
      window_bytes=args.window_bytes,
      activation_bytes=args.activations,
      bandwidths=_bandwidths(args),
      nvme_options=nvme_options_of(args),
    )
    if args.tokens_per_step is not None and args.target is None:
      raise ValueError("--tokens-per-step needs --target, the card whose rates to use.")
    if args.target is not None and args.target not in _TARGETS:
      raise ValueError(f"Unknown --target {args.target!r}: use one of {', '.join(_TARGETS)}.")
    bound = None
    if args.tokens_per_step is not None:
      bound = speed_bound(result, args.target, args.tokens_per_step, args.remat)
  except (ValueError, TypeError, OSError) as e:
    parser.exit(2, f"{parser.prog} plan: error: {e}\n")
  if args.json:
    print(json.dumps(dict(result.to_dict(), speed=bound), indent=2))
  else:
    print(result)
    if bound is not None:
      print("\n" + _speed_text(bound))
  return 0 if result.fits else 1


def nvme_options_of(args) -> nvme_options.NvmeOptions:
  """The NVMe tier's options of ``--prefetch-depth`` and ``--write-depth`` (the defaults where
  `args` has none; `benchmarks/gpu_speed.py` takes the same flags)."""
  given = {
    name: getattr(args, name, None)
    for name in ("prefetch_depth", "write_depth")
    if getattr(args, name, None) is not None
  }
  try:
    return nvme_options.NvmeOptions.of(given)
  except ValueError as e:
    raise ValueError(f"--prefetch-depth / --write-depth: {e}") from None


if __name__ == "__main__":
  sys.exit(main())
