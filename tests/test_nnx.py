"""Flax NNX: `nnx.Optimizer` with offloaded state (host and NVMe tiers), its checkpoints, compiles."""

import logging

import jax
import nnx_child as child
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import bits_equal
from flax import nnx
from helpers import run_child

import optax_offload as oo

TIERS = ["host", "nvme"]


def _close(optimizer) -> None:
  oo.close_nvme(nnx.as_pure(optimizer.opt_state))


@pytest.mark.parametrize("tier", TIERS)
def test_nnx_optimizer_equals_plain_optax_bit_for_bit(tier, tmp_path):
  # One group (the default window holds the whole state): bit-identical to plain optax.
  plain_model, plain_opt = child.make("plain")
  model, optimizer = child.make(tier, tmp_path)
  try:
    for m, o in ((plain_model, plain_opt), (model, optimizer)):
      child.train(child.make_train_step(), m, o, 0, 3)
    assert bits_equal(nnx.state(plain_model), nnx.state(model))
    assert bits_equal(nnx.as_pure(plain_opt.opt_state), child.plain_state(optimizer))
    assert int(optimizer.step.get_value()) == 3
    named = oo.tiers(nnx.as_pure(optimizer.opt_state)).inner[0].mu
    assert named["up"]["kernel"] == tier and named["down"]["kernel"] == "device"
  finally:
    _close(optimizer)


@pytest.mark.parametrize("tier", TIERS)
def test_checkpoint_manager_resume_is_bit_exact(tier, tmp_path):
  train_step = child.make_train_step()
  model, optimizer = child.make(tier, tmp_path / "nvme")
  child.train(train_step, model, optimizer, 0, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=child.save_args(model, optimizer))
    mngr.wait_until_finished()
  child.train(train_step, model, optimizer, 3, 3 + child.MORE_STEPS)
  want = child.result(model, optimizer)
  _close(optimizer)
  # A new model and optimizer (another offload instance and nvme_dir), as a new run builds them.
  model, optimizer = child.make(tier, tmp_path / "nvme_b", seed=1)
  child.restore(tmp_path / "ckpt", 3, model, optimizer)
  assert int(optimizer.step.get_value()) == 3
  child.train(child.make_train_step(), model, optimizer, 3, 3 + child.MORE_STEPS)
  got = child.result(model, optimizer)
  _close(optimizer)
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("tier", TIERS)
def test_restore_in_a_fresh_process(tier, tmp_path):
  model, optimizer = child.make(tier, tmp_path / "nvme")
  train_step = child.make_train_step()
  child.train(train_step, model, optimizer, 0, 3)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=child.save_args(model, optimizer))
    mngr.wait_until_finished()
  child.train(train_step, model, optimizer, 3, 3 + child.MORE_STEPS)
  want = child.result(model, optimizer)
  _close(optimizer)
  out = tmp_path / "out.npz"
  args = ["resume", tier, str(tmp_path / "ckpt"), "3", str(tmp_path / "nvme_b"), str(out)]
  proc = run_child("nnx_child.py", *args)
  assert "done" in proc.stdout, proc.stderr[-3000:]
  got = dict(np.load(out))
  assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_nnx_state_with_an_nvme_tier_saves_and_restores(tmp_path):
  # The NVMe tier's arrays sit in nnx.state(optimizer) as empty placeholders inside Variables,
  # under a mapping of OffloadState's fields: OffloadSave finds them, OffloadRestore refills them.
  # (No update on the NVMe tier here: restores write its store.)
  model, optimizer = child.make("host")
  child.train(child.make_train_step(), model, optimizer, 0, 2)
  with ocp.CheckpointManager(tmp_path / "a") as mngr:
    mngr.save(2, args=child.save_args(model, optimizer))
    mngr.wait_until_finished()
  model_n, opt_n = child.make("nvme", tmp_path / "nvme")
  child.restore(tmp_path / "a", 2, model_n, opt_n)
  try:
    assert oo.footprint(nnx.as_pure(opt_n.opt_state))["nvme"] > 0
    assert nnx.as_pure(opt_n.opt_state).inner[0].mu["up"]["kernel"].shape == (0,)
    with ocp.CheckpointManager(tmp_path / "b") as mngr:
      mngr.save(2, args=child.save_args(model_n, opt_n))
      mngr.wait_until_finished()
  finally:
    _close(opt_n)
  model_h, opt_h = child.make("host", seed=1)
  child.restore(tmp_path / "b", 2, model_h, opt_h)
  assert int(opt_h.step.get_value()) == 2
  assert bits_equal(child.plain_state(optimizer), child.plain_state(opt_h))
  assert bits_equal(nnx.state(model), nnx.state(model_h))


class _CompileCounter(logging.Handler):
  def __init__(self, name: str):
    super().__init__()
    self.name, self.count = name, 0

  def emit(self, record: logging.LogRecord) -> None:
    if f"Compiling jit({self.name})" in record.getMessage():
      self.count += 1


@pytest.mark.parametrize("tier", TIERS)
def test_train_step_compiles_once(tier, tmp_path):
  # With params and optimizer.step committed before the first step (child.make), every step's
  # inputs have the placement, commitment and types of the step's outputs.
  model, optimizer = child.make(tier, tmp_path)
  train_step = child.make_train_step()
  counter = _CompileCounter("train_step")
  logger = logging.getLogger("jax._src.interpreters.pxla")
  logger.addHandler(counter)
  try:
    with jax.log_compiles():
      child.train(train_step, model, optimizer, 0, 4)
  finally:
    logger.removeHandler(counter)
    _close(optimizer)
  assert counter.count == 1


def test_rng_keys_in_wrt_are_refused_saying_what_to_pass():
  # wrt=nnx.Variable takes the Dropout's rng key too: jnp.dtype failed on it ("Cannot interpret
  # 'key<fry>' as a data type", helper review /tmp/revH).
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 4, rngs=rngs)
      self.dropout = nnx.Dropout(0.1, rngs=rngs)

  model = Model(nnx.Rngs(0, dropout=1))
  with pytest.raises(TypeError, match=r"PRNG keys \(.*dropout.*wrt=nnx.Param"):
    nnx.Optimizer(model, oo.offload(optax.adamw(1e-3)), wrt=nnx.Variable)
  nnx.Optimizer(model, oo.offload(optax.adamw(1e-3)), wrt=nnx.Param)
