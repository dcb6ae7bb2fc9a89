"""Options of the NVMe store, as a frozen dataclass (orbax's ``options.py`` style)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class NvmeOptions:
  """How the NVMe tier overlaps disk I/O with the update, and how it lays out and moves files.

  Host RAM held by the store: at most ``(prefetch_depth + write_depth + 1)`` x the largest
  group's NVMe bytes, plus ``io_threads`` x 4 MiB of write staging and a little padding
  (`NvmeStore.host_buffer_bound`); the NVMe tier holds one group more, the copy a put makes
  (`NvmeTier.host_buffer_bound`), and `oo.estimate` counts what the update holds beside them
  (`plan.nvme_buffer_bytes`).

  Attributes:
    prefetch_depth: groups read ahead of the update (0 disables prefetching).
    write_depth: groups written behind the update before ``put`` blocks (at least 1).
    chunk_bytes: target bytes per chunk file, split along the leading axis.
    io_threads: chunk files read, and as many written, at once (requests in flight each way).
    direct_io: read and write chunk files with ``O_DIRECT``, bypassing the page cache (the
      store falls back to the page cache by itself where the file system refuses it).

  Examples:
    >>> import tempfile, optax, optax_offload as oo
    >>> options = oo.NvmeOptions(prefetch_depth=2)
    >>> options
    NvmeOptions(prefetch_depth=2, write_depth=1, chunk_bytes=16777216, io_threads=4, direct_io=True)
    >>> nvme_dir = tempfile.mkdtemp()
    >>> tx = oo.offload(optax.adam(1e-3), host_limit=0, nvme_dir=nvme_dir, nvme_options=options)
    >>> oo.NvmeOptions.of({"write_depth": 2})  # a dict, as earlier versions took, is converted
    NvmeOptions(prefetch_depth=1, write_depth=2, chunk_bytes=16777216, io_threads=4, direct_io=True)
  """

  prefetch_depth: int = 1
  write_depth: int = 1
  chunk_bytes: int = 16 << 20
  io_threads: int = 4
  direct_io: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "bool":
        if not isinstance(value, bool):
          raise TypeError(f"NvmeOptions.{field.name} must be a bool, got {value!r}.")
      elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"NvmeOptions.{field.name} must be an int, got {value!r}.")
    if self.prefetch_depth < 0:
      raise ValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}.")
    if self.write_depth < 1:
      raise ValueError(f"write_depth must be >= 1, got {self.write_depth}.")
    if self.chunk_bytes < 1:
      raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}.")
    if self.io_threads < 1:
      raise ValueError(f"io_threads must be >= 1, got {self.io_threads}.")

  @classmethod
  def of(cls, value: NvmeOptions | Mapping[str, Any] | None) -> NvmeOptions:
    """`value` as `NvmeOptions`: None gives the defaults, a mapping its keys as fields.

    Raises:
      TypeError: `value` is neither, or a mapping holds a key that is not a field.
    """
    if value is None:
      return cls()
    if isinstance(value, cls):
      return value
    if isinstance(value, Mapping):
      names = [field.name for field in dataclasses.fields(cls)]
      unknown = sorted(str(k) for k in value if k not in names)
      if unknown:
        raise TypeError(
          f"nvme_options: unknown option(s) {', '.join(unknown)}; NvmeOptions has "
          f"{', '.join(names)}. Pass oo.NvmeOptions(...)."
        )
      return cls(**value)
    raise TypeError(
      f"nvme_options must be oo.NvmeOptions (or a dict of its fields), got {type(value).__name__}."
    )
