"""One process of a 2-process CPU run on loopback (2 devices each), or the 1-process 4-device reference.

Usage: python multiprocess_child.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
Trains make_params() sharded over a 4-device mesh for 10 steps with offloaded (host-tier) AdamW and
writes the gathered params and this process's footprint to OUT_DIR.
"""

import json
import os
import sys

process_id, num_processes, port, out_dir = (
  int(sys.argv[1]),
  int(sys.argv[2]),
  sys.argv[3],
  sys.argv[4],
)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // num_processes}"

import jax  # noqa: E402

if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
  )

import numpy as np  # noqa: E402
import optax  # noqa: E402
from conftest import make_grads  # noqa: E402
from conftest import make_params  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_offload as oo  # noqa: E402

SPECS = {
  "embed": P("fsdp"),
  "dense": {"kernel": P(None, "fsdp"), "bias": P()},
  "conv": P(None, None, None, "fsdp"),
  "big": P("fsdp"),
  "scale": P(),
}


def global_array(x, spec, mesh):
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def main():
  mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices())
  host_params = make_params()
  params = jax.tree.map(lambda x, s: global_array(x, s, mesh), host_params, SPECS)
  tx = oo.offload(optax.adamw(1e-2), window_bytes=100_000)
  state = tx.init(params)

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for t in range(10):
    grads = jax.tree.map(lambda x, s: global_array(x, s, mesh), make_grads(host_params, t), SPECS)
    params, state = step(params, state, grads)
  kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.inner[0].mu)})
  gathered = multihost_utils.process_allgather(params, tiled=True)
  mu = multihost_utils.process_allgather(oo.to_inner(state, memory_kind="device")[0].mu, tiled=True)
  flat = {
    jax.tree_util.keystr(k): np.asarray(v)
    for k, v in jax.tree_util.tree_leaves_with_path((gathered, mu))
  }
  if process_id == 0:
    np.savez(os.path.join(out_dir, "result.npz"), **flat)
  with open(os.path.join(out_dir, f"footprint_{process_id}.json"), "w") as f:
    json.dump({"footprint": oo.footprint(state), "memory_kinds": kinds}, f)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
