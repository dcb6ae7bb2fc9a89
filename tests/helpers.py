"""Shared test code: the optimizer table, and one harness for the scripts tests run in child processes.

`OPTIMIZERS` lists every inner optimizer the tests run, with what they may expect of it; a test file
takes the rows it needs with `optimizers`.

A child is a script of this directory (``*_child.py``) run by the test's interpreter, with this
directory on ``PYTHONPATH`` so that it imports ``conftest`` and ``helpers`` as the tests do. Tests
import these as ``from helpers import ...``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import optax
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Optimizer(NamedTuple):
  """One inner optimizer of the tests, with what the tests may expect of it.

  Attributes:
    name: the test id.
    make: builds the optax transformation (a new one per call).
    exact: offloaded in several groups, the state equals plain optax's bit for bit (else within a
      tolerance: XLA:CPU fuses the scalar bias correction per group, see DESIGN.md "Numerics rule").
    exact_apply: with ``oo.update_and_apply``, the params equal plain optax's bit for bit too.
    nvme_host_limit: a ``host_limit`` that keeps some of its state on the host and sends the rest
      of ``make_params()``'s to NVMe; None where the NVMe tests do not run it.
  """

  name: str
  make: Callable[[], optax.GradientTransformation]
  exact: bool
  exact_apply: bool
  nvme_host_limit: str | None = None


OPTIMIZERS = (
  Optimizer("adam", lambda: optax.adam(1e-2), False, False),
  Optimizer("adamw", lambda: optax.adamw(1e-2, weight_decay=1e-2), False, False, "200KiB"),
  Optimizer("nadamw", lambda: optax.nadamw(1e-2), False, False),
  Optimizer("adabelief", lambda: optax.adabelief(1e-2), False, False),
  Optimizer("lamb", lambda: optax.lamb(1e-2), False, False),
  Optimizer("lion", lambda: optax.lion(1e-3), True, True, "100KiB"),
  Optimizer("sgd_momentum", lambda: optax.sgd(1e-2, momentum=0.9), True, True, "100KiB"),
  Optimizer("rmsprop", lambda: optax.rmsprop(1e-2), True, True),
  Optimizer("adagrad", lambda: optax.adagrad(1e-2), True, True),
  # Factored state, 84 KiB in all for make_params(); builds constants with jnp.where/ones_like.
  Optimizer("adafactor", lambda: optax.adafactor(1e-2), True, False, "40KiB"),
  Optimizer("lars", lambda: optax.lars(1e-2), True, True),
  Optimizer("sm3", lambda: optax.sm3(1e-2), True, True),
)
"""Every optimizer the tests run, in one table (optax's ``_OPTIMIZERS_UNDER_TEST``)."""


def optimizers(*names: str) -> tuple[Optimizer, ...]:
  """The rows of `OPTIMIZERS` named `names`, in that order (all of them without names)."""
  by_name = {o.name: o for o in OPTIMIZERS}
  return tuple(by_name[n] for n in names) if names else OPTIMIZERS


def nvme_optimizers() -> tuple[Optimizer, ...]:
  """The rows the NVMe tests run (those with an ``nvme_host_limit``)."""
  return tuple(o for o in OPTIMIZERS if o.nvme_host_limit is not None)


def consumer_example():
  """examples/consumer_13b.py as a module, loaded once (as ``consumer_13b``: its dataclasses look
  their module up in ``sys.modules``)."""
  if "consumer_13b" not in sys.modules:
    import importlib.util

    path = os.path.join(ROOT, "examples", "consumer_13b.py")
    spec = importlib.util.spec_from_file_location("consumer_13b", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["consumer_13b"] = module
    spec.loader.exec_module(module)
  return sys.modules["consumer_13b"]


def gpu_compile_or_skip(module_level: bool = False) -> None:
  """Skips a test of the XLA:GPU program where the CUDA PJRT plugin is not installed.

  Fails it instead where the plugin's distributions are installed but it does not import, or under
  CI (``CI`` set), which installs the ``[test]`` extra: a broken extra must not pass as skipped.
  """
  import importlib.metadata

  installed = []
  for dist in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
    try:
      installed.append(f"{dist} {importlib.metadata.version(dist)}")
    except importlib.metadata.PackageNotFoundError:
      pass
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
  except ImportError as e:
    if installed or os.environ.get("CI"):
      pytest.fail(
        f"the CUDA PJRT plugin does not import ({e}) with {installed or 'none'} installed; "
        "reinstall the test extra: pip install -e '.[test]'",
        pytrace=False,
      )
    pytest.skip(
      "needs the CUDA PJRT plugin (pip install -e '.[test]')", allow_module_level=module_level
    )


def one_device_bf16(shape: tuple[int, ...], memory_kind: str | None = None):
  """An abstract bf16 array on the first device, in `memory_kind` (e.g. ``"pinned_host"``, as the
  stack `offloaded_scan` streams is placed), for `oo.estimate` with shapes."""
  import jax
  import jax.numpy as jnp

  mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)


def child_env(**changes: str | None) -> dict[str, str]:
  """The environment of a child: this process's, with this directory and the repository's root on
  ``PYTHONPATH``.

  The root comes first so that a child imports the checkout under test (and `benchmarks`), as the
  tests do, not another installed copy of the library (an editable install of another worktree).

  Args:
    **changes: variables to set, or to remove (None).
  """
  path = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, PYTHONPATH=path)
  for name, value in changes.items():
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value
  return env


def child_argv(script: str, *args) -> list[str]:
  """The command line of a child script (a file name in this directory) and its arguments."""
  return [sys.executable, os.path.join(HERE, script), *(str(a) for a in args)]


def start_child(
  script: str,
  *args,
  env: dict[str, str] | None = None,
  stdin=None,
  stdout=subprocess.PIPE,
  stderr=subprocess.PIPE,
) -> subprocess.Popen:
  """Starts a child script; its output comes as text (to pipes unless redirected)."""
  return subprocess.Popen(
    child_argv(script, *args),
    env=child_env() if env is None else env,
    stdin=stdin,
    stdout=stdout,
    stderr=stderr,
    text=True,
  )


def run_child(
  script: str, *args, env: dict[str, str] | None = None, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
  """Runs a child script to its end; with `check`, asserts it succeeded (showing its stderr)."""
  proc = subprocess.run(
    child_argv(script, *args),
    env=child_env() if env is None else env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  if check:
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
  return proc


def expect_line(proc: subprocess.Popen, want: str) -> None:
  """Reads the child's next line of output and asserts it is `want` (else shows its stderr)."""
  line = proc.stdout.readline().strip()
  if line != want:
    err = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"expected {want!r} from the child, got {line!r}:\n{err[-3000:]}")


def kill_child(proc: subprocess.Popen) -> None:
  """Kills a child with SIGKILL (no cleanup of any kind), waits for it and closes its pipes."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGKILL)
  proc.wait()
  for pipe in (proc.stdin, proc.stdout, proc.stderr):
    if pipe is not None:
      pipe.close()


# ------------------------------------------------------------------------------------------------
# Faults of the file system: a real one where the test runs as root and may mount ("mount"), and
# the same errors injected into the system calls the NVMe store makes, in any process ("injected").


@contextlib.contextmanager
def mounted_tmpfs(directory: pathlib.Path, options: str):
  """Mounts a tmpfs on `directory` (needs root); skips the test if that is impossible."""
  directory.mkdir(parents=True, exist_ok=True)
  if os.geteuid() != 0:
    pytest.skip("mounting a small filesystem needs root")
  result = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
    capture_output=True,
    text=True,
    check=False,
  )
  if result.returncode != 0:
    pytest.skip(f"cannot mount tmpfs here: {result.stderr.strip()}")
  try:
    yield directory
  finally:
    subprocess.run(["umount", "-l", str(directory)], check=False)


def _under(path, directory) -> bool:
  return os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep)


@contextlib.contextmanager
def read_only(directory: pathlib.Path, how: str):
  """`directory` refuses writes: a read-only tmpfs mounted on it (needs root), or, in any process,
  ``EROFS`` from every ``os.open`` for writing and ``os.mkdir`` under it (fault injection)."""
  if how == "mount":
    with mounted_tmpfs(directory, "ro,size=1m") as target:
      yield target
    return
  directory.mkdir(parents=True, exist_ok=True)
  real_open, real_mkdir = os.open, os.mkdir

  def refuse(path):
    if _under(os.path.join(path, "x"), directory):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

  def fake_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      refuse(path)
    return real_open(path, flags, *args, **kwargs)

  def fake_mkdir(path, *args, **kwargs):
    refuse(path)
    return real_mkdir(path, *args, **kwargs)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(os, "open", fake_open)
    m.setattr(os, "mkdir", fake_mkdir)
    yield directory


@contextlib.contextmanager
def small_disk(directory: pathlib.Path, nbytes: int, how: str):
  """`directory` holds at most about `nbytes` of files: a tmpfs of that size (needs root), or, in
  any process, ``ENOSPC`` from the store's chunk writes (``os.pwrite``) once the files under it
  would hold more (fault injection)."""
  if how == "mount":
    with mounted_tmpfs(directory, f"size={nbytes}") as target:
      yield target
    return
  directory.mkdir(parents=True, exist_ok=True)
  real_pwrite = os.pwrite

  def used() -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())

  def fake_pwrite(fd, data, offset):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if _under(path, directory):
      grows = max(0, offset + memoryview(data).nbytes - os.fstat(fd).st_size)
      if used() + grows > nbytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return real_pwrite(fd, data, offset)

  with pytest.MonkeyPatch.context() as m:
    m.setattr(os, "pwrite", fake_pwrite)
    yield directory
