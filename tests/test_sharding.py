"""Sharded params in one process (4 CPU devices): FSDP, tensor-parallel and replicated leaves.

`test_transform.test_sharded_params_keep_their_sharding` checks Adam on a 1-D mesh with types kept
across steps; here: AdamW on 1-D and 2-D meshes against plain optax, where every state array
lives, what the host tier costs per process, and that the grouped update adds no collectives.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from conftest import bits_equal
from conftest import make_grads
from conftest import make_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_offload as oo

WINDOW = 100_000  # several groups for make_params()
MIN_SIZE = 4096  # offload's default
STEPS = 10
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

MESHES = {
  # FSDP: every large leaf split over all devices; small ones replicated.
  "fsdp_1d": (
    (4,),
    ("fsdp",),
    {
      "embed": P("fsdp"),
      "dense": {"kernel": P(None, "fsdp"), "bias": P()},
      "conv": P(None, None, None, "fsdp"),
      "big": P("fsdp"),
      "scale": P(),
    },
  ),
  # FSDP over "data" and tensor parallelism over "model"; conv and scale replicated on all four.
  "data_model_2d": (
    (2, 2),
    ("data", "model"),
    {
      "embed": P("model", "data"),  # vocab-parallel embedding
      "dense": {"kernel": P("data", "model"), "bias": P("model")},  # column-parallel
      "conv": P(),
      "big": P(("data", "model")),
      "scale": P(),
    },
  ),
}
# The same with Auto axes (the compiler propagates shardings; jax.make_mesh's default is Explicit).
MESHES["data_model_2d_auto"] = MESHES["data_model_2d"]
AUTO = ("data_model_2d_auto",)


def _setup(mesh_name):
  shape, axes, specs = MESHES[mesh_name]
  kwargs = {"axis_types": (jax.sharding.AxisType.Auto,) * len(axes)} if mesh_name in AUTO else {}
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:4], **kwargs)

  def put(tree):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)

  return mesh, put, put(make_params())


def _jitted_step(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step)


def _collectives(compiled) -> dict[str, int]:
  """Collective ops in a compiled (SPMD-partitioned) program, by kind (async pairs count once)."""
  text = compiled.as_text()
  return {op: len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in COLLECTIVES}


def _spec(x) -> tuple:
  """The array's PartitionSpec with trailing Nones: P("a") and P("a", None) are the same layout."""
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def _check_placement(state, params, mesh):
  """Offloaded state takes its param's sharding in pinned host memory; small leaves stay put."""
  flat_params = dict(jax.tree_util.tree_leaves_with_path(params))
  for slot in ("mu", "nu"):
    for path, x in jax.tree_util.tree_leaves_with_path(getattr(state.inner[0], slot)):
      p = flat_params[path]
      where = f"{slot}{jax.tree_util.keystr(path)}"
      assert x.sharding.mesh == mesh, where
      if p.size >= MIN_SIZE:
        assert x.sharding.memory_kind == "pinned_host", where
        assert _spec(x) == _spec(p), (where, x.sharding.spec, p.sharding.spec)
        assert x.sharding.is_equivalent_to(p.sharding.with_memory_kind("pinned_host"), p.ndim)
      else:
        assert x.sharding.memory_kind == "device", where
  assert state.inner[0].count.sharding.memory_kind == "device"


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_adamw_matches_plain_without_extra_collectives(mesh_name):
  mesh, put, params = _setup(mesh_name)
  plain = optax.adamw(1e-2)
  off = oo.offload(optax.adamw(1e-2), window_bytes=WINDOW)
  grads0 = put(make_grads(params, 0))
  results = {}
  for name, tx in (("plain", plain), ("offload", off)):
    state = tx.init(params)
    if name == "offload":
      _check_placement(state, params, mesh)
    step = _jitted_step(tx)
    # With Auto axes the state's shardings after step 1 may differ from init's (plain optax too):
    # count on the program of step 1, train with the jitted function.
    results[name] = {"collectives": _collectives(step.lower(params, state, grads0).compile())}
    p = params
    for t in range(STEPS):
      p, state = step(p, state, put(make_grads(params, t)))
    results[name].update(params=p, state=state)
  got = results["offload"]
  # Plain AdamW is elementwise: no collectives, and none under offload either.
  assert got["collectives"] == results["plain"]["collectives"] == dict.fromkeys(COLLECTIVES, 0)
  # The counter sees collectives where there are some (a regex that matched nothing would pass
  # the line above): a global sum of a sharded leaf all-reduces, replicating it all-gathers.
  replicated = NamedSharding(mesh, P())
  control = jax.jit(lambda p: (jnp.sum(p["big"]), p["big"]), out_shardings=(None, replicated))
  found = _collectives(control.lower(params).compile())
  assert found["all-reduce"] > 0 and found["all-gather"] > 0, found
  assert_close(results["plain"]["params"], got["params"])
  assert_close(results["plain"]["state"], oo.to_inner(got["state"], memory_kind="device"))
  _check_placement(got["state"], params, mesh)
  for p, ref in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(params)):
    assert p.sharding.is_equivalent_to(ref.sharding, ref.ndim)
  # Per process: sharded state counts once in all (each device holds its shard); a replicated
  # leaf's state is in pinned host memory once per device that holds the param.
  host = 0
  for p in jax.tree.leaves(params):
    if p.size >= MIN_SIZE:
      copies = int(np.prod(p.sharding.shard_shape(p.shape))) * len(p.sharding.device_set) // p.size
      host += 2 * p.nbytes * copies
  assert oo.footprint(got["state"])["host"] == host


def test_global_norm_clipping_collectives_are_the_same():
  """A step that does need collectives (the global norm) needs no more of them under offload."""
  _, put, params = _setup("data_model_2d")
  grads = put(make_grads(params, 0))
  counts = []
  for tx in (
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    optax.chain(optax.clip_by_global_norm(1.0), oo.offload(optax.adamw(1e-2), window_bytes=WINDOW)),
  ):
    compiled = _jitted_step(tx).lower(params, tx.init(params), grads).compile()
    counts.append(_collectives(compiled))
  plain, off = counts
  assert plain["all-reduce"] > 0  # the count does see collectives
  assert off == plain


def test_host_limit_counts_every_local_shard():
  """host_limit is per process: state this process would pin beyond it must be refused."""
  _, _, params = _setup("fsdp_1d")
  held = oo.footprint(oo.offload(optax.adamw(1e-2)).init(params))["host"]
  with pytest.raises(ValueError, match=f"needs .* \\({held} bytes\\) of host"):
    oo.offload(optax.adamw(1e-2), host_limit=held // 2).init(params)
  assert oo.footprint(oo.offload(optax.adamw(1e-2), host_limit=held).init(params))["host"] == held


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_params_on_different_devices_are_named(tier, tmp_path):
  # Plain optax's eager init takes them; offload's jitted init raised JAX's "incompatible devices"
  # on the host tier (the NVMe tier named the meshes).
  d = jax.devices()
  params = {
    "w": jax.device_put(jnp.ones((64, 128)), d[0]),
    "b": jax.device_put(jnp.zeros(8192), d[1]),
  }
  nvme = {"host_limit": 0, "nvme_dir": str(tmp_path)} if tier == "nvme" else {}
  tx = oo.offload(optax.adam(1e-2), **nvme)
  with pytest.raises(
    ValueError, match=r"different devices \(\['b'\] on devices \[1\]; \['w'\] on devices \[0\]\)"
  ):
    tx.init(params)
  same = jax.device_put(params, d[0])
  oo.close_nvme(tx.init(same))


def test_estimate_counts_a_replicated_leaf_once_on_nvme(tmp_path):
  """The NVMe tier stores each process's distinct shards once (a replicated leaf once, not once
  a device): estimate counts the bytes footprint finds (helper review /tmp/revF: twice as many)."""
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
  specs = {"a": ((256, 64), P("x", "y")), "r": ((128, 64), P()), "h": ((128, 128), P("x")),
           "s": ((64, 128), P(None, "y"))}  # fmt: skip
  shapes = {
    k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    for k, (shape, spec) in specs.items()
  }
  params = {k: jnp.ones(a.shape, a.dtype, device=a.sharding) for k, a in shapes.items()}
  options = dict(host_limit=0, nvme_dir=str(tmp_path), min_size=1)
  state = oo.offload(optax.adam(1e-2), **options).init(params)
  try:
    on_disk = oo.footprint(state)["nvme"]
    assert on_disk == 2 * 4 * (16384 + 8192 + 16384 + 8192)  # every moment once
    assert oo.estimate(shapes, optimizer=optax.adam(1e-2), **options).nvme_bytes == on_disk
  finally:
    oo.close_nvme(state)


@pytest.mark.parametrize(
  "axis_type, spec, tier",
  [
    ("Auto", P("fsdp", None), "host"),
    ("Auto", P(None, "fsdp"), "host"),
    ("Explicit", P("fsdp", None), "host"),
    ("Explicit", P(None, "fsdp"), "host"),
    ("Auto", P("fsdp", None), "nvme"),
    ("Explicit", P("fsdp", None), "nvme"),
  ],
  ids=lambda v: {P("fsdp", None): "rows", P(None, "fsdp"): "columns"}.get(v, v),
)
def test_a_sharded_step_compiles_once_and_keeps_inits_placement(axis_type, spec, tier, tmp_path):
  """The state a jitted step returns is placed as init placed it, so the step has one program and
  a state restored into init's placement runs that program. Failed before: on Auto axes a spec
  with a trailing None (jax returns P("fsdp") for the host-tier arrays) and 8-bit moments' block
  scales (replicated by init, returned sharded along the rows); on Explicit axes 8-bit moments
  (init raised: jax refused the quantization's reshapes and lookups) and the NVMe tier's
  placeholders (returned as P() where init placed P(None))."""
  mesh = jax.make_mesh(
    (4,),
    ("fsdp",),
    devices=jax.devices()[:4],
    axis_types=(getattr(jax.sharding.AxisType, axis_type),),
  )
  big = make_params()["big"]
  params = {
    "w": jax.device_put(big[:256].astype(jnp.bfloat16), NamedSharding(mesh, spec)),
    "v": jax.device_put(big[:64, :128], NamedSharding(mesh, spec)),
  }
  one_device = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), params)
  for moment_dtype in (None, "int8"):
    results = []
    for start in (params, one_device):
      nvme = {"host_limit": 0, "nvme_dir": tmp_path / f"{moment_dtype}{len(results)}"}
      tx = oo.offload(
        optax.adam(1e-2),
        master_dtype=jnp.float32,
        moment_dtype=moment_dtype,
        **(nvme if tier == "nvme" else {}),
      )
      state = tx.init(start)
      placed = jax.tree.map(lambda x: x.sharding, state)
      step = _jitted_step(tx)
      p = start
      for t in range(3):
        grads = jax.tree.map(lambda g, x: jax.device_put(g, x.sharding), make_grads(p, t), start)
        p, state = step(p, state, grads)
      assert jax.tree.map(lambda x: x.sharding, state) == placed
      assert step._cache_size() == 1
      results.append(p)
    assert_close(results[1], results[0])  # sharded as on one device


def test_a_decoder_step_on_a_mesh_compiles_once():
  """value_and_update (the stack updated in the backward pass) and update_and_apply return params
  and state placed as at init. value_and_update failed before: XLA gave the replicated final
  norm's scale, and its state, a sharding along the mesh (plain optax's step with
  jax.value_and_grad does too), so the step compiled twice. update_and_apply pins its state
  alike and leaves the params to XLA (here they kept their placement before too). Both still
  equal plain optax."""
  import test_value_and_update as fused_tests

  from benchmarks import llama
  from benchmarks.stream_layers import streamed_loss_fn

  mesh = jax.make_mesh(
    (4,), ("fsdp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
  )
  cfg = llama.Config(d=64, layers=2, ffn=128, heads=4, vocab=256)
  host = jax.tree.map(np.asarray, llama.init_params(cfg, jax.random.key(0), np.float32))
  specs = jax.tree.map(lambda x: P(*[None] * (x.ndim - 1), "fsdp") if x.ndim > 1 else P(), host)
  on_mesh = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), host, specs)
  batches = [
    jax.device_put(fused_tests.tokens(t, 0, 1), NamedSharding(mesh, P())) for t in range(3)
  ]
  make = lambda: optax.adam(1e-3)  # noqa: E731
  want = fused_tests.reference(cfg, on_mesh, make(), master=None, k=1, clip=None, steps=3)
  to_host = lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))  # noqa: E731
  stacked = dict(on_mesh, layers=jax.tree.map(to_host, on_mesh["layers"]))
  loss_fn = lambda p, t: streamed_loss_fn(cfg, p, t)  # noqa: E731

  def update_and_apply(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: llama.loss_fn(cfg, p, batch))(params)
    return (loss, *oo.update_and_apply(tx, grads, state, params))

  for name, params in (("value_and_update", stacked), ("update_and_apply", on_mesh)):
    tx = oo.offload(make(), min_size=256)
    state = tx.init(params)
    placed = jax.tree.map(lambda x: x.sharding, (params, state))
    if name == "value_and_update":
      step = jax.jit(oo.value_and_update(loss_fn, tx))
    else:
      step = jax.jit(update_and_apply)
    for batch in batches:
      _, params, state = step(params, state, batch)
    assert jax.tree.map(lambda x: x.sharding, (params, state)) == placed, name
    assert step._cache_size() == 1, name
    got = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), params)
    assert_close(want, got)


@pytest.mark.parametrize("options", ["update_on_host", "int8_in_row_slices"])
def test_explicit_axes_train_as_one_device(options):
  """On Explicit mesh axes, where jax wants every reshape's and write's sharding: the host update
  of a leaf sharded along its columns (its flat gradients raised "This reshape is not supported"),
  and 8-bit moments updated in row slices beside other leaves with update_and_apply (a slice's
  new block scales, sharded like its rows, could not be written into the replicated ones). Both
  failed while tracing; both now train as on one device, and the step compiles once."""
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])  # Explicit axes
  shapes = {
    "cols": ((64, 128), P(None, "x")),
    "rows": ((128, 64), P("x", None)),
    "stack": ((3, 64, 64), P(None, "x", None)),
    "rep": ((64, 96), P(None, None)),  # (spelled as jax returns it: P() came back so)
  }
  rng = np.random.default_rng(0)
  host = {k: (0.1 * rng.normal(size=shape)).astype(np.float32) for k, (shape, _) in shapes.items()}
  kwargs = {"update_on": "host"} if options == "update_on_host" else {"moment_dtype": "int8"}
  results = []
  runs = [(True, kwargs), (False, kwargs)]
  if options == "update_on_host":
    runs.append((True, {}))  # the update on the device, on the same mesh
  for sharded, kwargs in runs:

    def put(tree, sharded=sharded):
      if not sharded:
        return jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), tree)
      return {k: jax.device_put(x, NamedSharding(mesh, shapes[k][1])) for k, x in tree.items()}

    params = put(host)
    tx = oo.offload(optax.adam(1e-2), window_bytes=100_000, **kwargs)
    state = tx.init(params)
    step = jax.jit(lambda p, s, g, tx=tx: oo.update_and_apply(tx, g, s, p))
    for t in range(3):
      params, state = step(params, state, put(make_grads(host, t)))
    assert step._cache_size() == 1
    results.append(params)
  assert_close(results[1], results[0])
  if options == "update_on_host":
    # Leaves sharded on their first axis, or replicated, are updated shard-locally: the bits of
    # the update on the device (README); those sharded on a later axis are gathered for the host
    # computation and may differ by ulps.
    for k in ("rows", "rep"):
      assert bits_equal(results[2][k], results[0][k]), k


@pytest.mark.parametrize("case", ["host_param_first", "init_again_elsewhere"])
def test_the_state_follows_the_latest_init_as_spelled(case):
  """Two placements the pinning (above) first got wrong, found in review: a param in pinned host
  memory spelled with a trailing None, the step's first input (jax spells outputs equivalent to it
  as it: its state must keep that spelling), and a second init of the same tx with the params
  placed otherwise (the update pinned the state, and the params, to the first init's)."""
  mesh = jax.make_mesh(
    (4,), ("x",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)
  )
  rng = np.random.default_rng(0)
  host = {
    "a": (0.1 * rng.normal(size=(4, 64, 64))).astype(np.float32),
    "b": (0.1 * rng.normal(size=(64, 64))).astype(np.float32),
  }
  if case == "host_param_first":
    specs = {"a": (P(None, "x", None), "pinned_host"), "b": (P("x"), "device")}
  else:
    specs = {"a": (P("x"), "device"), "b": (P("x"), "device")}

  def put(tree, kinds=True):
    return {
      k: jax.device_put(
        x, NamedSharding(mesh, specs[k][0], memory_kind=specs[k][1] if kinds else "device")
      )
      for k, x in tree.items()
    }

  tx = oo.offload(optax.adam(1e-2), min_size=1024)
  if case == "init_again_elsewhere":
    tx.init(jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), host))
  params = put(host)
  state = tx.init(params)
  placed = jax.tree.map(lambda x: x.sharding, (params, state))
  step = jax.jit(lambda p, s, g: oo.update_and_apply(tx, g, s, p))
  for t in range(3):
    params, state = step(params, state, put(make_grads(host, t), kinds=False))
  assert jax.tree.map(lambda x: x.sharding, (params, state)) == placed
  assert step._cache_size() == 1


def test_the_host_update_on_explicit_axes_gathers_as_on_auto_axes():
  """update_on="host" on a 2-D mesh: a leaf sharded along both axes crosses to the host gathered
  along its later axis only, as XLA gathers it on Auto axes (it was gathered whole, to every
  device, before review)."""
  rng = np.random.default_rng(0)
  host = {"b": (0.1 * rng.normal(size=(64, 128))).astype(np.float32)}
  gathers = {}
  for kind in ("Auto", "Explicit"):
    mesh = jax.make_mesh(
      (2, 2),
      ("data", "model"),
      devices=jax.devices()[:4],
      axis_types=(getattr(jax.sharding.AxisType, kind),) * 2,
    )
    params = {"b": jax.device_put(host["b"], NamedSharding(mesh, P("data", "model")))}
    tx = oo.offload(optax.adam(1e-2), min_size=1024, update_on="host")
    step = jax.jit(lambda p, s, g, tx=tx: oo.update_and_apply(tx, g, s, p))
    text = step.lower(params, tx.init(params), params).compile().as_text()
    gathers[kind] = sorted(re.findall(r"= (\S+) all-gather(?:-start)?\(", text))
  assert gathers["Auto"], "the pattern finds XLA's gathers"
  assert gathers["Explicit"] == gathers["Auto"]


@pytest.mark.parametrize("ambient", [True, False], ids=["set_mesh", "no_mesh"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_offloaded_scan_with_a_sharded_carry(tmp_path, axis_type, ambient):
  """The carry sharded over the mesh, the stack replicated in pinned host memory or on NVMe, per-
  layer outputs sharded too: values and gradients (carry, stack) are the plain scan's on the same
  mesh. On Explicit axes the backward failed before ("dynamic_update_slice operand sharding must
  be equal to update sharding"): the residual and output buffers now carry the carry's sharding,
  and a replicated gradient block is placed as its buffer."""
  import contextlib

  n, d = 3, 8
  mesh = jax.make_mesh((4,), ("x",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  rng = np.random.default_rng(0)
  w = (rng.normal(size=(n, d, d)) * 0.3).astype(np.float32)
  x_np = rng.normal(size=(8, d)).astype(np.float32)
  body = lambda x, p: (jnp.tanh(x @ p["w"]), x * 2)  # noqa: E731
  on_nvme = oo.write_nvme_stack(tmp_path / "w", {"w": w})
  try:
    with jax.set_mesh(mesh) if ambient else contextlib.nullcontext():
      x = jax.device_put(x_np, NamedSharding(mesh, P("x")))
      replicated = NamedSharding(mesh, P())
      stacks = {
        "plain": {"w": jax.device_put(w, replicated)},
        "pinned": {"w": jax.device_put(w, replicated.with_memory_kind("pinned_host"))},
        "nvme": on_nvme,
      }

      def loss(s, x, scan):
        y, ys = scan(body, x, s)
        return jnp.sum(y**2) + jnp.sum(ys)

      plain = lambda f, c, s: jax.lax.scan(jax.checkpoint(f), c, s)  # noqa: E731
      got = {}
      for name, s in stacks.items():
        scan = plain if name == "plain" else oo.offloaded_scan
        grad = jax.value_and_grad(
          functools.partial(loss, scan=scan), argnums=(1, 0), allow_int=True
        )
        got[name] = jax.block_until_ready(jax.jit(grad)(s, x))
    value, (gx, gs) = got["plain"]
    for name in ("pinned", "nvme"):
      v, (gx2, gs2) = got[name]
      np.testing.assert_array_equal(np.asarray(v), np.asarray(value), err_msg=name)
      np.testing.assert_array_equal(np.asarray(gx2), np.asarray(gx), err_msg=name)
      assert gx2.sharding.is_equivalent_to(gx.sharding, 2), (name, gx2.sharding, gx.sharding)
      assert gx.sharding.is_equivalent_to(NamedSharding(mesh, P("x")), 2)
    np.testing.assert_array_equal(np.asarray(got["pinned"][1][1]["w"]), np.asarray(gs["w"]))
  finally:
    oo.close_nvme_stack(on_nvme)


@pytest.mark.parametrize("ambient", [True, False], ids=["set_mesh", "no_mesh"])
@pytest.mark.parametrize(
  "axis_types, carry, stack",
  [
    (("Explicit",), P("x"), P(None, None, "x")),  # a stack leaf sharded on its feature axis
    (("Explicit", "Auto"), P("x"), P(None, None, "y")),  # a mesh mixing the axis types
    (("Explicit", "Auto"), P("x", None), P(None, None, "x")),
  ],
)
def test_offloaded_scan_with_a_sharded_stack_leaf(axis_types, carry, stack, ambient):
  """The stack's leaf sharded over the mesh, per-layer outputs too: values and gradients are the
  plain scan's on the same mesh, bit for bit (a helper's review found both failing: the first
  gradient block of the backward loop was replicated while the layers' gradients are sharded,
  under jax.set_mesh; and on a mesh mixing Explicit and Auto axes jax.eval_shape drops the
  per-layer output's sharding, so its buffer was replicated)."""
  import contextlib

  types = tuple(getattr(jax.sharding.AxisType, t) for t in axis_types)
  shape, names = ((4,), ("x",)) if len(types) == 1 else ((2, 2), ("x", "y"))
  mesh = jax.make_mesh(shape, names, axis_types=types)
  rng = np.random.default_rng(0)
  x_np = rng.normal(size=(8, 16)).astype(np.float32)
  w = (rng.normal(size=(3, 16, 16)) * 0.3).astype(np.float32)
  whole = NamedSharding(mesh, P())
  body = lambda x, w: (jnp.tanh(x @ jax.sharding.reshard(w, whole)), x.sum(-1))  # noqa: E731
  plain = lambda f, c, s: jax.lax.scan(jax.checkpoint(f), c, s)  # noqa: E731
  got = {}
  with jax.set_mesh(mesh) if ambient else contextlib.nullcontext():
    x = jax.device_put(x_np, NamedSharding(mesh, carry))
    for name, kind, scan in (
      ("plain", None, plain),
      ("offloaded", "pinned_host", oo.offloaded_scan),
    ):
      s = jax.device_put(w, NamedSharding(mesh, stack, memory_kind=kind))

      def loss(s, x, scan=scan):
        y, ys = scan(body, x, s)
        return jnp.sum(y**2) + jnp.sum(ys)

      out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(s, x)
      got[name] = [
        np.asarray(jax.device_put(a, a.sharding.with_memory_kind("device")))
        for a in jax.tree.leaves(out)
      ]
  for a, b in zip(got["offloaded"], got["plain"], strict=True):
    np.testing.assert_array_equal(a, b)
