"""Setups shared by the checkpoint tests, and their child process (a fresh process, or one to kill).

Usage:
  python checkpoint_child.py resume CASES_JSON
    For each case (a dict: opt, tier, ckpt, step, nvme_dir, out): restores the checkpoint into a
    fresh `offload` state, trains `RESUME_STEPS` steps and writes the result to `out` (npz).
  python checkpoint_child.py standard CKPT_DIR STEP OUT
    Restores params and a host-tier adamw state saved with Orbax's StandardCheckpointer, by its
    documented recipe (ShapeDtypeStructs with the target's shardings), checks the restored state
    is placed as `tx.init`'s (memory kinds and types), trains `RESUME_STEPS` jitted steps and
    writes the result to OUT (npz).
  python checkpoint_child.py train CKPT_DIR NVME_DIR EVERY [slow_link]
    Trains adamw with host and NVMe tiers, checkpointing every EVERY steps, until killed. Prints
    "ready" once compiled and "save N" before each (asynchronous) save. With slow_link, linking
    each NVMe array into a checkpoint takes a second more.
"""

import json
import sys
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from conftest import make_grads
from conftest import make_params
from helpers import nvme_optimizers

import optax_offload as oo

WINDOW = 100_000  # several groups for make_params()
RESUME_STEPS = 5
TIERS = ("device", "host", "nvme", "mixed")
# name -> (inner factory, host_limit that keeps some leaves on host and sends the rest to NVMe): the
# NVMe rows of `helpers.OPTIMIZERS`, and adamw wrapped by `make_tx` in a chain and in MultiSteps.
_OPTIMIZERS = {o.name: (o.make, o.nvme_host_limit) for o in nvme_optimizers()}
_OPTIMIZERS |= {f"{w}_adamw": _OPTIMIZERS["adamw"] for w in ("chain_clip", "multisteps")}
OPTIMIZERS = tuple(_OPTIMIZERS)


def offload_kwargs(opt: str, tier: str, nvme_dir) -> dict:
  """`offload` arguments that put the state of `opt` in `tier` (mixed: device, host and NVMe)."""
  if tier == "device":
    return {"min_size": 1 << 40}
  if tier == "host":
    return {}
  if tier == "nvme":
    return {"host_limit": 0, "nvme_dir": str(nvme_dir)}
  if tier == "mixed":
    return {"host_limit": _OPTIMIZERS[opt][1], "nvme_dir": str(nvme_dir)}
  raise ValueError(tier)


def make_tx(opt: str, tier: str, nvme_dir=None, **overrides):
  """The optimizer `opt` with its state in `tier`; chain and MultiSteps wrap the offload.

  The separability check is skipped: it is tested elsewhere and costs seconds per instance here.
  """
  kwargs = {
    "window_bytes": WINDOW,
    "check_separable": False,
    **offload_kwargs(opt, tier, nvme_dir),
    **overrides,
  }
  off = oo.offload(_OPTIMIZERS[opt][0](), **kwargs)
  if opt == "chain_clip_adamw":
    return optax.chain(optax.clip_by_global_norm(1.0), off)
  if opt == "multisteps_adamw":  # every 3 steps: 5 steps end mid-accumulation
    return optax.MultiSteps(off, every_k_schedule=3)
  return off


def committed_params():
  """`make_params()` committed to one device, so the first two steps share one compilation."""
  return jax.device_put(make_params(), jax.devices()[0])


def make_step(tx):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def run(step, params, state, start: int, stop: int):
  for t in range(start, stop):
    params, state = step(params, state, make_grads(params, t))
  return params, state


def save_args(params, state):
  return ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=oo.OffloadSave(state))


def restore_args(params, target_state):
  return ocp.args.Composite(
    params=ocp.args.StandardRestore(params), opt_state=oo.OffloadRestore(target_state)
  )


def result(params, state) -> dict[str, np.ndarray]:
  """Params and plain state as raw bytes per leaf (for bit comparisons across processes)."""
  leaves = jax.tree.leaves((params, oo.to_inner(state)))
  return {
    f"leaf{i:04d}": np.atleast_1d(np.ascontiguousarray(np.asarray(x))).view(np.uint8).ravel()
    for i, x in enumerate(leaves)
  }


def placement(state):
  """Type (memory space included) and sharding (memory kind included) of every leaf."""
  return jax.tree.map(lambda x: (jax.typeof(x), x.sharding), state)


def resume(cases_json: str) -> None:
  params = committed_params()
  for case in json.loads(cases_json):
    tx = make_tx(case["opt"], case["tier"], case["nvme_dir"])
    target = tx.init(params)
    with ocp.CheckpointManager(case["ckpt"]) as mngr:
      restored = mngr.restore(case["step"], args=restore_args(params, target))
    p, s = restored["params"], restored["opt_state"]
    if placement(s) != placement(target):
      raise AssertionError(f"{case}: the restored state is not placed like the target")
    p, s = run(make_step(tx), p, s, case["step"], case["step"] + RESUME_STEPS)
    np.savez(case["out"], **result(p, s))
    oo.close_nvme(s)
  print("done", flush=True)


def standard(ckpt_dir: str, step: int, out: str) -> None:
  params = committed_params()
  tx = make_tx("adamw", "host")
  target = {"p": params, "s": tx.init(params)}
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
  )
  restored = ocp.StandardCheckpointer().restore(ckpt_dir, abstract)
  if placement(restored["s"]) != placement(target["s"]):
    raise AssertionError("the restored state is not placed (typed) like tx.init's")
  p, s = run(make_step(tx), restored["p"], restored["s"], step, step + RESUME_STEPS)
  np.savez(out, **result(p, s))
  print("done", flush=True)


def train(ckpt_dir: str, nvme_dir: str, every: int, slow_link: bool = False) -> None:
  if slow_link:  # a slow copy of the NVMe files: a kill lands inside the save's background part
    from optax_offload._src import checkpoint

    link_tree = checkpoint._link_tree

    def slow(*args, **kwargs):
      time.sleep(1.0)
      return link_tree(*args, **kwargs)

    checkpoint._link_tree = slow
  params = committed_params()
  tx = make_tx("adamw", "mixed", nvme_dir)
  step = make_step(tx)
  state = tx.init(params)
  mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=3))
  for t in range(100_000):
    params, state = step(params, state, make_grads(params, t))
    jax.block_until_ready(state)
    if t == 1:
      print("ready", flush=True)
    if (t + 1) % every == 0:
      print(f"save {t + 1}", flush=True)
      mngr.save(t + 1, args=save_args(params, state))  # async: completes while training goes on


if __name__ == "__main__":
  if sys.argv[1] == "resume":
    resume(sys.argv[2])
  elif sys.argv[1] == "standard":
    standard(sys.argv[2], int(sys.argv[3]), sys.argv[4])
  elif sys.argv[1] == "train":
    train(sys.argv[2], sys.argv[3], int(sys.argv[4]), slow_link=sys.argv[5:] == ["slow_link"])
  else:
    raise SystemExit(__doc__)
