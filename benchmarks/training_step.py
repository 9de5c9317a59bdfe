"""The training step's two speed choices of issue 43, side by side on this machine
(docs/performance.md, "The training step"):

* the matched Transformer++ with separate Q/K/V and gate/up Linears vs ``fused_projections``
  (one GEMM each), a whole training step (``fit``: forward, backward, clipping, AdamW);
* AdamW's implementations on the CPU: the per-tensor loop (torch's CPU default, what
  ``training.optim`` keeps here), ``foreach`` and torch's ``fused`` kernel (what it uses on
  CUDA), ``optimizer.step()`` alone over a model's parameters, beside that model's whole step,
  and the largest difference of the weights from the loop's after the timed steps.

    python benchmarks/training_step.py --cpu-time                    # ≈ 4 min on 2 busy cores
    python benchmarks/training_step.py --cpu-time --adamw-presets small --rounds 3  # quicker

Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_clock_args, apply_clock_args, command_line, interleaved, log, machine
from train_throughput import Trainer

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.models.baselines import TransformerLM, matched_config
from tokenformer.training.optim import param_groups

ADAMW = {"per-tensor loop (torch's CPU default; ours on the CPU)": {"foreach": False},
         "foreach": {"foreach": True}, "fused (ours on CUDA)": {"fused": True}}


def baseline_rows(preset: str, args: argparse.Namespace) -> list[str]:
    """Step ms of the matched Transformer++ unfused and fused (fit, fp32 and bf16)."""
    config = matched_config(TokenFormerConfig.from_name(preset, max_seq_len=args.seq_len),
                            "transformer++")
    trainers = {}
    for fused in (False, True):
        for precision in args.precisions:
            torch.manual_seed(0)
            model = TransformerLM(dataclasses.replace(config, fused_projections=fused))
            trainers[fused, precision] = Trainer(model, precision, args.batch_size,
                                                 args.seq_len, args.warmup, args.round_steps)
    log(f"{preset}: timing the Transformer++ steps")
    times = interleaved({f"{f}|{p}": t for (f, p), t in trainers.items()}, args.rounds, warmup=0)
    rows = []
    for precision in args.precisions:
        plain, fused = (times[f"{f}|{precision}"] for f in (False, True))
        rows.append(f"| {preset} (MLP {config.intermediate_size}) | {precision} | "
                    f"{plain['min'] / args.round_steps * 1e3:.1f} | "
                    f"{fused['min'] / args.round_steps * 1e3:.1f} | "
                    f"{fused['min'] / plain['min']:.3f}x |")
    return rows


def adamw_rows(preset: str, args: argparse.Namespace) -> list[str]:
    """ms per ``optimizer.step()`` of each implementation over the TokenFormer's parameters
    (fixed random gradients), with the whole fp32 step of the same model for scale."""
    model_config = TokenFormerConfig.from_name(preset, max_seq_len=args.seq_len)
    reference = [p.detach() for p in _model(model_config).parameters()]
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=g) for p in reference]
    optimizers, weights = {}, {}
    for name, kwargs in ADAMW.items():
        params = [torch.nn.Parameter(p.clone()) for p in reference]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        optimizers[name] = torch.optim.AdamW(
            param_groups(_Holder(params), 0.1), lr=1e-3, betas=(0.9, 0.95), **kwargs)
        optimizers[name].step()  # the moments exist before timing
        weights[name] = params
    times = interleaved({n: opt.step for n, opt in optimizers.items()}, args.rounds * 3)
    whole = interleaved({"step": Trainer(_model(model_config), "fp32", args.batch_size,
                                         args.seq_len, args.warmup, 1)}, args.rounds)["step"]
    base = weights[next(iter(ADAMW))]
    rows = []
    for name, t in times.items():
        diff = max((a - b).abs().max().item() for a, b in zip(weights[name], base, strict=True))
        rows.append(f"| {preset} ({sum(p.numel() for p in reference):,} params, "
                    f"{len(reference)} tensors) | {name} | {t['min'] * 1e3:.2f} | "
                    f"{t['median'] * 1e3:.2f} | "
                    f"{t['min'] / whole['min']:.1%} | {diff:.2g} |")
    return rows


class _Holder(torch.nn.Module):
    """A module holding ``params`` under their index (param_groups reads named_parameters)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def _model(config: TokenFormerConfig) -> TokenFormerLM:
    torch.manual_seed(0)
    return TokenFormerLM(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small"],
                        help="TokenFormer presets whose matched Transformer++ is timed")
    parser.add_argument("--adamw-presets", nargs="+", default=["small", "large"],
                        help="TokenFormer presets whose parameters AdamW steps over")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--round-steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    baseline, adam = [], []
    for preset in args.presets:
        baseline += baseline_rows(preset, args)
    for preset in args.adamw_presets:
        adam += adamw_rows(preset, args)
    print("## The training step (issue 43), CPU\n")
    print(f"Command: `{command_line()}`  \n{machine()}; {clock}\n")
    print(f"Matched Transformer++ (TokenFormer preset's width, depth and non-embedding "
          f"parameters), one training step (`fit`) of {args.batch_size} × {args.seq_len} "
          f"tokens; best of {args.rounds} interleaved rounds of {args.round_steps} steps.\n")
    print("| model | precision | separate Q/K/V, gate/up ms/step | fused ms/step | "
          "fused ÷ separate |")
    print("|---|---|---|---|---|")
    print("\n".join(baseline))
    print(f"\nAdamW `step()` over the TokenFormer's parameters (two groups, weight decay 0.1, "
          f"fixed gradients), best of {args.rounds * 3} interleaved calls; beside the whole "
          f"fp32 step of that model (`fit`, {args.batch_size} × {args.seq_len}); max |Δw|: "
          f"the weights after the timed steps against the loop's.\n")
    print("| model | AdamW | ms/step (min) | median | of a training step | max abs Δw vs the "
          "loop |")
    print("|---|---|---|---|---|---|")
    print("\n".join(adam))


if __name__ == "__main__":
    main()
