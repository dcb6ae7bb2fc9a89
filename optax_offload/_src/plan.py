"""Placement plan: which tier holds each leaf's state, and the groups streamed through the device.

Pure functions on shapes and byte counts; no JAX execution. `offload` calls `make_plan` at trace time
and the `plan` command prints it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence

DEFAULT_WINDOW_FRACTION = 0.1
"""Default `window_bytes`: this fraction of the device's memory, when the backend reports it."""

FALLBACK_WINDOW_BYTES = 1 << 30
"""Default `window_bytes` when the backend does not report its memory (e.g. the CPU backend)."""

_UNITS = {
  "": 1,
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "TB": 10**12,
  "KIB": 2**10,
  "MIB": 2**20,
  "GIB": 2**30,
  "TIB": 2**40,
  "K": 2**10,
  "M": 2**20,
  "G": 2**30,
  "T": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


class Tier(enum.Enum):
  """Where a leaf's optimizer state lives between steps."""

  DEVICE = "device"
  HOST = "host"
  NVME = "nvme"


def parse_bytes(value: int | str | None, name: str) -> int | None:
  """Parses a byte count given as an int or a string such as ``"64GiB"`` or ``"1.5 GB"``.

  Args:
    value: an int, a string with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or None.
    name: the argument's name, for error messages.

  Returns:
    The number of bytes, or None when `value` is None.

  Raises:
    ValueError: for a negative or unparseable value.
    TypeError: for a value that is neither int, str nor None.

  Examples:
    >>> parse_bytes("64GiB", "host_limit")
    68719476736
    >>> parse_bytes("1.5 MB", "window_bytes")
    1500000
    >>> parse_bytes(4096, "window_bytes")
    4096
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int | str):
    raise TypeError(
      f"{name} must be an int number of bytes or a string like '64GiB', got {type(value).__name__}"
      f" ({value!r})."
    )
  if isinstance(value, int):
    if value < 0:
      raise ValueError(f"{name} must be >= 0 bytes, got {value}.")
    return value
  match = _SIZE_RE.match(value)
  unit = match.group(2).upper() if match else None
  if match is None or unit not in _UNITS:
    raise ValueError(
      f"Could not parse {name}={value!r}: use an int or a number with a unit, e.g. '64GiB', "
      f"'500MB' (units: {', '.join(u for u in _UNITS if u)})."
    )
  return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
  """Formats a byte count with a binary unit.

  Examples:
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(512)
    '512 B'
  """
  for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """What the plan needs to know about one parameter leaf.

  Attributes:
    path: the leaf's key path, for messages (e.g. ``"['dense']['kernel']"``).
    size: number of elements of the parameter.
    state_bytes: bytes of this leaf's offloadable optimizer state, per device (its shard): what the
      device window holds.
    process_bytes: bytes of that state held by this process: every local device's shard (a replicated
      leaf once per local device); what `host_limit` counts. Defaults to `state_bytes`.
  """

  path: str
  size: int
  state_bytes: int
  process_bytes: int | None = None

  @property
  def held_bytes(self) -> int:
    """`process_bytes`, or `state_bytes` when it is not given."""
    return self.state_bytes if self.process_bytes is None else self.process_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  """Tier of every leaf and the groups the update streams through the device.

  Attributes:
    tiers: one `Tier` per leaf, in leaf order.
    groups: tuples of leaf indices, in update order; every leaf is in exactly one group.
    window_bytes: the device window the groups were sized for.
    bytes_per_tier: state bytes per tier held by this process (`LeafInfo.held_bytes`).
  """

  tiers: tuple[Tier, ...]
  groups: tuple[tuple[int, ...], ...]
  window_bytes: int
  bytes_per_tier: dict[str, int]

  def group_bytes(self, leaves: Sequence[LeafInfo]) -> list[int]:
    """Offloaded state bytes of each group (device-tier leaves count zero)."""
    return [
      sum(leaves[i].state_bytes for i in g if self.tiers[i] is not Tier.DEVICE) for g in self.groups
    ]


def make_plan(
  leaves: Sequence[LeafInfo],
  *,
  min_size: int,
  window_bytes: int,
  host_limit: int | None = None,
  nvme: bool = False,
) -> Plan:
  """Decides the tier of each leaf's state and the streaming groups.

  Policy:
    * a leaf with fewer than `min_size` elements keeps its state on the device;
    * the other leaves go to pinned host memory while they fit in `host_limit`; when they do not, the
      largest leaves go to NVMe first (fewest files, longest sequential reads), ties broken by leaf
      order, until the rest fits;
    * groups are consecutive runs of leaves (leaf order, so reads stay sequential) holding at most
      ``window_bytes // 2`` of offloaded state each, so that the group being updated and the next one
      being prefetched fit in the window together. A leaf larger than that is a group of its own.

  Args:
    leaves: one `LeafInfo` per parameter leaf, in tree order.
    min_size: leaves with fewer elements keep their state on the device.
    window_bytes: most offloaded-state bytes resident on the device at once.
    host_limit: pinned-host budget in bytes, or None for no limit.
    nvme: whether an NVMe tier is available for what exceeds `host_limit`.

  Returns:
    The `Plan`.

  Raises:
    ValueError: when the state exceeds `host_limit` and there is no NVMe tier.

  Examples:
    >>> leaves = [LeafInfo("a", 10, 80), LeafInfo("b", 10_000, 80_000), LeafInfo("c", 20_000, 160_000)]
    >>> p = make_plan(leaves, min_size=4096, window_bytes=400_000, host_limit=100_000, nvme=True)
    >>> [t.value for t in p.tiers], p.groups
    (['device', 'host', 'nvme'], ((0, 1), (2,)))
  """
  tiers = [Tier.DEVICE if leaf.size < min_size else Tier.HOST for leaf in leaves]
  host_bytes = sum(leaf.held_bytes for leaf, t in zip(leaves, tiers) if t is Tier.HOST)
  if host_limit is not None and host_bytes > host_limit:
    if not nvme:
      raise ValueError(
        f"The offloaded optimizer state needs {format_bytes(host_bytes)} ({host_bytes} bytes) of host "
        f"memory but host_limit is {format_bytes(host_limit)}: {host_bytes - host_limit} bytes are "
        "missing. Raise host_limit, or pass nvme_dir=... to keep the rest on disk."
      )
    by_size = sorted(
      (i for i, t in enumerate(tiers) if t is Tier.HOST),
      key=lambda i: (-leaves[i].held_bytes, i),
    )
    for i in by_size:
      if host_bytes <= host_limit:
        break
      tiers[i] = Tier.NVME
      host_bytes -= leaves[i].held_bytes

  group_budget = max(window_bytes // 2, 1)
  groups: list[tuple[int, ...]] = []
  current: list[int] = []
  current_bytes = 0
  for i, (leaf, tier) in enumerate(zip(leaves, tiers)):
    nbytes = 0 if tier is Tier.DEVICE else leaf.state_bytes
    if current and current_bytes + nbytes > group_budget:
      groups.append(tuple(current))
      current, current_bytes = [], 0
    current.append(i)
    current_bytes += nbytes
  if current:
    groups.append(tuple(current))

  bytes_per_tier = {t.value: 0 for t in Tier}
  for leaf, tier in zip(leaves, tiers):
    bytes_per_tier[tier.value] += leaf.held_bytes
  return Plan(tuple(tiers), tuple(groups), window_bytes, bytes_per_tier)


def describe(plan: Plan, leaves: Sequence[LeafInfo]) -> str:
  """A human-readable table of the plan: one line per group, then bytes per tier.

  Examples:
    >>> leaves = [LeafInfo("w", 8192, 65536), LeafInfo("b", 8, 64)]
    >>> print(describe(make_plan(leaves, min_size=4096, window_bytes=1 << 20), leaves))
    group 0: 64.00 KiB offloaded
      w  host  64.00 KiB
      b  device  64 B
    device: 64 B, host: 64.00 KiB, nvme: 0 B (window 1.00 MiB)
  """
  lines = []
  for k, (group, nbytes) in enumerate(zip(plan.groups, plan.group_bytes(leaves))):
    lines.append(f"group {k}: {format_bytes(nbytes)} offloaded")
    for i in group:
      lines.append(
        f"  {leaves[i].path}  {plan.tiers[i].value}  {format_bytes(leaves[i].state_bytes)}"
      )
  totals = ", ".join(f"{k}: {format_bytes(v)}" for k, v in plan.bytes_per_tier.items())
  lines.append(f"{totals} (window {format_bytes(plan.window_bytes)})")
  return "\n".join(lines)
