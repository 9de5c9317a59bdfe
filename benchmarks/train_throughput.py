"""Training throughput: tokens/s and MFU of TokenFormer and of the FLOP-matched Transformer, fp32
and bf16, through the real training loop (:func:`tokenformer.training.fit`: forward, backward,
clipping, AdamW).

The four (model, precision) pairs of a preset are timed side by side: after a warm-up, rounds of
``--round-steps`` steps run round-robin (order rotated each round, see common.py) and the best
round of each pair gives its rate, so drift on a shared machine hits every pair alike.

    python benchmarks/train_throughput.py --cpu-time                   # demo size and `large`
    python benchmarks/train_throughput.py --cpu-time --presets small --rounds 3   # quicker

Targets (issue 8): bf16 tokens/s >= 2.5x fp32 for TokenFormer; at the demo size (preset
``small``, 16 × 256), TokenFormer / Transformer step-time ratio in bf16 <= 1.1x their FLOP
ratio. Prints a markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    add_clock_args,
    apply_clock_args,
    command_line,
    interleaved,
    machine,
    synchronized,
)

from tokenformer.models.baselines import TransformerLM, matched_config
from tokenformer.models.config import TokenFormerConfig, flops_per_token
from tokenformer.models.lm import TokenFormerLM
from tokenformer.nn.kernels import cpu_theta as kernels
from tokenformer.training.config import TrainConfig
from tokenformer.training.execution import Execution
from tokenformer.training.loop import RunState, fit

PRECISIONS = ("fp32", "bf16")
KERNEL = "TokenFormer (kernel)"


def matmul_ceiling(dtype: torch.dtype, n: int, rounds: int = 10,
                   device: torch.device | str = "cpu") -> float:
    """Best FLOP/s of an n×n @ n×n matmul (2n³ FLOPs) on ``device``."""
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    best = interleaved({"mm": synchronized(lambda: a @ b, device)}, rounds)["mm"]["min"]
    return 2 * n**3 / best


class Trainer:
    """One model at one precision, advanced ``round_steps`` steps of :func:`fit` per call (on
    ``device``, under torch.compile with ``compile``; ``flops_fn`` as fit's, for models that
    :func:`tokenformer.train.lm_flops` cannot count, e.g. Hugging Face ones)."""

    def __init__(self, model: torch.nn.Module, precision: str, batch_size: int, seq_len: int,
                 warmup: int, round_steps: int, impl: str = "auto", *,
                 device: torch.device | str = "cpu", compile: bool = False,
                 flops_fn: Callable | None = None) -> None:
        vocab = model.config.vocab_size

        def batch_fn(step: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
            return {"input_ids": ids, "labels": ids}

        self.batch_fn, self.round_steps = batch_fn, round_steps
        self.device, self.flops_fn = device, flops_fn
        self.cfg = TrainConfig(steps=warmup, batch_size=batch_size, seq_len=seq_len,
                               precision=precision, warmup_steps=1, eval_interval=0,
                               schedule="constant", pattention_impl=impl, compile=compile)
        result = fit(model, batch_fn, self.cfg, progress=False, execution=Execution(device=device),
                     flops_fn=flops_fn)
        self.model, self.optimizer, self.step = result.model, result.optimizer, warmup

    def __call__(self, steps: int | None = None) -> None:
        """``round_steps`` more steps (``steps`` if given: a profile of one)."""
        end = self.step + (steps or self.round_steps)
        fit(self.model, self.batch_fn, dataclasses.replace(self.cfg, steps=end),
            start=RunState(step=self.step, optimizer=self.optimizer),
            execution=Execution(device=self.device), progress=False, flops_fn=self.flops_fn)
        self.step = end


def measure(preset: str, args: argparse.Namespace) -> dict:
    tf_config = TokenFormerConfig.from_name(preset, max_seq_len=args.seq_len)
    configs = {"TokenFormer": tf_config, "Transformer": matched_config(tf_config, "transformer")}
    if kernels.available():  # the same model with impl="kernel" (tokenformer.nn.kernels.cpu_theta)
        configs = {"TokenFormer": tf_config, KERNEL: tf_config, **configs}
    trainers, per_token, params = {}, {}, {}
    for name, config in configs.items():
        per_token[name] = flops_per_token(config, args.seq_len, training=True)["total"]
        params[name] = config.num_parameters(non_embedding=True)
        for precision in PRECISIONS:
            torch.manual_seed(0)
            model = (TransformerLM if name == "Transformer" else TokenFormerLM)(config)
            trainers[name, precision] = Trainer(model, precision, args.batch_size, args.seq_len,
                                                args.warmup, args.round_steps,
                                                impl="kernel" if name == KERNEL else "fused")
    times = interleaved({f"{n}|{p}": t for (n, p), t in trainers.items()}, args.rounds, warmup=0)
    tokens = args.round_steps * args.batch_size * args.seq_len
    rates = {tuple(k.split("|")): tokens / v["min"] for k, v in times.items()}
    return {"preset": preset, "rates": rates, "per_token": per_token, "params": params,
            "mlp_width": configs["Transformer"].intermediate_size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["small", "large"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--matmul-n", type=int, default=1024)
    add_clock_args(parser)
    args = parser.parse_args(argv)
    clock = apply_clock_args(args)
    ceilings = {"fp32": matmul_ceiling(torch.float32, args.matmul_n),
                "bf16": matmul_ceiling(torch.bfloat16, args.matmul_n)}

    print("## Training throughput (issues 4, 8)\n")
    print(f"Command: `{command_line()}`  ")
    print(f"Machine: {machine()}; timing: {clock}  ")
    print(f"The training loop (`fit`: forward, backward, clipping, AdamW) on random batches of "
          f"{args.batch_size} × {args.seq_len} byte tokens; TokenFormer and the Transformer "
          f"matched to it in non-embedding parameters, each in fp32 and bf16 autocast, timed "
          f"side by side: {args.rounds} interleaved rounds of {args.round_steps} steps after "
          f"{args.warmup} warm-up steps, best round. FLOPs from `flops_per_token(..., "
          f"training=True)`; MFU = achieved FLOP/s ÷ the {args.matmul_n}³ matmul rate of the "
          f"same precision (fp32 {ceilings['fp32'] / 1e9:.1f}, bf16 "
          f"{ceilings['bf16'] / 1e9:.1f} GFLOP/s, "
          f"{ceilings['bf16'] / ceilings['fp32']:.2f}x). TokenFormer runs the PyTorch `fused` "
          f"Pattention (what the default `auto` trains with where the kernel cannot be built); "
          f"TokenFormer (kernel) the same model with `pattention_impl=kernel`, what `auto` runs "
          f"where it can ("
          + ("the C++ Θ kernel" if kernels.available()
             else f"not timed: {kernels.unavailable_reason()}") + ").\n")
    print("| preset | model | non-emb params | train FLOPs/token | precision | tokens/s | "
          "GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for preset in args.presets:
        r = measure(preset, args)
        results.append(r)
        for (name, precision), rate in r["rates"].items():
            achieved = rate * r["per_token"][name]
            print(f"| {preset} | {name} | {r['params'][name]:,} | {r['per_token'][name]:.4g} | "
                  f"{precision} | {rate:,.0f} | {achieved / 1e9:.2f} | "
                  f"{achieved / ceilings[precision]:.1%} |", flush=True)
    print()
    for r in results:
        rates, per_token = r["rates"], r["per_token"]
        for tf in [name for name in ("TokenFormer", KERNEL) if (name, "fp32") in rates]:
            speedup = rates[tf, "bf16"] / rates[tf, "fp32"]
            line = [f"`{r['preset']}`, {tf} (matched Transformer MLP width {r['mlp_width']}): "
                    f"bf16 / fp32 tokens/s {speedup:.2f}x "
                    f"({'met' if speedup >= 2.5 else 'not met'}: target >= 2.5x), Transformer "
                    f"{rates['Transformer', 'bf16'] / rates['Transformer', 'fp32']:.2f}x"]
            flop_ratio = per_token[tf] / per_token["Transformer"]
            for precision in PRECISIONS:
                time_ratio = rates["Transformer", precision] / rates[tf, precision]
                verdict = ""
                if precision == "bf16" and r["preset"] == "small":
                    verdict = f" ({'met' if time_ratio <= 1.1 * flop_ratio else 'not met'}: " \
                              f"target <= 1.1x at the demo size)"
                line.append(f"{precision} step-time ratio {tf} / Transformer {time_ratio:.3f} "
                            f"= {time_ratio / flop_ratio:.3f}x the FLOP ratio {flop_ratio:.3f}"
                            f"{verdict}")
            print("* " + "; ".join(line) + ".")
    print()


if __name__ == "__main__":
    main()
