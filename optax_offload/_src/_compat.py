"""Non-public or version-dependent names of JAX, jaxlib and optax, in one place.

When a JAX or optax release moves one of them, this is the only file to change. The table below
says, for every such name optax_offload uses, what it is for and what the versions in question
offer: jax 0.10.2 (installed and tested) and jax 0.12.0.1 (read from its published wheel, for
Python 3.12, not run). Names that are public and unchanged between the two are listed too, so the
table is the whole list to check when moving. "same" means the signature quoted is 0.12.0.1's too.

====================================  ==========================================================
name (where used)                     0.10.2 -> 0.12.0.1
====================================  ==========================================================
jax.experimental.compute_on           Context manager ``compute_on(compute_type: str)`` up to
.compute_on (host_compute, via        0.11.0; from 0.11.1 a decorator
`compute_on_host`)                    ``compute_on(f=None, *, compute_type, out_memory_spaces,
                                      compiler_options=None)`` (spelled ``compute_on2`` in
                                      0.10.1-0.11.0) and the context manager is gone.
jax._src.compute_on                   Private, same: ``extend_compute_type(c_type: str | None)``,
.extend_compute_type                  the context manager the public one wrapped (it only added
(`compute_on_host`, jax >= 0.11.1)    a check of the name); jit's lowering still tags its call
                                      with the compute type (0.12 pjit.py:
                                      ``mlir.wrap_compute_type_in_place(ctx, call.operation)``).
jax.extend.core.ClosedJaxpr           A class up to 0.10.x; since 0.11.0 an alias of ``Jaxpr``
(host_compute)                        (0.12: ``Jaxpr as ClosedJaxpr``), whose ``.jaxpr`` is itself
                                      and which keeps ``.consts``/``.constvars``/``.invars``/
                                      ``.eqns``/``.outvars``. ``isinstance`` also matches open
                                      jaxprs then: used only on `CALL_PRIMITIVES`' params.
jax.extend.core.Literal (host_comp.)  same: ``.val``.
jax.extend.core.Primitive API         same: ``get_bind_params(params)``, ``bind``,
(host_compute: eqn.primitive)         ``multiple_results``, ``name``.
call-primitive names (`CALL_          ``closed_call`` up to 0.11.0, ``eval_jaxpr`` from 0.11.1
PRIMITIVES`, host_compute)            (``closed_call_p`` is an alias of ``eval_jaxpr_p``);
                                      ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` same
                                      (body: first Jaxpr-typed param, ``jaxpr``/``call_jaxpr``).
jax.core.Tracer (`Tracer`: stream;    Public, same.
memory, offload, inspection)
jax.memory.Space                      Public, same (``core.MemorySpace``: Device, Host, Any).
jax.device_put(x, Space) in jit       Public, same (api.device_put accepts ``core.MemorySpace``).
jax._src.array.ArrayImpl(aval, shard- Private (`host_typed`): the constructor of a concrete array
ing, arrays, committed), .aval        from its per-device buffers (``x._arrays``), used to give a
.update(memory_space=), ._arrays,     pinned-host array its host-memory type without a copy. In
._committed                           jax 0.10 `core.update_aval_with_sharding` sets the memory
                                      space only for a NamedSharding, so a one-device array made
                                      from shards (Orbax's restore, ``make_array_from_callback``)
                                      says pinned_host in its sharding and device in its type.
jax.shard_map (nvme_tier.callbacks)   Public, same: ``shard_map(f=None, /, *, out_specs,
                                      in_specs=Infer, mesh=None, axis_names=frozenset(),
                                      check_vma=True)``.
jax.experimental.io_callback          Same: ``io_callback(callback, result_shape_dtypes, *args,
(nvme_tier.callbacks)                 sharding=None, ordered=False, **kwargs)``.
jax._src.interpreters.mlir            Private, same: ``get_backend(self, optional: bool = False)
.ModuleContext.get_backend            -> xc.Client | None``; 0.12's callback lowering still calls
(`lowering_backend`)                  ``ctx.module_context.get_backend()``.
jax._src.lib.xla_client               Private, same: ``CompileOptions = _xla.CompileOptions``;
.CompileOptions, .env_option_         0.12's compiler.py sets ``compile_options.env_option_
overrides, .SerializeAsString()       overrides = list(env_options_overrides.items())`` and its
(`compile_options`)                   cache key hashes ``SerializeAsString()``.
DeviceList (`compile_for_topology`)   Was ``jax._src.lib._jax.DeviceList``; now taken from
                                      ``xla_client.DeviceList`` (the same object in 0.10.2;
                                      ``DeviceList = _xla.DeviceList`` in jaxlib 0.12.0.1, what
                                      JAX itself calls as ``xc.DeviceList(...)``).
compile-only client ``.compile``      Same call as 0.12's ``compiler.backend_compile_and_load``
(`compile_for_topology`)              makes for a ``CompileOnlyPyClient``: ``backend.compile(
                                      module, executable_devices=..., compile_options=...)``.
jax.experimental.topologies           Same: ``get_topology_desc(topology_name: str = "",
.get_topology_desc (gpu_program)      platform: str | None = None, **kwargs)``.
jax.stages.Traced.lower (gpu_prog.)   Same: ``lower(self, *, lowering_platforms: tuple[str, ...]
                                      | None = None, _private_parameters=None)``.
jax.stages.Lowered.compiler_ir        Same: ``compiler_ir(self, dialect: str | None = None)``.
jax.stages.Lowered.as_text            Same: ``as_text(self, dialect=None, *, debug_info=False)``;
(gpu_program: program_cache's key)    with debug info, MLIR's locations as ``#locN = loc(...)``
                                      lines (names, ``callsite(...)``, ``"file":line:col``).
CUDA plugin (`check_gpu_compile_      ``jax_plugins.xla_cuda12`` (jax-cuda12-plugin/-pjrt ==
support`)                             jax's version); 0.12 also ships a cuda13 plugin.
jax._src.core.Primitive,              Private (`per_platform_callback`, for the NVMe tier's
jax._src.dispatch.apply_primitive,    callbacks): a primitive of our own whose lowering rule
jax._src.interpreters.mlir            (run outside jit by ``apply_primitive``, as io_callback)
.register_lowering, .lower_fun,       (``register_lowering(prim, rule)``; ``lower_fun(fun,
jax._src.callback._IOEffect           multiple_results=True)(ctx, *args)``; ``ctx.module_context
                                      .platforms``) lowers one function on a CPU and another
                                      elsewhere, carrying io_callback's unordered ``IOEffect``.
                                      Not checked against 0.12.
jax.experimental.buffer_callback      Experimental, 0.10.2: ``buffer_callback(callback,
(nvme_tier.callbacks, on a CPU)       result_shape_dtypes, *, has_side_effect=False, ...)``;
                                      ``callback(ctx, out, *args)`` with ``np.asarray`` views
                                      of XLA's buffers. Not checked against 0.12.
optax.tree_utils._state_utils         Private; same in optax 0.2.8, the newest on PyPI.
._ParamsPlaceholder (layout)
optax._src.base.NO_PARAMS_MSG         Private; same in optax 0.2.8 (fallback string below).
(master, offload)
optax.MultiSteps private attributes   Private; same in optax 0.2.8: ``_every_k_schedule``
(apply: `multi_steps_*`)              (step -> k), ``_acc_update(grad, acc, *, n_acc)``,
                                      ``_accumulator_dtype``, ``_should_skip_update_fn`` (the
                                      default one is ``MultiSteps.__init__``'s local function).
====================================  ==========================================================

Orbax (orbax-checkpoint 0.12.8, installed and tested), for `install_orbax_array_handler` only:

====================================  ==========================================================
name                                  what is relied on
====================================  ==========================================================
ocp.type_handlers.get_type_handler,   Public: the handler registered for ``jax.Array``, and
register_type_handler(..., override)  replacing it (the registry is process-global).
ocp.type_handlers.ArrayHandler        Public class, subclassed; its async ``serialize(values,
.serialize, .deserialize              infos, args=None)`` raises for zero-size arrays unless
                                      ``has_dispatcher()`` (Pathways), checked the same way; its
                                      async ``deserialize(infos, args=None)`` returns the arrays.
ArrayHandler's instance attributes    Not public: the registered handler's settings (primary
                                      host, replica id, OCDBT, dispatcher, ...) live in its
                                      ``__dict__``, copied into the replacement so that a user's
                                      configuration (a re-registered ArrayHandler) is kept.
absl log "overriding" on override     Not an API: the warning Orbax logs for every override,
                                      filtered while ours is registered.
====================================  ==========================================================

jax >= 0.11 needs Python >= 3.12 (its wheels say ``Requires-Python: >=3.12``); the machines this
project runs on have Python 3.11, hence the ``jax<0.11`` pin in pyproject.toml. Moving to
jax 0.12: Python 3.12, the pins, `SUPPORTED_JAX` below, then run the suite (the jax >= 0.11.1
branch of `compute_on_host` and the jaxpr/primitive rows above are what changes underneath).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import logging
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.compute_on import compute_on as _compute_on
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Literal
from optax.tree_utils._state_utils import _ParamsPlaceholder as ParamsPlaceholder

from optax_offload._src import memory

logger = logging.getLogger(__name__)

try:  # optax 0.2.x keeps the message of its "params are required" error in `optax._src.base`.
  from optax._src.base import NO_PARAMS_MSG
except ImportError:  # pragma: no cover - a later optax moved it
  NO_PARAMS_MSG = "You are using a transformation that requires the current value of parameters"

Tracer = jax.core.Tracer

# Call-like primitives whose body (their first jaxpr-typed parameter) host_compute replays inline.
# "closed_call" is jax <= 0.11.0's name, "eval_jaxpr" jax >= 0.11.1's. "pjit", "core_call" and
# "remat" name no primitive of jax 0.10.2 or 0.12 (remat's is "remat2"); they are kept so that
# this list does not change what is inlined.
CALL_PRIMITIVES = (
  "jit",
  "pjit",
  "closed_call",
  "eval_jaxpr",
  "core_call",
  "custom_jvp_call",
  "custom_vjp_call",
  "remat",
)

__all__ = [
  "CALL_PRIMITIVES",
  "ClosedJaxpr",
  "Literal",
  "NO_PARAMS_MSG",
  "ParamsPlaceholder",
  "Tracer",
  "host_typed",
  "install_orbax_array_handler",
  "per_platform_callback",
  "compute_on_host",
]

SUPPORTED_JAX = ((0, 10, 2), (0, 11, 0))
"""Range of jax versions whose private entry points below were run: [low, high).

jax 0.12.0.1's source was read and has the same entry points (see the table above); raise `high`
once tests/test_gpu_program.py passed on it.
"""

COMPUTE_ON_IS_DECORATOR = "out_memory_spaces" in inspect.signature(_compute_on).parameters
"""True from jax 0.11.1: ``compute_on(f, *, compute_type, out_memory_spaces)``; False up to
0.11.0: ``with compute_on(compute_type):``."""


def jax_version() -> tuple[int, ...]:
  return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def compute_on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Returns ``fn`` as a host computation (compute type ``"device_host"``).

  Args:
    fn: a function of arrays (positional arguments).

  Returns:
    A function with ``fn``'s signature that runs ``jax.jit(fn)`` on the host, its outputs in the
    memory spaces ``fn`` gives them: inside ``with compute_on("device_host")`` on jax <= 0.11.0,
    inside the private context manager that one wrapped on jax >= 0.11.1 (see below).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    >>> y = jax.jit(compute_on_host(lambda x: x * 2))(x)
    >>> y.tolist(), y.sharding.memory_kind
    ([0.0, 2.0, 4.0], 'pinned_host')
  """
  if not COMPUTE_ON_IS_DECORATOR:
    host_context = functools.partial(_compute_on, "device_host")
  else:  # pragma: no cover - jax >= 0.11.1, which needs Python >= 3.12
    # Why not the public decorator: with jax 0.10.2's `compute_on2` (the signature of 0.11.1's
    # `compute_on`, and much the same lowering as 0.12.0.1's: a called function tagged with the
    # compute type, outputs wrapped with their memory kinds) the H100 program of an
    # `update_on="host"` step splits into 14 host calls whose outputs land in device memory, and
    # the host state crosses the link twice per step (78 x 16 MiB each way in
    # tests/test_gpu_program.py's host-update case, against none with the context manager).
    # Numerics are the same. `_host_decorated` stays as the fallback.
    try:
      from jax._src.compute_on import extend_compute_type
    except ImportError:
      return _host_decorated(_compute_on, fn)
    host_context = functools.partial(extend_compute_type, "device_host")

  def run(*args: Any) -> Any:
    with host_context():
      return jax.jit(fn)(*args)

  return run


def _host_decorated(decorator: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` through the decorator form of ``compute_on``, every output in host memory.

  Written against jax 0.12.0.1's ``jax._src.compute_on.compute_on(f=None, *, compute_type,
  out_memory_spaces, compiler_options=None)``: it traces ``f`` under the compute type, then
  broadcasts ``out_memory_spaces`` over the output tree (``api_util.flatten_axes``, so one
  ``Space`` stands for all) and labels each output with it without checking what ``f``
  produced, hence the explicit move of device-typed outputs. Not run on jax 0.12 (Python 3.11
  here); jax 0.10.2's ``compute_on2`` has the same signature and runs this code.
  """

  def to_host(x: Any) -> Any:
    return x if memory.in_host(x) else jax.device_put(x, memory.HOST)

  def fn_on_host(*args: Any) -> Any:
    return jax.tree.map(to_host, fn(*args))

  return decorator(fn_on_host, compute_type="device_host", out_memory_spaces=memory.HOST)


def check_gpu_compile_support() -> None:
  """Raises a clear error when compiling for a GPU target cannot work in this environment."""
  low, high = SUPPORTED_JAX
  version = jax_version()
  if not low <= version < high:
    raise RuntimeError(
      f"optax_offload's compile-for-GPU harness was written against jax "
      f"{'.'.join(map(str, low))} to <{'.'.join(map(str, high))}; this is jax {jax.__version__}. "
      "Its non-public entry points live in optax_offload/_src/_compat.py: check them against this "
      "release."
    )
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise RuntimeError(
      "Compiling for an NVIDIA target needs the CUDA PJRT plugin of the installed jax (no GPU, "
      f"driver or nvidia-* wheels needed): pip install 'jax-cuda12-plugin=={jax.__version__}' "
      f"'jax-cuda12-pjrt=={jax.__version__}' (or pip install 'optax-offload[gpu-compile]')."
    )


@contextlib.contextmanager
def lowering_backend(client: Any):
  """Lowers with `client` as the backend of a CUDA lowering done on a machine without a GPU.

  Lowering a host callback (``io_callback``, the NVMe tier's) asks the module's backend for its
  platform; lowering for CUDA from CPU arrays has the CPU client there and fails. The callback's
  lowering only needs the platform, so a compile-only client of the target answers. Replaces
  the private ``mlir.ModuleContext.get_backend`` (jax 0.10.2 to 0.12.0.1) for the duration.
  """
  from jax._src.interpreters import mlir

  original = mlir.ModuleContext.get_backend

  def get_backend(self, optional: bool = False):
    if tuple(self.platforms) == ("cuda",):
      return client
    return original(self, optional)

  mlir.ModuleContext.get_backend = get_backend
  try:
    yield
  finally:
    mlir.ModuleContext.get_backend = original


def compile_options(env_overrides=()) -> Any:
  """XLA's compile options for `compile_for_topology` (``SerializeAsString()`` for a cache key).

  Args:
    env_overrides: ``(name, value)`` pairs of XLA debug options, values typed as XLA expects
      (bool, int or str), e.g. ``("xla_gpu_enable_latency_hiding_scheduler", True)``.
  """
  from jax._src.lib import xla_client  # CompileOptions: jaxlib-private

  options = xla_client.CompileOptions()
  if env_overrides:
    options.env_option_overrides = [(str(k), v) for k, v in env_overrides]
  return options


def compile_for_topology(lowered: jax.stages.Lowered, device: Any, options: Any) -> Any:
  """Compiles a lowered computation for one compile-only device of a topology.

  jax's public ``Lowered.compile()`` compiles with the backend the arrays were on (the CPU);
  compiling for a topology's device needs its client. Run on jax 0.10.2; jax 0.12.0.1 has the
  same entry points (table above).

  Args:
    lowered: ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``.
    device: a device of ``jax.experimental.topologies.get_topology_desc(...)``.
    options: `compile_options`'s.

  Returns:
    The loaded executable (``get_compiled_memory_stats()``, ``hlo_modules()``).
  """
  from jax._src.lib import xla_client  # DeviceList: jaxlib-private

  return device.client.compile(
    lowered.compiler_ir("stablehlo"),
    executable_devices=xla_client.DeviceList((device,)),
    compile_options=options,
  )


class _WithoutOverrideWarning(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return "overriding" not in record.getMessage()


def host_typed(x: Any) -> Any:
  """`x`, a concrete array in pinned host memory, typed as host memory (the same buffers, no copy).

  jax 0.10 types a one-device array made from its shards (Orbax's restore,
  ``jax.make_array_from_callback``) as device memory even when its sharding says ``pinned_host``;
  a jitted step then traces it as device memory. Anything else is returned as it is.
  """
  from jax._src import array as array_lib  # private: see the table above

  if (
    isinstance(x, array_lib.ArrayImpl)
    and memory.is_pinned_host(x.sharding)
    and not memory.in_host(x)
  ):
    aval = x.aval.update(memory_space=memory.HOST)
    return array_lib.ArrayImpl(aval, x.sharding, x._arrays, committed=x._committed)
  return x


def install_orbax_array_handler(hint: str, restore_hint: Any = None) -> bool:
  """Replaces Orbax's registered ``jax.Array`` handler by one that knows offloaded states.

  The replacement is a subclass of Orbax's own ``ArrayHandler`` with the registered handler's
  settings, which saves and restores exactly as the handler it replaces, except that (1) Orbax's
  refusal to save a zero-size array (naming only the leaf) gets `hint` appended, (2) restored
  arrays in pinned host memory are typed as host memory (`host_typed`), so a restored offloaded
  state enters a jitted step as ``tx.init``'s did, and (3) a failed restore gets the note
  ``restore_hint(infos)`` returns, if any (the error itself unchanged). It is installed only when
  the registered handler is Orbax's own class (a handler a user registered with another class is
  left alone). Process-global, as Orbax's registry is.

  Args:
    hint: text appended to the zero-size error.
    restore_hint: None, or a function of the restored arrays' ``ParamInfo``s that returns a note
      for a failed restore, or None.

  Returns:
    Whether the handler was replaced.
  """
  import orbax.checkpoint as ocp  # only the checkpoint module needs Orbax

  current = ocp.type_handlers.get_type_handler(jax.Array)
  if type(current) is not ocp.type_handlers.ArrayHandler:
    return False

  class OffloadArrayHandler(ocp.type_handlers.ArrayHandler):
    """Orbax's ``jax.Array`` handler: a zero-size error that says how to save such a state, and
    restored pinned-host arrays typed as host memory."""

    async def serialize(self, values, infos, args=None):
      if not self.has_dispatcher():  # Orbax's own condition for its zero-size error
        for value, info in zip(values, infos):
          if value.size == 0:
            raise ValueError(f"Cannot save arrays with zero size: {info.name}. {hint}")
      return await super().serialize(values, infos, args)

    async def deserialize(self, infos, args=None):
      try:
        restored = await super().deserialize(infos, args)
      except Exception as e:
        try:  # (a best effort: the restore's own error is the one raised)
          note = restore_hint(infos) if restore_hint is not None else None
        except Exception:
          note = None
        if note:
          e.add_note(note)
        raise
      return [host_typed(x) for x in restored]

  handler = OffloadArrayHandler.__new__(OffloadArrayHandler)
  handler.__dict__.update(vars(current))
  quiet = _WithoutOverrideWarning()  # Orbax logs a warning for every override
  absl_logger = logging.getLogger("absl")
  absl_logger.addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl_logger.removeFilter(quiet)
  return True


def _unwrapped_update(update: Any) -> Any:
  """The update function under optax's ``with_extra_args_support`` wrapper (itself otherwise)."""
  if getattr(update, "__qualname__", "") == "with_extra_args_support.<locals>.update":
    inner = inspect.getclosurevars(update).nonlocals.get("tx")
    return getattr(inner, "update", update)
  return update


def chain_parts(tx: Any) -> list[Any] | None:
  """The update functions of an ``optax.chain(...)``, in order, or None for anything else.

  optax keeps them in the closure of the chain's ``update_fn`` (``update_fns``), the same in
  optax 0.2.8; a chain's own ``with_extra_args_support`` wrappers are looked through.
  """
  update = getattr(tx, "update", None)
  if getattr(update, "__qualname__", "") != "chain.<locals>.update_fn":
    return None
  fns = inspect.getclosurevars(update).nonlocals.get("update_fns")
  if fns is None:
    return None
  return [_Update(_unwrapped_update(f)) for f in fns]


class _Update:
  """A transformation known by its update function only (what `chain_parts` can recover)."""

  def __init__(self, update: Any):
    self.update = update


def clip_by_global_norm_max_norm(part: Any) -> Any:
  """``max_norm`` of an ``optax.clip_by_global_norm(max_norm)`` (from its update's closure), or
  None when `part` is something else."""
  update = getattr(part, "update", None)
  if getattr(update, "__qualname__", "") != "clip_by_global_norm.<locals>.update_fn":
    return None
  return inspect.getclosurevars(update).nonlocals.get("max_norm")


def multi_steps_every_k(multi: Any) -> Callable[[Any], Any]:
  """``optax.MultiSteps``' schedule: gradient step -> micro-steps per step."""
  return multi._every_k_schedule


def multi_steps_acc_update(multi: Any) -> Callable[..., Any]:
  """``optax.MultiSteps``' accumulation ``(grad, acc, *, n_acc) -> acc`` (running mean or sum)."""
  return multi._acc_update


def multi_steps_accumulator_dtype(multi: Any) -> Any:
  return multi._accumulator_dtype


def multi_steps_skips_nothing(multi: Any) -> bool:
  """Whether an ``optax.MultiSteps`` has no ``should_skip_update_fn`` of the user's."""
  fn = getattr(multi, "_should_skip_update_fn", None)
  return getattr(fn, "__qualname__", "") == "MultiSteps.__init__.<locals>.should_skip_update_fn"


@functools.cache
def _warn_once(message: str) -> None:
  logger.warning("optax_offload: %s", message)


@functools.cache
def _per_platform_primitive() -> Any:
  from jax._src import callback as jax_callback
  from jax._src import core as jax_core
  from jax._src import dispatch
  from jax._src.interpreters import mlir

  prim = jax_core.Primitive("per_platform_callback")
  prim.multiple_results = True
  prim.def_impl(functools.partial(dispatch.apply_primitive, prim))  # outside jit: jitted alone

  def abstract_eval(*avals, on_cpu, elsewhere, result_avals):
    del avals, on_cpu, elsewhere
    return result_avals, {jax_callback._IOEffect}

  def lowering(ctx, *args, on_cpu, elsewhere, result_avals):
    del result_avals
    fn = on_cpu if tuple(ctx.module_context.platforms) == ("cpu",) else elsewhere
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

  prim.def_effectful_abstract_eval(abstract_eval)
  mlir.register_lowering(prim, lowering)
  return prim


def per_platform_callback(
  on_cpu: Callable[..., Any], elsewhere: Callable[..., Any], result_shapes: Any, *args: Any
) -> list[Any]:
  """``on_cpu(*args)`` in a program lowered for a CPU, ``elsewhere(*args)`` otherwise.

  Both are traceable functions returning a list of arrays shaped as `result_shapes` (a list of
  `jax.ShapeDtypeStruct`), traced when the program is lowered, so the choice follows the
  platform the program is lowered for, not the one it is traced on (`gpu_program.compile_for_gpu`
  traces on this machine's CPU devices). The call is effectful like an unordered ``io_callback``.
  """
  try:
    from jax._src import core as jax_core

    prim = _per_platform_primitive()
    avals = tuple(jax_core.ShapedArray(s.shape, s.dtype) for s in result_shapes)
  except (ImportError, AttributeError) as e:  # private names moved: `elsewhere` on every platform
    _warn_once(
      f"per_platform_callback: JAX's internals moved ({type(e).__name__}: {e}); the NVMe tier's "
      "callbacks are io_callbacks on every platform (correct; more copies on a CPU)."
    )
    return elsewhere(*args)
  return prim.bind(*args, on_cpu=on_cpu, elsewhere=elsewhere, result_avals=avals)
