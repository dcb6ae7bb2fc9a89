"""One derivation of the plan: `estimate` plans a tree exactly as `offload` does.

`offload` (at init) and `estimate` (before a run) both derive the plan of a parameter tree through
`tree_plan.plan_tree`. These tests hold them to it: for the same shapes, dtypes, shardings and
options, `estimate`'s leaves and plan equal those `offload` builds, and its bytes per tier equal
`oo.footprint` of the state `offload` makes, on a sharded mesh, with row slices, master weights,
weights in host memory and state arrays under `min_size` inside large leaves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_offload as oo
from optax_offload._src import offload as offload_lib
from optax_offload._src import plan as plan_lib

HANDLES = 2 * 4  # OffloadState's int32 store id and generation, not optimizer state


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))


def _offload_plan(tx):
  """The plan `offload` built at init (the one tree `tx` was initialised with)."""
  (setup,) = offload_lib._OFFLOADED[tx.update].setups.values()
  return setup


def _shapes(params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)


def _sharded_params():
  mesh = _mesh()

  def put(shape, spec, dtype=jnp.float32):
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))

  return {
    "rows_sharded": put((64, 512), P("d", None)),  # leading axis sharded: never row-sliced
    "cols_sharded": put((64, 512), P(None, "d")),  # leading axis whole: row slices allowed
    "replicated": put((32, 256), P()),  # a copy on each of the 4 devices
    "bias": put((512,), P()),  # under min_size: its state stays on the device
  }


CASES = {
  # A window that slices the big leaves into rows where their sharding allows it.
  "sharded_mesh_row_slices": dict(
    params=_sharded_params,
    optimizer=lambda: optax.adam(1e-3),
    kwargs=dict(window_bytes="40KiB"),
    devices=4,  # the state's shared leaves and handles are replicated over the mesh
  ),
  "master_weights_bf16": dict(
    params=lambda: {
      "w": jnp.ones((256, 128), jnp.bfloat16),
      "v": jnp.ones((128, 64), jnp.float32),  # as wide as the master: no master copy
      "b": jnp.ones((128,), jnp.bfloat16),
    },
    optimizer=lambda: optax.adamw(1e-3),
    kwargs=dict(master_dtype=jnp.float32, window_bytes="256KiB"),
    devices=1,
  ),
  # adafactor keeps a (1,) placeholder and factored vectors under min_size beside large leaves:
  # they stay on the device, so the plan must not count them as host bytes.
  "small_arrays_in_large_leaves": dict(
    params=lambda: {"w": jnp.ones((512, 256)), "x": jnp.ones((64, 96))},
    optimizer=lambda: optax.adafactor(1e-3),
    kwargs=dict(window_bytes="1MiB"),
    devices=1,
  ),
}


@pytest.mark.parametrize("case", CASES)
def test_estimate_plans_as_offload_does(case):
  c = CASES[case]
  params = c["params"]()
  kwargs = c["kwargs"]
  tx = oo.offload(c["optimizer"](), **kwargs)
  state = tx.init(params)
  setup = _offload_plan(tx)
  e = oo.estimate(_shapes(params), optimizer=c["optimizer"](), **kwargs)
  assert e.leaves == setup.leaves
  assert e.plan == setup.plan
  footprint = oo.footprint(state)
  assert e.host_bytes == footprint["host"] == setup.plan.bytes_per_tier["host"]
  assert e.device_state_bytes + HANDLES * c["devices"] == footprint["device"]


def test_sharded_leaves_are_sliced_only_along_unsharded_rows():
  params = _sharded_params()
  e = oo.estimate(_shapes(params), optimizer=optax.adam(1e-3), window_bytes="40KiB")
  sliced = {e.leaves[p.leaf].path for unit in e.plan.units for p in unit if not p.whole}
  assert sliced == {"['cols_sharded']", "['replicated']"}  # not rows_sharded
  # Per process: the shards of the sharded leaves, and a copy per device of the replicated one.
  mu_nu = 2 * 4
  assert e.host_bytes == mu_nu * (64 * 512 + 64 * 512 + 4 * 32 * 256)
  state = oo.offload(optax.adam(1e-3), window_bytes="40KiB").init(params)
  assert oo.footprint(state)["host"] == e.host_bytes


def test_device_state_matches_footprint_on_one_device():
  params = {"w": jnp.ones((512, 256)), "b": jnp.ones((256,))}
  for opt in (optax.adam(1e-3), optax.adafactor(1e-3)):
    e = oo.estimate(_shapes(params), optimizer=opt)
    footprint = oo.footprint(oo.offload(opt).init(params))
    assert (e.host_bytes, e.device_state_bytes + HANDLES) == (
      footprint["host"],
      footprint["device"],
    )


def test_weights_in_host_memory_stream_with_their_state():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  device = NamedSharding(mesh, P())
  params = {
    "layers": jax.device_put(jnp.ones((8, 128, 128), jnp.bfloat16), host),
    "head": jax.device_put(jnp.ones((128, 256), jnp.bfloat16), device),
  }
  kwargs = dict(master_dtype=jnp.float32, window_bytes="1MiB")
  tx = oo.offload(optax.adamw(1e-3), **kwargs)
  tx.init(params)
  setup = _offload_plan(tx)
  e = oo.estimate(_shapes(params), optimizer=optax.adamw(1e-3), **kwargs)
  assert e.weights_on == "host"
  assert e.leaves == setup.leaves and e.plan == setup.plan
  layers = e.leaves[[leaf.path for leaf in e.leaves].index("['layers']")]
  assert layers.moving_bytes == 2 * 8 * 128 * 128 * 2
  assert len(e.plan.units) > 1 and layers.rows == 8


def test_shapes_on_an_abstract_mesh_plan_as_on_devices():
  # Planning before devices exist: one process is taken to hold the whole mesh.
  params = _sharded_params()
  abstract = jax.sharding.AbstractMesh((4,), ("d",))
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(abstract, x.sharding.spec)
    ),
    params,
  )
  kwargs = dict(optimizer=optax.adam(1e-3), window_bytes="40KiB")
  e, want = oo.estimate(shapes, **kwargs), oo.estimate(_shapes(params), **kwargs)
  assert e.plan == want.plan and e.leaves == want.leaves
  assert e.device_state_bytes == want.device_state_bytes


@pytest.mark.parametrize("row_bytes", [1000, 4096])
def test_row_slices_fit_the_budget_and_align_to_pairs_of_layers(row_bytes):
  # Every way of slicing 1-50 rows: slices of one row or an even number (so the pairs of layers
  # that the update in the backward pass updates never straddle two), within the budget, equal
  # but the last, and covering the rows; the most rows that fit when no division does.
  for rows in range(2, 51):
    nbytes = rows * row_bytes
    for budget in range(row_bytes, nbytes, max(1, row_bytes // 3)):
      leaf = plan_lib.LeafInfo("x", rows, nbytes, rows=rows)
      bounds = [(p.start, p.stop) for p in plan_lib._pieces([leaf], [plan_lib.Tier.HOST], budget)]
      sizes = [b - a for a, b in bounds]
      assert bounds[0][0] == 0 and bounds[-1][1] == rows, (rows, budget, bounds)
      assert all(x[1] == y[0] for x, y in zip(bounds, bounds[1:])), (rows, budget, bounds)
      assert sizes[0] == 1 or sizes[0] % 2 == 0, (rows, budget, bounds)
      assert all(s == sizes[0] for s in sizes[:-1]) and 0 < sizes[-1] <= sizes[0]
      assert -(-nbytes * sizes[0] // rows) <= budget, (rows, budget, bounds)
  # 9 rows that fit 4 to a slice: 4, 4 and 1 (not 2, 2, 2, 2, 1); 40 that fit 5: 10 slices of 4.
  leaf = plan_lib.LeafInfo("x", 9, 9000, rows=9)
  assert [p.stop for p in plan_lib._pieces([leaf], [plan_lib.Tier.HOST], 4000)] == [4, 8, 9]
  leaf = plan_lib.LeafInfo("x", 40, 40000, rows=40)
  assert len(plan_lib._pieces([leaf], [plan_lib.Tier.HOST], 5000)) == 10
