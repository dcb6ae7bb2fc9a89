"""Errors of the NVMe store."""


class NvmeError(RuntimeError):
  """An error of the NVMe store (I/O, corruption, or a failed background write)."""


class NvmeCorruptionError(NvmeError):
  """Stored data failed verification: checksum mismatch, truncated, missing or mismatched file."""


class NvmeWriteError(NvmeError):
  """A background write or commit failed; the last committed generation is intact."""


class StaleGenerationError(ValueError):
  """A new generation was asked for from a stale one (neither the newest nor its parent)."""
