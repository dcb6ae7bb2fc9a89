"""examples/consumer_13b.py (docs/consumer.md) at a CPU size: the plan's bytes and the run's agree."""

import logging
import pathlib

import jax
import numpy as np
import pytest
from helpers import consumer_example
from helpers import gpu_compile_or_skip

import optax_offload as oo
from optax_offload._src import compress
from optax_offload._src import inspection

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--size", "tiny", "--steps", "3", "--lr", "1e-2"]


def _example():
  return consumer_example()


@pytest.fixture(scope="module")
def host_run():
  """The script with its state in host memory only (--no-nvme)."""
  return _example().main([*TINY, "--no-nvme"])


def test_the_script_trains_with_the_state_in_host_memory(host_run):
  losses = host_run["losses"]
  assert len(losses) == 3 and np.all(np.isfinite(losses))
  assert losses[-1] < losses[0]  # byte statistics are learnt within a few steps at lr 1e-2
  # The runtime holds what the plan said: the optimizer state and master copy in host memory
  # (the plan's host bytes less the stack's bf16 weights), small leaves' state on the device.
  module = _example()
  cfg = module.SIZES["tiny"]
  stack = cfg.layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d) * 2
  assert host_run["footprint"]["nvme"] == 0
  assert host_run["footprint"]["host"] == host_run["plan"]["host"] - stack
  assert host_run["params"]["layers"]["wq"].sharding.memory_kind == "pinned_host"


def test_the_script_trains_with_the_state_on_nvme_and_resumes_from_its_checkpoint(
  host_run, tmp_path
):
  # --ckpt-dir: a run stopped after 2 steps and run again to 3 goes on from its checkpoint (the
  # params, and the optimizer state with its NVMe data, restored into the new run's store) and
  # ends where the run in one go ends (a rerun started afresh before, helper review /tmp/revK).
  argv = [*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB"]
  argv += ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "1"]
  first = _example().main([*argv, "--steps", "2"])
  oo.close_nvme(first["state"])
  second = _example().main([*argv, "--steps", "3"])
  try:
    for run in (first, second):
      assert run["footprint"]["nvme"] > 0 and run["footprint"]["host"] <= 64 * 1024
    assert any((tmp_path / "run1").iterdir())
    assert len(first["losses"]) == 2 and len(second["losses"]) == 1
    # The tier holding the state does not change the numbers (DESIGN.md, numerics rule 1), nor
    # does the checkpoint between the steps.
    np.testing.assert_allclose(first["losses"] + second["losses"], host_run["losses"], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(second["params"]), jax.tree.leaves(host_run["params"])):
      np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-2, atol=1e-6)
  finally:
    oo.close_nvme(second["state"])


def test_the_script_accumulates_with_8bit_moments_and_leaves_kept_on_the_card(tmp_path):
  # The page's 48 GiB configuration at the CPU size: micro-batches accumulated in bf16, 8-bit
  # moments on the drive, wq and wo kept on the device beside the streamed stack; the head's
  # moments in fp32 (--head-moment-dtype: its blocks along the vocabulary, docs/tiers.md).
  run = _example().main(
    [*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB", "--accumulate", "2",
     "--accumulator-dtype", "bf16", "--moment-dtype", "int8", "--device-leaves", "wq,wo",
     "--head-moment-dtype", "fp32"]
  )  # fmt: skip
  try:
    assert np.all(np.isfinite(run["losses"])) and run["footprint"]["nvme"] > 0
    memory = {k: x.sharding.memory_kind for k, x in run["params"]["layers"].items()}
    assert memory["wq"] == memory["wo"] == "device" and memory["w_gate"] == "pinned_host"
    adam = inspection._materialized(run["state"]).inner.inner_states
    assert adam["head"].inner_state[0].nu["head"].dtype == np.float32
    assert compress.is_quantized(adam["rest"].inner_state[0].nu["layers"]["w_gate"])
    assert run["footprint"]["nvme"] == run["plan"]["nvme"]  # the plan counts the mixed state
  finally:
    oo.close_nvme(run["state"])


def test_the_script_compiles_its_step_for_a_gpu_without_allocating(tmp_path):
  # --compile-for: the step with its NVMe callbacks, compiled for the 4090 from the shapes alone
  # (docs/consumer.md cites the 13B figure); the drive gets no state.
  gpu_compile_or_skip()
  run = _example().main(
    [*TINY, "--nvme-dir", str(tmp_path / "run1"), "--host-limit", "64KiB", "--accumulate", "2",
     "--moment-dtype", "int8", "--device-leaves", "wq,wo", "--compile-for", "rtx4090_24gb"]
  )  # fmt: skip
  assert run["device_bytes"] > 0 and run["callbacks"] > 0
  assert "losses" not in run
  written = [p for p in (tmp_path / "run1").rglob("*") if p.is_file() and p.name != "LOCK"]
  assert not written, written


def test_offload_takes_the_runs_host_memory_in_all(tmp_path):
  # offload(host_memory=...): the pinned host memory of the run in all (the stack's weights in
  # pinned host memory, the state, the NVMe buffers, other pinned arrays and offloads); init keeps
  # in RAM the state that the plan (oo.estimate, as `plan --host-memory`) leaves, the rest on
  # NVMe, and trains as host_limit does.
  import dataclasses
  import gc
  import re

  import jax
  import jax.numpy as jnp
  import optax

  from optax_offload._src import host_memory
  from optax_offload._src import memory

  ex = _example()
  cfg = ex.SIZES["tiny"]
  window = "512KiB"  # a group holds a row of w_gate (64 x 128: 131 KB of weights, grads, state)

  def stack_bytes(cfg):  # bf16 weights of the layer stack
    return cfg.layers * (4 * cfg.d * cfg.d + 3 * cfg.d * cfg.ffn + 2 * cfg.d) * 2

  def taken(params):  # what earlier tests and steps left in pinned host memory, and live plans
    gc.collect()
    return memory.pinned_host_bytes(exclude=params) + sum(p.reserved for p in host_memory._PLANNED)

  def plan(host_memory, cfg=cfg, **kwargs):
    return oo.estimate(
      ex.abstract_params(cfg), optimizer=optax.adamw(1e-2), master_dtype="fp32",
      window_bytes=window, host_memory=host_memory, nvme_dir=str(tmp_path / "plan"), **kwargs,
    )  # fmt: skip

  def offload(nvme_dir, **budget_kwargs):
    return oo.offload(
      optax.adamw(1e-2), master_dtype=jnp.float32, window_bytes=window,
      nvme_dir=str(nvme_dir), **budget_kwargs,
    )  # fmt: skip

  def run(tx, params, cfg=cfg, accumulator_dtype=jnp.float32):
    state = tx.init(params)
    loss_fn = lambda p, t: ex.loss_fn(cfg, p, t)  # noqa: E731
    step = oo.value_and_update(
      loss_fn, tx, accumulate=cfg.accumulate, accumulator_dtype=accumulator_dtype
    )
    step = jax.jit(step, donate_argnums=(0, 1))  # one copy of the params and state, as planned
    losses, data = [], ex.batches(cfg)
    for _ in range(2):
      loss, params, state = step(params, state, next(data))
      losses.append(float(loss))
    oo.sync_nvme(state)
    footprint = oo.footprint(state)
    oo.close_nvme(state)
    return losses, footprint

  weights = stack_bytes(cfg)
  params = ex.init_params(cfg)
  assert memory.pinned_host_bytes() - memory.pinned_host_bytes(exclude=params) == weights
  e = plan(weights + 5 * 2**19)  # 1.2 MB of state in RAM, 1.2 MB on NVMe, 1.5 MB of buffers
  assert e.fits, e.shortfalls
  assert 0 < e.host_bytes and e.nvme_bytes > 0 and not e.update_in_backward
  tx = offload(tmp_path / "a", host_memory=taken(params) + weights + 5 * 2**19)
  losses, footprint = run(tx, params)
  assert footprint["host"] == e.host_bytes and footprint["nvme"] == e.nvme_bytes
  # The same placement from the budget as from the plan's host_limit: the same numbers.
  assert run(offload(tmp_path / "b", host_limit=e.host_bytes), ex.init_params(cfg))[0] == losses

  # Arrays already in pinned host memory at init, and what the live offload `tx` reserves beyond
  # its arrays (its NVMe buffers and the stack's whole gradients), come out of the budget.
  params = ex.init_params(cfg)
  reserved = oo._src.offload._OFFLOADED[tx.update].host_memory.reserved
  assert reserved == e.nvme_buffer_bytes + weights
  budget = taken(params) - reserved + weights + 5 * 2**19
  extra = oo.to_pinned_host(jnp.zeros(2**17, jnp.float32))  # 512 KiB
  state = offload(tmp_path / "c", host_memory=budget + reserved).init(params)
  assert plan(weights + 5 * 2**19 - extra.nbytes + reserved).host_bytes > e.host_bytes
  assert oo.footprint(state)["host"] == plan(weights + 5 * 2**19 - extra.nbytes).host_bytes
  assert oo.footprint(state)["host"] < e.host_bytes
  oo.close_nvme(state)
  del params, state, extra

  # Planned from shapes (abstract_state, as before a restore): live params of those shapes count
  # out once; with none alive, nothing does. (Five layers: shapes no earlier test left alive.)
  cfg5 = dataclasses.replace(cfg, layers=5)
  weights5, params = stack_bytes(cfg5), ex.init_params(cfg5)
  budget = taken(params) + weights5 + 9 * 2**18
  e5 = plan(weights5 + 9 * 2**18, cfg5)

  def abstract_plan(name):
    abstract_tx = offload(tmp_path / name, host_memory=budget)
    oo.abstract_state(abstract_tx, ex.abstract_params(cfg5))
    return oo._src.offload._OFFLOADED[abstract_tx.update].host_memory.planned.host_bytes

  assert plan(2 * weights5 + 9 * 2**18, cfg5).host_bytes > e5.host_bytes > 0
  assert plan(9 * 2**18, cfg5).host_bytes < e5.host_bytes  # (the differences show)
  assert abstract_plan("c5") == e5.host_bytes  # the live params counted once, not twice
  del params
  assert abstract_plan("c6") == e5.host_bytes  # none alive: no room made for them

  # Micro-batches accumulated in bf16 in pinned host memory: planned with them (their plan
  # updates in the backward pass, the path that never holds the stack's gradients whole).
  acc_cfg = dataclasses.replace(cfg, accumulate=2)
  params = ex.init_params(acc_cfg)
  e_acc = plan(2 * weights + 5 * 2**19, acc_cfg, accumulate=2, accumulator_dtype="bf16")
  assert e_acc.fits and e_acc.accumulator_bytes == weights and e_acc.host_bytes > 0
  assert e_acc.update_in_backward
  acc_tx = offload(
    tmp_path / "acc", host_memory=taken(params) + 2 * weights + 5 * 2**19, accumulate=2,
    accumulator_dtype="bf16",
  )  # fmt: skip
  acc_losses, acc_footprint = run(acc_tx, params, acc_cfg, jnp.bfloat16)
  assert acc_footprint["host"] == e_acc.host_bytes and np.all(np.isfinite(acc_losses))
  with pytest.raises(ValueError, match=r"planned accumulators in bfloat16, not accumulate=2"):
    oo.value_and_update(lambda p, t: ex.loss_fn(acc_cfg, p, t), acc_tx, accumulate=2)
  with pytest.raises(ValueError, match=r"holds the stack's gradients whole"):  # a clip does
    oo.value_and_update(
      lambda p, t: ex.loss_fn(acc_cfg, p, t),
      optax.chain(optax.clip_by_global_norm(1.0), acc_tx),
      accumulate=2,
      accumulator_dtype="bf16",
    )
  params = ex.init_params(acc_cfg)  # the step's were donated
  state = acc_tx.init(params)
  with pytest.raises(ValueError, match=r"backward pass .* oo\.value_and_update"):
    acc_tx.update(params, state, params)  # tx.update: the gradients whole
  oo.close_nvme(state)
  with pytest.raises(ValueError, match=r"MultiSteps' accumulators .* accumulate=k"):
    oo.init(optax.MultiSteps(acc_tx, every_k_schedule=2), params)

  # A deep stack of narrow layers in a budget its gradients do not fit beside: without
  # accumulation too, the plan updates the stack in the backward pass (as for the 13B in 48 GiB).
  deep = dataclasses.replace(cfg, d=32, ffn=64, layers=32, heads=2)
  deep_params = ex.init_params(deep)
  deep_tx = oo.offload(
    optax.adamw(1e-2), master_dtype=jnp.float32, window_bytes="80KiB",
    nvme_dir=str(tmp_path / "deep"), host_memory=taken(deep_params) + 19 * stack_bytes(deep) // 10,
  )  # fmt: skip
  deep_state = deep_tx.init(deep_params)
  assert 0 < oo.footprint(deep_state)["host"] and oo.footprint(deep_state)["nvme"] > 0
  with pytest.raises(ValueError, match=r"backward pass .* at least .* \((\d+) bytes") as err:
    deep_tx.update(deep_params, deep_state, deep_params)  # the stack's gradients whole
  oo.close_nvme(deep_state)
  # The host memory the refusal names plans the whole gradients: tx.update may hold them.
  need = int(re.search(r"\((\d+) bytes", str(err.value)).group(1))
  del deep_tx, deep_state, err  # (the traceback holds the offload and its state)
  gc.collect()
  whole_tx = oo.offload(
    optax.adamw(1e-2), master_dtype=jnp.float32, window_bytes="80KiB",
    nvme_dir=str(tmp_path / "whole"), host_memory=need,
  )  # fmt: skip
  oo.close_nvme(whole_tx.init(deep_params))
  whole = oo._src.offload._OFFLOADED[whole_tx.update].host_memory
  assert whole.planned.fits and not whole.planned.update_in_backward
  assert whole.planned.host_bytes == 0  # the least such a step needs: all the state on NVMe

  # What the plan does not count is refused, with what to do.
  params = ex.init_params(cfg)
  with pytest.raises(ValueError, match=r"planned one micro-batch a step, not accumulate=2"):
    oo.value_and_update(lambda p, t: ex.loss_fn(cfg, p, t), tx, accumulate=2)
  with pytest.raises(ValueError, match=r"inside a trace .* outside jit"):
    jax.jit(offload(tmp_path / "d", host_memory="1GiB").init)(params)
  with pytest.raises(ValueError, match="without host_memory pass them to oo.value_and_update"):
    oo.offload(optax.adamw(1e-2), accumulate=2)
  with pytest.raises(ValueError, match="host_limit .* or host_memory .* not both"):
    oo.offload(optax.adamw(1e-2), host_limit="1MiB", host_memory="1GiB")
  with pytest.raises(ValueError, match='host_memory plans update_on="device"'):
    oo.offload(optax.adamw(1e-2), host_memory="1GiB", update_on="host")
  # Less than the stack's weights: refused at init with the plan's advice.
  small = offload(tmp_path / "e", host_memory=taken(params) + weights // 2)
  with pytest.raises(ValueError, match=r"host_memory .* does not fit .* host: .*raise"):
    small.init(params)


def test_host_memory_counts_a_resumed_stores_files_as_room(tmp_path):
  # A resumed store writes its next generations over the ones it keeps: their blocks are room.
  import dataclasses
  import os

  import jax
  import optax

  from optax_offload._src import estimate
  from optax_offload._src import host_memory

  store = tmp_path / "process_0"
  chunk = store / "gen_00000003" / "c0"
  chunk.parent.mkdir(parents=True)
  chunk.write_bytes(os.urandom(2**20))
  (tmp_path / "unrelated").write_bytes(os.urandom(2**20))  # not the store's: no room
  kept = os.lstat(chunk).st_blocks * 512
  assert kept > 0
  short = estimate.Shortfall("nvme", needed=10**6 + kept, available=10**6, advice="")
  assert not host_memory._short_of_disk(short, str(store))
  assert host_memory._short_of_disk(dataclasses.replace(short, needed=short.needed + 1), str(store))
  assert host_memory._short_of_disk(short, str(tmp_path / "process_1"))

  # A layer stack in pinned host memory is planned from this process's shards (across processes:
  # tests/test_multiprocess.py); one replicated on two of its devices is refused, with what to do.
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  pinned = jax.NamedSharding(mesh, jax.P(), memory_kind="pinned_host")
  stack = jax.device_put(jax.numpy.ones((4, 64, 128)), pinned)
  tx = oo.offload(optax.adam(1e-3), host_memory="1GiB")
  with pytest.raises(NotImplementedError, match="replicated on several .* shard the layer stack"):
    tx.init({"w": stack})


def test_host_memory_agreement_paths_two_processes_cannot_show_on_loopback(
  tmp_path, monkeypatch, caplog
):
  # Paths of the processes' agreement (host_memory._agreed) that tests/test_multiprocess.py's
  # real runs cannot reach with one machine's alike devices and even shards: the other process
  # is one scripted row of the gather (this process's values, the other's), as process 1 of 2.
  import jax
  import numpy as np
  import optax
  from conftest import make_params
  from jax.experimental import multihost_utils

  from optax_offload._src import measure

  params = make_params()
  nvme_dir = str(tmp_path / "nvme")

  def offload():
    return oo.offload(
      optax.adam(1e-3), window_bytes=100_000, host_memory="64MiB", nvme_dir=nvme_dir
    )

  def other_process(*rows):
    """Each gather in turn: the other process's values from this one's (int64, then the flag)."""
    script = iter(rows)

    def gather(mine):
      mine = np.asarray(mine)
      values = mine.view(np.int64)
      other = np.asarray(next(script)(values), np.int64).view(np.int32)
      return np.stack([other, mine])  # the other is process 0

    return gather

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  same = lambda v: v  # noqa: E731
  # The other process has room for less state: this one plans with that, spilling the rest.
  least = oo.estimate(
    params, optimizer=optax.adam(1e-3), window_bytes=100_000, host_limit=300_000, nvme_dir=nvme_dir
  ).host_bytes
  assert 0 < least < oo.estimate(params, optimizer=optax.adam(1e-3)).host_bytes
  # The first gather names the file system of each process's nvme_dir: the same one here, whose
  # free space the two processes share; the next ones compare their plans; the last one says
  # that each opened its NVMe store.
  monkeypatch.setattr(
    multihost_utils, "process_allgather", other_process(same, lambda v: [least, 0], same, same)
  )
  tx = offload()
  with caplog.at_level(logging.INFO, logger="optax_offload"):
    state = tx.init(params)
  assert oo.footprint(state)["host"] == least and oo.footprint(state)["nvme"] > 0
  assert "2 processes of this run keep their NVMe tier" in caplog.text
  oo.close_nvme(state)
  # Another file system (or none): this process plans with all of its disk's free space.
  caplog.clear()
  monkeypatch.setattr(
    multihost_utils, "process_allgather", other_process(lambda v: [v[0] ^ 2, 0], same, same, same)
  )
  with caplog.at_level(logging.INFO, logger="optax_offload"):
    oo.close_nvme(offload().init(params))
  assert "processes of this run keep their NVMe tier" not in caplog.text
  # A share too small for the state the plan puts on NVMe: refused, saying why (the disk's free
  # space as a test machine cannot have it: 2 MB).
  monkeypatch.setattr(
    multihost_utils, "process_allgather", other_process(same, lambda v: [least, 0], same)
  )
  with monkeypatch.context() as m:
    m.setattr(measure, "free_disk", lambda path: 2_000_000)
    with pytest.raises(ValueError, match=r"nvme \(2 processes .* each plans with 1/2 of it") as e:
      offload().init(params)
  assert "the plan command with --nvme-size 1000000B counts the same" in str(e.value)
  # The disk cannot be read: this process raises its error after the other learns of it.
  gathers = []
  monkeypatch.setattr(
    multihost_utils, "process_allgather", lambda mine: gathers.append(mine) or np.stack([mine] * 2)
  )
  with monkeypatch.context() as m:
    m.setattr(measure, "free_disk", lambda path: (_ for _ in ()).throw(ValueError("disk")))
    with pytest.raises(ValueError, match="disk"):
      offload().init(params)
  assert len(gathers) == 1 and np.asarray(gathers[0]).view(np.int64)[-1] == 1
  # Plans that differ after all (another checksum of the groups): refused on every process.
  monkeypatch.setattr(
    multihost_utils,
    "process_allgather",
    other_process(same, same, lambda v: [v[0], v[1] + 1, 0]),
  )
  with pytest.raises(ValueError, match="plan different groups or tiers"):
    offload().init(params)
  # The other process is refused when it plans again: this one is, naming it.
  monkeypatch.setattr(
    multihost_utils, "process_allgather", other_process(same, same, lambda v: [0, 0, 1])
  )
  with pytest.raises(ValueError, match="process 0 refused the host_memory plan"):
    offload().init(params)
  # The other process cannot open its NVMe store once they agreed: this one raises too, naming
  # it, and closes its own store (whose directory the next init opens again).
  monkeypatch.setattr(
    multihost_utils,
    "process_allgather",
    other_process(same, lambda v: [least, 0], same, lambda v: [1]),
  )
  tx = offload()
  with pytest.raises(ValueError, match="process 0 could not open its NVMe store"):
    tx.init(params)
  monkeypatch.setattr(
    multihost_utils, "process_allgather", other_process(same, lambda v: [least, 0], same, same)
  )
  state = tx.init(params)
  assert oo.footprint(state)["nvme"] > 0
  oo.close_nvme(state)
  # This process's own error is raised as it is, after the other process learns of it.
  gathers = []
  monkeypatch.setattr(
    multihost_utils, "process_allgather", lambda mine: gathers.append(mine) or np.stack([mine] * 2)
  )
  unwritable = tmp_path / "a_file"
  unwritable.write_text("")
  tx = oo.offload(optax.adam(1e-3), host_memory="64MiB", nvme_dir=str(unwritable / "nvme"))
  with pytest.raises(ValueError, match="cannot be created"):
    tx.init(params)
  assert len(gathers) == 2 and np.asarray(gathers[-1]).view(np.int64)[-1] == 1


def test_the_script_stops_where_its_plan_does_not_fit(capsys):
  # It printed the shortfalls and trained on (helper review /tmp/revA); --force still tries.
  with pytest.raises(SystemExit) as exc:
    _example().main([*TINY, "--no-nvme", "--host-memory", "1KiB"])
  assert exc.value.code == 1
  out = capsys.readouterr()
  assert "fits: False" in out.out and "raise --host-memory to at least" in out.out
  assert "The plan does not fit: change the options as said above (or pass --force)." in out.err
