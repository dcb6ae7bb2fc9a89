"""Shared test code: one harness for the scripts that tests run in child processes.

A child is a script of this directory (``*_child.py``) run by the test's interpreter, with this
directory on ``PYTHONPATH`` so that it imports ``conftest`` and ``helpers`` as the tests do. Tests
import these as ``from helpers import ...``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


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
