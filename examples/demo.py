"""Train a small byte-level GPT with Flax NNX, its AdamW state offloaded by optax_offload.

The text is the Python standard library's own source, so the demo needs no download. By default the
same model is trained a second time with plain optax from the same init and data, and the two runs are
compared: offloading moves optimizer state, it must not change the numbers.

  python examples/demo.py                      # AdamW state in pinned host memory
  python examples/demo.py --offload nvme       # ... and on disk past --host-limit
  python examples/demo.py --offload none       # plain optax only
  python examples/demo.py --stream-layers      # ... and the block weights in pinned host memory too
  python examples/demo.py --fused              # ... and the blocks updated inside the backward pass
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile
import time


@contextlib.contextmanager
def without_cuda_stub_notices():
  """Hides the two lines the CUDA plugin (the test extra's, for compile-only GPU programs) writes
  to stderr each time JAX loads it on a machine without a GPU ("Could not find cuda
  drivers", and absl's note that logging is not initialised); every other line goes through."""
  noise = ("cudart_stub.cc", "absl::InitializeLog()")
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+") as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      sys.stderr.writelines(line for line in captured if not any(n in line for n in noise))


with without_cuda_stub_notices():
  import jax

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

matplotlib.use("Agg")  # write a PNG; no display needed
import matplotlib.pyplot as plt  # noqa: E402

try:
  import optax_offload as oo
except ImportError:  # lets the demo run with --offload none before the library is installed
  oo = None

MiB = 2**20
TIERS = ("device", "host", "nvme")
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


class Block(nnx.Module):
  """Pre-norm transformer block: the LayerNorm scales and biases are small and stay on device."""

  def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    # No attention biases: softmax ignores the key bias, so its gradient is pure rounding noise that
    # Adam scales up to full-size steps, and any two runs would disagree on it by ~lr.
    self.attn = nnx.MultiHeadAttention(
      heads, d, dtype=dtype, param_dtype=dtype, use_bias=False, decode=False, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
  def __init__(self, args, rngs: nnx.Rngs):
    d, dtype = args.d_model, DTYPES[args.param_dtype]
    self.tok = nnx.Embed(256, d, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.pos = nnx.Embed(args.seq_len, d, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(d, args.heads, dtype, rngs) for _ in range(args.layers)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, 256, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, ids):
    x = self.tok(ids) + self.pos(jnp.arange(ids.shape[-1]))
    mask = nnx.make_causal_mask(ids)
    if isinstance(self.blocks, Block):  # --stream-layers: one Block holding every layer's params
      x = oo.offloaded_layers(self.blocks, x, mask)
    else:
      for block in self.blocks:
        x = block(x, mask)
    return self.head(self.ln(x))


# --stream-layers turns the list of blocks into one Block whose params have a leading layer axis,
# the module nnx.vmap would build. Stacking the initialised blocks' states (rather than building
# them with nnx.vmap) keeps the init of the plain run, so the two runs can be compared.
def stack_blocks(model):
  """The blocks become one Block with a leading layer axis, its params in pinned host memory."""
  states = [nnx.as_pure(nnx.state(b)) for b in model.blocks]
  stack = jax.tree.map(lambda *ws: jnp.stack(ws), *states)
  model.blocks = nnx.merge(nnx.graphdef(model.blocks[0]), oo.to_pinned_host(stack))


def unstack_blocks(model):
  """The inverse of stack_blocks, on the device, so the trained model compares with the plain one."""
  block_def, stack = nnx.split(model.blocks)
  stack = jax.tree.map(np.asarray, nnx.as_pure(stack))

  def layer(i):
    return nnx.merge(block_def, jax.tree.map(lambda w: jnp.asarray(w[i]), stack))

  model.blocks = nnx.List([layer(i) for i in range(len(jax.tree.leaves(stack)[0]))])


def loss_fn(model, batch):
  logits = model(batch[:, :-1]).astype(jnp.float32)  # softmax in fp32 even for bf16 params
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# Donating model and optimizer lets XLA reuse their buffers for the new params and state
# instead of holding two copies; this matters most for the state that stays on device.
@nnx.jit(donate_argnames=("model", "optimizer"))
def train_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


# nnx.Optimizer.update with oo.update_and_apply in place of tx.update + optax.apply_updates: it takes
# the block stack's params and gradients in pinned host memory and writes the new params back there.
@nnx.jit(donate_argnames=("model", "optimizer"))
def stream_train_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  params, opt_state = oo.update_and_apply(
    optimizer.tx,
    nnx.as_pure(nnx.state(grads, nnx.Param)),
    nnx.as_pure(optimizer.opt_state),
    nnx.as_pure(nnx.state(model, nnx.Param)),
  )
  nnx.update(model, params)
  nnx.update(optimizer.opt_state, nnx.state(opt_state))
  optimizer.step[...] += 1
  return loss


# oo.value_and_update: the loss, its gradients and the update in one call; the block stack (in
# pinned host memory, applied by oo.offloaded_layers) is updated inside the backward pass, layer by
# layer, so its gradients never exist whole; the other params are updated after it.
@nnx.jit(donate_argnames=("model", "optimizer"))
def fused_train_step(model, optimizer, batch):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, batch):
    return loss_fn(nnx.merge(graphdef, params, rest), batch)

  value, params, opt_state = oo.value_and_update(loss, optimizer.tx)(
    nnx.as_pure(params), nnx.as_pure(optimizer.opt_state), batch
  )
  nnx.update(model, params)
  nnx.update(optimizer.opt_state, nnx.state(opt_state))
  optimizer.step[...] += 1
  return value


@nnx.jit
def eval_step(model, batch):
  return loss_fn(model, batch)


def load_text():
  """Bytes of the stdlib's top-level *.py files, in sorted order so every run sees the same text."""
  files = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))
  data = np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)
  split = int(0.9 * len(data))  # fixed split: the last 10% is validation
  return data[:split], data[split:]


def batches(data, offsets, seq_len):
  """Windows of seq_len + 1 bytes: inputs are [:-1], targets [1:]."""
  return data[offsets[..., None] + np.arange(seq_len + 1)].astype(np.int32)


def tier_bytes(opt_state):
  """Optimizer-state bytes per tier; in NNX the optax state lives in Variables, hence as_pure."""
  state = nnx.as_pure(opt_state)
  if hasattr(oo, "footprint"):
    return oo.footprint(state)
  # Without optax_offload installed: classify leaves by where their buffers live.
  out = dict.fromkeys(TIERS, 0)
  for x in jax.tree.leaves(state):
    kind = getattr(getattr(x, "sharding", None), "memory_kind", "device") or "device"
    out["host" if "host" in kind else "device"] += x.nbytes
  return out


def train(args, txs, train_data, train_offsets, val_batches):
  """Trains one model per optimizer in lockstep, so all runs see the same batches and machine load."""
  runs = {}
  for name, tx in txs.items():
    model = GPT(args, nnx.Rngs(args.seed))  # same seed => same init in every run
    streamed = name in ("stream", "fused")
    if streamed:
      stack_blocks(model)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # The offloaded state (and a host stack) is committed to a device, so the step's outputs are
    # too: committing the other inputs now spares compiling the step a second time at step 1.
    for node in (model, optimizer):
      nnx.update(node, jax.tree.map(lambda x: jax.device_put(x, x.sharding), nnx.state(node)))
    step_fn = {"stream": stream_train_step, "fused": fused_train_step}.get(name, train_step)
    runs[name] = dict(model=model, optimizer=optimizer, step_fn=step_fn, losses=[], times=[])
  desc = f"{jax.devices()[0].platform}, state MiB device/host/nvme"
  bar = tqdm(range(args.steps), desc=desc, dynamic_ncols=True)
  for step in bar:
    batch = jnp.asarray(batches(train_data, train_offsets[step], args.seq_len))
    for r in runs.values():
      t0 = time.perf_counter()
      loss = float(r["step_fn"](r["model"], r["optimizer"], batch))  # float() waits for the step
      r["times"].append(time.perf_counter() - t0)
      r["losses"].append(loss)
      # footprint walks the whole state: once in a while is enough
      if step % 20 == 0 or step == args.steps - 1:
        r["tiers"] = tier_bytes(r["optimizer"].opt_state)
    bar.set_postfix_str(
      "  ".join(
        f"{name}: loss {r['losses'][-1]:.3f}, {1e3 * r['times'][-1]:.0f} ms, "
        + "/".join(f"{r['tiers'][k] / MiB:.1f}" for k in TIERS)
        for name, r in runs.items()
      )
    )
  for r in runs.values():
    model = r.pop("model")
    if hasattr(oo, "close_nvme"):  # waits for the last step's writes: the temp dir goes next
      oo.close_nvme(nnx.as_pure(r["optimizer"].opt_state))
    del r["optimizer"], r["step_fn"]
    if isinstance(model.blocks, Block):
      unstack_blocks(model)
    r["val_loss"] = float(np.mean([eval_step(model, b) for b in val_batches]))
    params = jax.tree_util.tree_leaves_with_path(nnx.as_pure(nnx.state(model, nnx.Param)))
    r["params"] = {
      jax.tree_util.keystr(k, simple=True, separator="/"): np.asarray(p, np.float32)
      for k, p in params
    }
    r["step_s"] = float(np.median(r["times"][1:] or r["times"]))  # step 0 includes compilation
  return runs


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--offload", choices=["none", "host", "nvme"], default="host")
  p.add_argument("--host-limit", default=None, help='pinned-host budget, e.g. "64MiB"')
  p.add_argument("--nvme-dir", default=None, help="state past --host-limit (default: temp dir)")
  p.add_argument("--update-on", choices=["device", "host"], default="device")
  p.add_argument("--window-bytes", default=None, help="most offloaded bytes on device at once")
  p.add_argument("--min-size", type=int, default=4096, help="smaller leaves stay on device")
  p.add_argument(
    "--stream-layers",
    action="store_true",
    help="blocks stacked in pinned host memory, streamed with oo.offloaded_scan",
  )
  p.add_argument(
    "--fused",
    action="store_true",
    help="--stream-layers, with the blocks updated inside the backward pass (oo.value_and_update)",
  )
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--param-dtype", choices=list(DTYPES), default="fp32")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True)
  p.add_argument("--out", default="demo_out")
  p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
  args = p.parse_args()

  if args.device == "cpu":  # must happen before JAX starts a backend
    jax.config.update("jax_platforms", "cpu")
  with without_cuda_stub_notices():  # starting the backend loads the plugin once more
    backend = jax.default_backend()
  if args.device == "gpu" and backend != "gpu":
    print("no GPU found, running on CPU")
  if args.offload != "none" and not hasattr(oo, "offload"):
    p.error("optax_offload is not importable here; use --offload none")
  args.stream_layers = args.stream_layers or args.fused
  if args.stream_layers and (args.offload == "none" or args.update_on != "device"):
    p.error("--stream-layers needs --offload host or nvme and --update-on device")

  train_data, val_data = load_text()
  rng = np.random.default_rng(args.seed)  # one draw of offsets, shared by both runs
  train_offsets = rng.integers(0, len(train_data) - args.seq_len - 1, (args.steps, args.batch))
  val_offsets = rng.integers(0, len(val_data) - args.seq_len - 1, (8, args.batch))
  val_batches = [jnp.asarray(batches(val_data, o, args.seq_len)) for o in val_offsets]
  data = (train_data, train_offsets, val_batches)
  print(f"text: {len(train_data) / MiB:.1f} MiB train, {len(val_data) / MiB:.1f} MiB val")

  with tempfile.TemporaryDirectory(prefix="optax_offload_demo_") as tmp:  # default --nvme-dir
    txs = {}
    if args.offload != "none":
      # With --offload nvme and no budget, cap the host tier so the demo's few MiB reach the disk.
      host_limit = args.host_limit or ("1MiB" if args.offload == "nvme" else None)
      name = "fused" if args.fused else ("stream" if args.stream_layers else args.offload)
      txs[name] = oo.offload(
        optax.adamw(args.lr),
        host_limit=host_limit,
        nvme_dir=(args.nvme_dir or tmp) if args.offload == "nvme" else None,
        update_on=args.update_on,
        # bf16 params: keep an fp32 master copy with the rest of the state, off the device.
        master_dtype=jnp.float32 if args.param_dtype == "bf16" else None,
        min_size=args.min_size,
        window_bytes=args.window_bytes,
      )
    if args.offload == "none" or args.compare:
      txs["plain"] = optax.adamw(args.lr)
    runs = train(args, txs, *data)
  if write_report(args, runs).get("loss_check") == "FAILED":
    raise SystemExit("loss check FAILED: the streamed run does not match plain optax")


def write_report(args, runs):
  """summary.json, loss.png and a table; the first run is the offloaded one when there are two.

  Returns:
    The summary.
  """
  first = next(iter(runs.values()))
  keep = ("losses", "val_loss", "step_s", "tiers")
  summary = {"config": vars(args), "train_loss": first["losses"][-1], "val_loss": first["val_loss"]}
  summary["runs"] = {name: {k: r[k] for k in keep} for name, r in runs.items()}
  if len(runs) == 2:
    a, b = (np.asarray(r["losses"]) for r in runs.values())
    pa, pb = (r["params"] for r in runs.values())
    summary["max_loss_diff"] = float(np.max(np.abs(a - b)))
    summary["max_loss_diff_rel"] = float(np.max(np.abs(a - b) / np.abs(b)))
    diffs = {k: float(np.max(np.abs(pa[k] - pb[k]))) for k in pa}
    summary["max_param_diff_leaf"] = max(diffs, key=diffs.get)
    summary["max_param_diff"] = diffs[summary["max_param_diff_leaf"]]
    summary["step_time_ratio"] = first["step_s"] / runs["plain"]["step_s"]
    if args.stream_layers:
      summary["loss_check"] = loss_check(args, summary)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)

  fig, ax = plt.subplots(figsize=(7, 4))
  for i, (name, r) in enumerate(runs.items()):  # dashed second curve: identical curves stay visible
    ax.plot(r["losses"], "--" if i else "-", label=f"{name} (val {r['val_loss']:.3f})")
  ax.set(xlabel="step", ylabel="train loss (nats/byte)", title="byte-level GPT, Python stdlib")
  ax.legend()
  fig.savefig(os.path.join(args.out, "loss.png"), dpi=120, bbox_inches="tight")

  print(f"\n{'run':<6}{'train':>8}{'val':>8}{'step ms':>9}  MiB optimizer state per tier")
  for name, r in runs.items():
    tiers = "  ".join(f"{k} {r['tiers'][k] / MiB:.2f}" for k in TIERS)
    print(
      f"{name:<6}{r['losses'][-1]:>8.4f}{r['val_loss']:>8.4f}{1e3 * r['step_s']:>9.1f}  {tiers}"
    )
  if len(runs) == 2:
    print(f"step time, offloaded / plain: {summary['step_time_ratio']:.2f}x")
    print(
      f"max |loss diff| {summary['max_loss_diff']:.3g} (rel {summary['max_loss_diff_rel']:.3g})"
    )
    where = f" ({summary['max_param_diff_leaf']})" if summary["max_param_diff"] else ""
    print(f"max |param diff| {summary['max_param_diff']:.3g}{where}")
    if "loss_check" in summary:
      print(f"loss check: {summary['loss_check']}")
  print(f"wrote {args.out}/summary.json and {args.out}/loss.png")
  return summary


def loss_check(args, summary):
  """The streamed run against plain optax, by tests/test_demo.py's rule for the default run."""
  if args.param_dtype == "bf16":
    return "not checked: an fp32 master copy against bf16 params differs by design"
  if summary["max_loss_diff"] == 0:
    return "bit-identical"
  return "within 1e-4 relative" if summary["max_loss_diff_rel"] <= 1e-4 else "FAILED"


if __name__ == "__main__":
  main()
