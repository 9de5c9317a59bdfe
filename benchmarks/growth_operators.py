"""Every growth operator on one trained model: the logit change it costs and a short continued
training, one seed (docs/growth.md, "Operators measured").

    python benchmarks/growth_operators.py runs/demo/final [--steps 100] [--lr 3e-4]
        [--batch-size 8] [--seq-len 256] [--eval-every 20] [--json out.json]

MODEL is a trained model directory with its optimizer state (a training checkpoint, or the
``final/`` folder `tokenformer train` writes). For each operator the model is grown with
``grow_with_optimizer`` (AdamW carried over: every operator gets the state its docs describe),
then:

* **max |Δlogit|**: on a fixed probe of validation text (4 × seq-len tokens), both models in
  float64, relative to the largest |logit| — the change the operator itself makes, free of
  float32 rounding;
* **val loss**: before any step, and every ``--eval-every`` steps of continued training on the
  same batches for every operator (constant ``--lr``, the demo's final LR by default; weight decay
  and betas from the checkpoint; bf16 autocast as the demo; gradient clipping at 1.0).

"none" continues the un-grown model on the same batches: the reference each curve is read
against. The data is the embedded corpus the demo trains on (byte tokenizer). Prints a markdown
table for docs/growth.md (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, log, machine

from tokenformer.data.corpus import default_dataset
from tokenformer.formats.loading import load_model
from tokenformer.io.training_state import load_optimizer_state, read_state
from tokenformer.ops.growth import grow_with_optimizer
from tokenformer.training.optim import param_groups

HYPERCLONING_NOISE = 10 ** (-10 / 20)  # SNR 10 dB (the HyperCloning release's example)

# (label, grow()'s keyword arguments, what it follows); "none" is the un-grown reference.
OPERATORS: list[tuple[str, dict, str]] = [
    ("none", {}, "continue the trained model"),
    ("width 2x", {"hidden": "2x"}, "HyperCloning (duplication)"),
    ("width 2x + noise 0.01", {"hidden": "2x", "width_noise": 0.01}, "HyperCloning"),
    (f"width 2x + noise {HYPERCLONING_NOISE:.2f}",
     {"hidden": "2x", "width_noise": HYPERCLONING_NOISE}, "HyperCloning, SNR 10 dB"),
    ("stack 2x", {"layers": "2x", "how": "stack"}, "G_stack (Du et al. 2024)"),
    ("identity 2x", {"layers": "2x"}, "identity blocks (this package)"),
    ("tokens 2x exact", {"qkv": "2x", "proj": "2x", "ffn": "2x"}, "this package"),
    ("tokens 2x paper", {"qkv": "2x", "proj": "2x", "ffn": "2x", "recipe": "paper"},
     "TokenFormer paper"),
    ("tokens 2x official", {"qkv": "2x", "proj": "2x", "ffn": "2x", "strategy": "official"},
     "released code's init"),
]


def windows(tokens, count: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - seq_len - 1, (count,), generator=generator)
    return torch.stack([torch.from_numpy(tokens[s: s + seq_len].astype("int64"))
                        for s in starts.tolist()])


def load_with_optimizer(directory: Path) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    model = load_model(directory).float()
    names = read_state(directory).get("param_groups")
    optimizer = torch.optim.AdamW(param_groups(model, 0.0, names))
    optimizer.load_state_dict(load_optimizer_state(directory))  # weight decay, betas, moments
    return model, optimizer


@torch.no_grad()
def relative_logit_change(before: torch.nn.Module, after: torch.nn.Module,
                          probe: torch.Tensor) -> float:
    a = before.double()(probe).logits
    b = after.double()(probe).logits
    before.float(), after.float()
    return float((a - b).abs().max() / a.abs().max())


@torch.no_grad()
def val_loss(model: torch.nn.Module, batches: torch.Tensor) -> float:
    model.eval()
    loss = float(model(batches, labels=batches).loss)
    model.train()
    return loss


def run_operator(directory: Path, request: dict, args: argparse.Namespace,
                 train_batches: torch.Tensor, val_batches: torch.Tensor, probe: torch.Tensor
                 ) -> dict:
    model, optimizer = load_with_optimizer(directory)
    generator = torch.Generator().manual_seed(args.seed)
    grown, optimizer = grow_with_optimizer(model, optimizer, generator=generator, **request)
    change = relative_logit_change(model, grown, probe) if request else 0.0
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    curve = [(0, val_loss(grown, val_batches))]
    start = time.perf_counter()
    grown.train()
    for step in range(1, args.steps + 1):
        batch = train_batches[step - 1]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = grown(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(grown.parameters(), 1.0)
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, val_loss(grown, val_batches)))
    return {"params": grown.num_parameters(), "relative_logit_change": change, "curve": curve,
            "train_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="trained model directory with optimizer state")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated operator labels")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    data = default_dataset("bytes", progress=False)
    g = torch.Generator().manual_seed(args.seed)
    train_batches = torch.stack([windows(data.train, args.batch_size, args.seq_len, g)
                                 for _ in range(args.steps)])
    val_batches = windows(data.val, args.eval_batches, args.seq_len, g)
    probe = windows(data.val, 4, args.seq_len, g)
    chosen = OPERATORS if args.only is None else [
        op for op in OPERATORS if op[0] in args.only.split(",")]
    results = {}
    for label, request, _ in chosen:
        log(f"{label} ...")
        results[label] = run_operator(args.model, request, args, train_batches, val_batches,
                                      probe)
        r = results[label]
        log(f"  {r['params']:,} params, Δlogit {r['relative_logit_change']:.2e}, curve "
            + " ".join(f"{s}:{v:.4f}" for s, v in r["curve"]) + f" ({r['train_s']:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": command_line(), "machine": machine(),
                                         "results": results}, indent=2) + "\n")
    steps = [s for s, _ in next(iter(results.values()))["curve"]]
    print(f"Command: `{command_line()}`  \nMachine: {machine()}\n")
    print("| operator | parameters | max \\|Δlogit\\| (relative, float64) | "
          + " | ".join(f"val loss @{s}" for s in steps) + " | follows |")
    print("|---|---|---|" + "---|" * len(steps) + "---|")
    follows = {label: source for label, _, source in OPERATORS}
    for label, r in results.items():
        change = r["relative_logit_change"]
        shown = "0 (not grown)" if label == "none" else (f"{change:.1e}" if change > 0
                                                         else "0")
        print(f"| {label} | {r['params']:,} | {shown} | "
              + " | ".join(f"{v:.4f}" if math.isfinite(v) else "nan" for _, v in r["curve"])
              + f" | {follows[label]} |")


if __name__ == "__main__":
    main()
