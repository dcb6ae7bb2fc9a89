"""Shared test code: the optimizer table, and one harness for the scripts tests run in child processes.

`OPTIMIZERS` lists every inner optimizer the tests run, with what they may expect of it; a test file
takes the rows it needs with `optimizers`.

A child is a script of this directory (``*_child.py``) run by the test's interpreter, with this
directory on ``PYTHONPATH`` so that it imports ``conftest`` and ``helpers`` as the tests do. Tests
import these as ``from helpers import ...``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import optax

HERE = os.path.dirname(os.path.abspath(__file__))


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


def child_env(**changes: str | None) -> dict[str, str]:
  """The environment of a child: this process's, with this directory on ``PYTHONPATH``.

  Args:
    **changes: variables to set, or to remove (None).
  """
  env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
