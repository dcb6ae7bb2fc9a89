"""The documentation site builds cleanly, covers the public API, and its code examples run."""

import importlib.util
import logging
import os
import re
import subprocess
import sys

import pytest

import optax_offload as oo

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
DOCS = os.path.join(ROOT, "docs")
# Pages written by others; until they exist the nav and links to them are the only allowed warnings.
OTHERS_PAGES = ("checkpoints.md", "multihost.md")
# Pages whose ```python blocks run as one script each (``` sh / text blocks are not run).
RUNNABLE_PAGES = ("index.md", "quickstart.md", "tiers.md", "flax.md", "gpu.md", "layers.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _missing_docs_tools() -> str | None:
  for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material"):
    if importlib.util.find_spec(module) is None:
      return f"{module} is not installed (pip install -e '.[docs]')"
  return None


def test_site_builds_strict(tmp_path):
  missing = _missing_docs_tools()
  if missing:
    pytest.skip(missing)
  site = tmp_path / "site"
  proc = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(site)],
    cwd=ROOT,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
  absent = [p for p in OTHERS_PAGES if not os.path.exists(os.path.join(DOCS, p))]
  unexpected = [w for w in warnings if not any(f"'{p}'" in w for p in absent)]
  assert not unexpected, proc.stderr[-4000:]
  if not absent:
    assert proc.returncode == 0, proc.stderr[-4000:]
  api = (site / "api" / "index.html").read_text()
  for name in ("offload", "estimate", "make_plan", "footprint"):
    assert f'id="optax_offload.{name}"' in api, name


def test_api_reference_covers_every_public_name():
  api = open(os.path.join(DOCS, "api.md")).read()
  documented = set(re.findall(r"^::: optax_offload\.(\w+)$", api, re.M))
  assert set(oo.__all__) - documented == set()


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_code_examples_run(page, tmp_path, monkeypatch):
  blocks = _BLOCK.findall(open(os.path.join(DOCS, page)).read())
  assert blocks, f"{page} has no python example"
  monkeypatch.chdir(tmp_path)
  # Pages may set up the library's logging (quickstart.md): undone for the tests that follow.
  log = logging.getLogger("optax_offload")
  monkeypatch.setattr(log, "handlers", list(log.handlers))
  monkeypatch.setattr(log, "level", log.level)
  monkeypatch.setattr(log, "propagate", log.propagate)
  # The page's blocks run in order, in one fresh namespace, as a reader would paste them.
  namespace = {"__name__": f"docs.{page}"}
  exec(compile("\n".join(blocks), page, "exec"), namespace)
  # A step a page calls again must not compile again (uncommitted params against the offloaded
  # state's committed arrays would make the second call compile a second program).
  compiled_twice = {name: n for name, n in map(_compilations, namespace.items()) if n > 1}
  assert not compiled_twice, f"{page}: steps compiled more than once: {compiled_twice}"


def _compilations(item) -> tuple[str, int]:
  """(name, how many programs a jitted function compiled; 0 for any other value)."""
  name, value = item
  try:
    return name, int(value._cache_size())
  except (
    Exception
  ):  # not a jitted function (and some objects raise other errors than AttributeError)
    return name, 0


def test_readme_first_example_runs_and_compiles_once():
  first = _BLOCK.findall(open(os.path.join(ROOT, "README.md")).read())[0]
  namespace = {"__name__": "docs.README"}
  exec(compile(first, "README.md", "exec"), namespace)
  assert _compilations(("train_step", namespace["train_step"])) == ("train_step", 1)
  assert namespace["oo"].footprint(namespace["state"])["host"] == 2 * 4 * 1024 * 256


def test_quickstart_logging_recipe_prints_each_line_once():
  (recipe,) = [
    b for b in _BLOCK.findall(open(os.path.join(DOCS, "quickstart.md")).read()) if "getLogger" in b
  ]
  code = (
    "import orbax.checkpoint\n"  # importing Orbax gives the root logger a handler
    + recipe
    + "import jax.numpy as jnp, optax, optax_offload as oo\n"
    "oo.offload(optax.adam(1e-3)).init({'w': jnp.zeros((128, 64))})\n"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stderr.count("offload plan") == 1, proc.stderr[-2000:]
