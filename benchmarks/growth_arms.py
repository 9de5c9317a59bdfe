"""Every growing arm of the frontier on a toy preset, one seed: each run's LR, branch losses and
growth diagnostics as JSON, so that two checkouts can be compared bit for bit (a refactor of the
growth path must not change a number).

    PYTHONPATH=src python benchmarks/growth_arms.py OUT_DIR losses.json   # in each checkout
    diff old.json new.json                                                # nothing

Issue 32 ran it at 28f3e58 and after the change (17 runs: tokens by five recipes, stacking,
MLP widening zero/net2net, HyperCloning, and the scratch runs they follow): identical.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import run as run_

ARMS = ("chain-exact-anneal", "chain-paper", "chain-official-released", "chain-exact-frozen",
        "chain-exact-noised", "chain-stack", "widen-zero", "widen-net2net", "widen-stack",
        "widen-duplicate")
# Two layers (stacking needs an even count) and 0.1 tokens per parameter: every Transformer++
# arm's envelope moves, so every arm grows.
TOY = dataclasses.replace(
    presets_.FULL_V3, name="growth-arms", hidden_size=32, num_layers=2, num_heads=2,
    base_tokens=(16, 16, 64), num_sizes=4, seq_len=32, batch_size=4, max_budget=1.2e9,
    num_budgets=3, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3,
    eval_batches=1, seeds=1, tuning_seeds=1, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
    families=("tokenformer", "transformer++"), recipes=ARMS, follow="predicted",
    tokens_per_parameter=0.1, questions=())


def main(out: str, path: str) -> int:
    torch.set_num_threads(1)
    results = run_.run_frontier(TOY, data=None, out=out, print_fn=lambda line: None, plots=False)
    rows = {k: {"lr": r["lr"], "losses": [b["loss"] for b in r["branches"]],
                "diag": r.get("growth_diagnostics")} for k, r in results["runs"].items()}
    with open(path, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True)
    print(f"{len(rows)} runs → {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
