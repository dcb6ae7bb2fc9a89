"""Flax NNX setups shared by tests/test_nnx.py, and their child process (a fresh process to resume in).

Usage:
  python nnx_child.py resume TIER CKPT_DIR STEP NVME_DIR OUT
    Builds a new model and optimizer (state in TIER), restores checkpoint STEP of CKPT_DIR into
    them, trains MORE_STEPS steps and writes the result (params, plain optimizer state and step
    count, as bytes) to OUT (npz).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import optax_offload as oo

MORE_STEPS = 2
TIERS = ("host", "nvme")


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(64, 256, rngs=rngs)  # 16384 weights: state offloaded
    self.down = nnx.Linear(256, 10, rngs=rngs)  # 2560 weights < min_size: state on device

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def make(tier: str, nvme_dir=None, seed: int = 0):
  """A model and its optimizer (adamw) with the state in `tier`; "plain": plain optax.

  Params and the optimizer's step count are committed to the device, as the NNX guide says, so
  that the train step compiles once.
  """
  device = jax.devices()[0]
  model = MLP(nnx.Rngs(seed))
  nnx.update(model, jax.device_put(nnx.state(model), device))
  inner = optax.adamw(1e-2, weight_decay=1e-2)
  if tier == "plain":
    tx = inner
  elif tier == "host":
    tx = oo.offload(inner)
  elif tier == "nvme":
    tx = oo.offload(inner, host_limit=0, nvme_dir=str(nvme_dir))
  else:
    raise ValueError(tier)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  optimizer.step.set_value(jax.device_put(optimizer.step.get_value(), device))
  return model, optimizer


def make_train_step():
  @nnx.jit(donate_argnames=("model", "optimizer"))
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return train_step


def batch(t: int):
  rng = np.random.default_rng(t)
  return jnp.asarray(rng.normal(size=(8, 64)), jnp.float32), jnp.asarray(rng.integers(0, 10, 8))


def train(train_step, model, optimizer, start: int, stop: int) -> None:
  for t in range(start, stop):
    train_step(model, optimizer, *batch(t))


def save_args(model, optimizer):
  return ocp.args.Composite(
    model=ocp.args.StandardSave(nnx.state(model)),
    optimizer=oo.OffloadSave(nnx.state(optimizer)),
  )


def restore(ckpt_dir, step: int, model, optimizer) -> None:
  """Restores checkpoint `step` into `model` and `optimizer` (their placement)."""
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    restored = mngr.restore(
      step,
      args=ocp.args.Composite(
        model=ocp.args.StandardRestore(nnx.state(model)),
        optimizer=oo.OffloadRestore(nnx.state(optimizer)),
      ),
    )
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])


def plain_state(optimizer):
  """The optimizer's state as plain optax state."""
  return oo.to_inner(nnx.as_pure(optimizer.opt_state))


def result(model, optimizer) -> dict[str, np.ndarray]:
  """Params, plain optimizer state and step count as raw bytes per leaf."""
  leaves = jax.tree.leaves(
    (nnx.as_pure(nnx.state(model)), plain_state(optimizer), optimizer.step.get_value())
  )
  return {
    f"leaf{i:04d}": np.atleast_1d(np.ascontiguousarray(np.asarray(x))).view(np.uint8).ravel()
    for i, x in enumerate(leaves)
  }


def resume(tier: str, ckpt_dir: str, step: int, nvme_dir: str, out: str) -> None:
  model, optimizer = make(
    tier, nvme_dir, seed=1
  )  # other initial values: all come from the checkpoint
  restore(ckpt_dir, step, model, optimizer)
  train(make_train_step(), model, optimizer, step, step + MORE_STEPS)
  np.savez(out, **result(model, optimizer))
  oo.close_nvme(nnx.as_pure(optimizer.opt_state))
  print("done", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "resume":
    resume(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
  else:
    raise SystemExit(__doc__)
