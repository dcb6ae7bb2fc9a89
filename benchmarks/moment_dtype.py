"""Error of bf16 and 8-bit moments against fp32 moments on a small real training run (the demo's GPT).

Trains the byte-level GPT of ``examples/demo.py`` on the Python standard library's source, in
lockstep from one init on the same batches, with AdamW:

- ``fp32``: ``oo.offload(adamw)``, moments in fp32 (the baseline);
- ``bf16``: ``oo.offload(adamw, moment_dtype="bf16")``, moments in bf16 on the host tier;
- ``int8``: ``oo.offload(adamw, moment_dtype="int8")``, moments 8-bit block-quantized on the host
  tier (1-D moments in fp32);
- ``int8_head_fp32``: 8-bit moments but for the output kernel's (``head/kernel``, (d_model, 256):
  its blocks along the byte vocabulary mix frequent and rare bytes), kept fp32 through
  ``optax.multi_transform`` (docs/tiers.md, "Choosing per leaf");
- ``fp32_groups``: fp32 moments updated in several groups (``window_bytes="256KiB"``), whose
  ulp-level differences per update (docs/tiers.md) set the noise floor of any comparison;
- ``optax_mu_bf16``: plain ``optax.adamw(mu_dtype=bf16)`` (only ``mu`` in bf16, and ``b1 * mu``
  computed in bf16), for comparison; fp32 params only.

With ``--param-dtype bf16`` the params are bf16 with an fp32 master copy in both offloaded runs.
Prints and writes (``--out``) the final train and validation losses, the largest relative loss
difference to ``fp32`` over the run, and each run's largest parameter difference to ``fp32``
relative to the leaf's scale.

    python benchmarks/moment_dtype.py --steps 300 --out bench_out/moment_dtype.json

``--runs fp32,int8`` trains only those (tests/test_compress.py runs a short one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib

import jax

jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_offload as oo  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _demo():
  spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  return demo


def _fp32_for_the_head(params):
  """multi_transform's labels: "fp32" for the output layer's params, "int8" for the others."""

  def label(path, _):  # (as docs/tiers.md's: a key "head" at any depth)
    return "fp32" if any(getattr(k, "key", None) == "head" for k in path) else "int8"

  return jax.tree_util.tree_map_with_path(label, params)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="write the results as JSON here")
  p.add_argument(
    "--runs", default=None, help="comma-separated runs to train (default: all; fp32 always)"
  )
  args = p.parse_args(argv)
  demo = _demo()
  cfg = argparse.Namespace(
    d_model=args.d_model,
    heads=4,
    seq_len=64,
    batch=16,
    layers=args.layers,
    param_dtype=args.param_dtype,
    steps=args.steps,
    seed=args.seed,
  )
  master = jnp.float32 if args.param_dtype == "bf16" else None
  txs = {
    "fp32": oo.offload(optax.adamw(args.lr), master_dtype=master),
    "bf16": oo.offload(optax.adamw(args.lr), master_dtype=master, moment_dtype="bf16"),
    "int8": oo.offload(optax.adamw(args.lr), master_dtype=master, moment_dtype="int8"),
  }
  # 8-bit moments but for the output kernel's, whose blocks along the byte vocabulary mix
  # frequent and rare bytes (docs/tiers.md): a per-leaf choice through optax.multi_transform.
  int8_but_head = optax.multi_transform(
    {"int8": oo.with_moment_dtype(optax.adamw(args.lr), "int8"), "fp32": optax.adamw(args.lr)},
    _fp32_for_the_head,
  )
  txs["int8_head_fp32"] = oo.offload(int8_but_head, master_dtype=master)
  # The noise floor: fp32 moments updated in several groups differ from one group by ulps per
  # update (the numerics rule in DESIGN.md), which training then amplifies.
  txs["fp32_groups"] = oo.offload(optax.adamw(args.lr), master_dtype=master, window_bytes="256KiB")
  if master is None:
    txs["optax_mu_bf16"] = optax.adamw(args.lr, mu_dtype=jnp.bfloat16)
  if args.runs is not None:
    chosen = {"fp32", *args.runs.split(",")}
    unknown = chosen - set(txs)
    if unknown:
      p.error(f"--runs: unknown {sorted(unknown)}; choose from {sorted(txs)}")
    txs = {k: v for k, v in txs.items() if k in chosen}

  train_data, val_data = demo.load_text()
  rng = np.random.default_rng(args.seed)
  train_offsets = rng.integers(0, len(train_data) - cfg.seq_len - 1, (args.steps, cfg.batch))
  val_offsets = rng.integers(0, len(val_data) - cfg.seq_len - 1, (8, cfg.batch))
  val_batches = [jnp.asarray(demo.batches(val_data, o, cfg.seq_len)) for o in val_offsets]
  runs = demo.train(cfg, txs, train_data, train_offsets, val_batches)

  base = runs["fp32"]
  base_losses = np.asarray(base["losses"])
  out = {"config": vars(args), "runs": {}}
  for name, r in runs.items():
    losses = np.asarray(r["losses"])
    param_rel = {
      k: float(np.max(np.abs(r["params"][k] - v)) / max(float(np.max(np.abs(v))), 1e-30))
      for k, v in base["params"].items()
    }
    worst = max(param_rel, key=param_rel.get)
    out["runs"][name] = {
      "train_loss": float(losses[-1]),
      "train_loss_last20": float(losses[-20:].mean()),
      "val_loss": r["val_loss"],
      "max_rel_loss_diff": float(np.max(np.abs(losses - base_losses) / np.abs(base_losses))),
      "max_rel_param_diff": param_rel[worst],
      "max_rel_param_diff_leaf": worst,
      "state_bytes": r["tiers"],
    }
  print(
    f"\n{'run':<15}{'train':>8}{'last 20':>9}{'val':>8}{'loss rel':>10}{'param rel':>11}  state"
  )
  for name, r in out["runs"].items():
    tiers = "/".join(f"{r['state_bytes'][k] / 2**20:.2f}" for k in ("device", "host", "nvme"))
    print(
      f"{name:<15}{r['train_loss']:>8.4f}{r['train_loss_last20']:>9.4f}{r['val_loss']:>8.4f}"
      f"{r['max_rel_loss_diff']:>10.2e}{r['max_rel_param_diff']:>11.2e}  {tiers} MiB"
    )
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
