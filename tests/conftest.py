"""Shared helpers: a pytree of mixed shapes and dtypes, gradient sequences, training loops."""

import atexit
import os
import platform
import shutil
import sys
import tempfile
import time
import zlib

# Four CPU devices for the sharding tests; must be set before jax initialises its backend. The CPU
# backend even where the CUDA plugin is installed (for compile-only GPU programs).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A persistent compilation cache, kept between runs in the user's cache directory (`make test`
# twice: the second run compiles little; 27 min cold and 12-19 min warm on this project's shared
# 2-core machine), which the child processes the tests start inherit through the environment:
# tests and children compile many programs of the same shapes (each child's `tx.init` alone runs
# ~190 small eager compiles). Every program, however quick to compile, is cached; JAX keys each by
# its HLO, compile options, XLA flags and jaxlib version, and never caches programs with host
# callbacks. The GPU programs compiled without a GPU are kept there too (`program_cache`, keyed
# alike; with host callbacks too: nothing is run). A cache directory set by the caller is used
# as it is and never tidied;
# `JAX_COMPILATION_CACHE_DIR=$(mktemp -d) make test` runs cold. Without an absolute cache
# directory that can be written (no HOME), the cache lives for the session in a temporary one.
CACHE_BOUND = 2 * 2**30
"""Bytes the suite's own cache may reach; a run that finds more deletes the least recently used
entries down to half of it."""


def _cache_directory() -> str | None:
  base = os.environ.get("XDG_CACHE_HOME", "")
  if not os.path.isabs(base):  # unset or relative: ignored, as the XDG specification says
    base = os.path.join(os.path.expanduser("~"), ".cache")
  if not os.path.isabs(base):
    return None
  # One directory per kind of CPU (a home shared by machines): XLA:CPU's programs use the
  # instructions of the CPU that compiled them, and JAX never replaces an entry it cannot load.
  try:
    with open("/proc/cpuinfo") as f:
      cpu = "".join(sorted({ln for ln in f if ln.startswith(("flags", "Features", "CPU part"))}))
  except OSError:
    cpu = platform.processor()
  kind = f"{platform.machine()}-{zlib.crc32(cpu.encode()):08x}"
  directory = os.path.join(base, "optax_offload", "jax_test_compilation_cache", kind)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError:
    return None
  return directory if os.access(directory, os.W_OK | os.X_OK) else None


OWN_CACHE = None
"""The cache directory this run chose and tidies (None: the caller's, or a temporary one)."""
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  OWN_CACHE = _cache_directory()
  if OWN_CACHE is None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax_offload_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  else:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

# Scripts that tests run in child processes; not test modules (and they parse sys.argv on import).
collect_ignore_glob = ["*_child.py"]


CHILD_PROCESSES = pytest.mark.xdist_group("child_processes")
"""Marks a test that runs several child processes at once or kills one at a timed moment: under
pytest-xdist such tests run one after another in one worker (beside the other worker's tests), so
that no two of them share the machine's cores at the same time."""


def pytest_addoption(parser):
  parser.addoption(
    "--kill-trials",
    type=int,
    default=5,
    help="child processes the random-SIGKILL test of the NVMe tier kills, each at a random "
    "moment of its training (default 5: about 35 s; a soak: --kill-trials 50)",
  )


def pytest_configure(config):
  if OWN_CACHE is not None and not hasattr(config, "workerinput"):  # pytest-xdist's controller
    try:
      _tidy_cache(OWN_CACHE, CACHE_BOUND)
    except Exception as e:  # a best effort: another run may tidy or write it at the same time
      print(f"the tests' compilation cache {OWN_CACHE} was not tidied: {e!r}", file=sys.stderr)


def _tidy_cache(directory: str, bound: int) -> None:
  """Deletes the entries written since the last tidy that do not decompress (a process killed
  while it wrote one: JAX never writes a key again, and warns at every read), then the least
  recently used ones (by access time where the file system keeps it, else by write) down to
  bound / 2 where the entries pass `bound`."""
  from jax._src import compilation_cache  # private: how JAX compresses its entries

  decompress = compilation_cache.decompress_executable  # (an AttributeError: nothing deleted)
  stamp, now = os.path.join(directory, ".tidied"), time.time()
  try:
    since = os.stat(stamp).st_mtime
  except FileNotFoundError:
    since = 0.0
  entries = []
  for entry in os.scandir(directory):
    try:
      st = entry.stat()
      if not entry.is_file() or entry.path == stamp:
        continue
      if st.st_mtime >= since and entry.name.endswith("-cache"):
        with open(entry.path, "rb") as f:
          try:
            decompress(f.read())
          except Exception:
            os.remove(entry.path)
            continue
      entries.append((max(st.st_atime, st.st_mtime), st.st_size, entry.path))
    except FileNotFoundError:  # deleted by another run
      continue
  with open(stamp, "w"):
    pass
  os.utime(stamp, (now, now))
  total = sum(size for _, size, _ in entries)
  if total <= bound:
    return
  for _, size, path in sorted(entries):
    if total <= bound // 2:
      break
    try:
      os.remove(path)
    except FileNotFoundError:
      pass
    total -= size


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its hook of the same name)
def pytest_collection_modifyitems(config, items):
  """Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``), the tests of a module that use a
  module-scoped fixture of that module run in one worker, so that the fixture (a compiled program,
  a reference run, a child process) is built once, as in a single process."""
  del config
  for item in items:
    if item.get_closest_marker("xdist_group") is not None:
      continue
    module = item.module.__name__ if getattr(item, "module", None) is not None else None
    defs = getattr(item, "_fixtureinfo", None)
    shared = defs is not None and any(
      d[-1].scope == "module" and getattr(d[-1].func, "__module__", None) == module
      for d in defs.name2fixturedefs.values()
    )
    if shared:
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def make_params(seed: int = 0) -> dict:
  """Mixed shapes and dtypes: bf16 and fp32 leaves, leaves above and below min_size=4096."""
  rng = np.random.default_rng(seed)

  def leaf(shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape) * 0.1, dtype)

  return {
    "embed": leaf((256, 64), jnp.bfloat16),
    "dense": {"kernel": leaf((64, 128)), "bias": leaf((128,))},
    "conv": leaf((3, 3, 16, 32)),
    "big": leaf((300, 200)),
    "scale": leaf((7,)),
  }


def make_grads(params, step: int, seed: int = 1):
  """Deterministic gradients for a step, in each leaf's dtype."""
  rng = np.random.default_rng(seed * 1000 + step)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)


def train(
  tx,
  params,
  steps: int,
  *,
  jit: bool = True,
  donate: bool = False,
  grads_seed: int = 1,
  apply: bool = False,
):
  """Runs `steps` updates with deterministic gradients; returns (params, state).

  With `apply`, each step is ``oo.update_and_apply`` instead of ``tx.update`` and
  ``optax.apply_updates``.
  """
  state = tx.init(params)
  step = update_step(tx, apply)
  if jit:
    step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  if donate:  # the caller's params stay usable
    params = jax.tree.map(jnp.copy, params)
  for t in range(steps):
    params, state = step(params, state, make_grads(params, t, grads_seed))
  return params, state


def update_step(tx, apply: bool):
  """``step(params, state, grads) -> (params, state)``: ``oo.update_and_apply`` with `apply`, else
  ``tx.update`` and ``optax.apply_updates``."""
  import optax_offload as oo

  def step(p, s, g):
    if apply:
      return oo.update_and_apply(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step


def bits_equal(a, b) -> bool:
  """True when two trees have the same structure and bit-identical leaves."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if jax.tree.structure(a) != jax.tree.structure(b) or len(la) != len(lb):
    return False
  return all(
    np.asarray(x).dtype == np.asarray(y).dtype
    and np.array_equal(
      np.atleast_1d(np.asarray(x)).view(np.uint8), np.atleast_1d(np.asarray(y)).view(np.uint8)
    )
    for x, y in zip(la, lb)
  )


WHOLE_LEAF_WINDOW = 1_200_000
"""A window that makes several groups of make_params() but splits no leaf into row slices.

For tests of whole-leaf groups. Tiers need no such window to compare bit for bit: the plan slices a
leaf the same way on the host and NVMe tiers (same groups, same bits)."""

RTOL = 1e-6
"""Numerics-rule tolerance against plain optax for grouped updates: per leaf, relative to the leaf's
largest magnitude (measured: at most 2e-7 after 20 steps of adam/adamw/nadamw/adabelief/lamb; 1e-5
before, fifty times what was measured)."""


def assert_close(ref, got, rtol: float = RTOL, ulps: float = 1):
  """Per leaf: max |ref - got| <= rtol * max |ref| (differences near zero are ulps of the scale).

  A low-precision leaf may differ by `ulps` ulps of its own dtype at that scale: its fp32 update,
  different by ulps, can round to the neighbouring bf16 value.
  """
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
    tol = rtol
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
      tol = max(rtol, ulps * float(jnp.finfo(a.dtype).eps))
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(a), initial=0.0)), 1e-30)
    err = float(np.max(np.abs(a - b), initial=0.0))
    assert err <= tol * scale, (
      f"{jax.tree_util.keystr(path)}: max diff {err:.3g} vs scale {scale:.3g}"
    )


@pytest.fixture
def params():
  return make_params()
