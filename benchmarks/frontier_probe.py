"""Milliseconds per training step of one run of a ``tokenformer scale`` preset at one (family,
size), trained the way the frontier trains it (``fit``, the preset's batch shape, precision and
Pattention implementation), in one of three modes: ``eager``; ``compiled``
(``TrainConfig.compile``: inductor, ``scale --compile default``); ``graphs``
(``compile_mode="reduce-overhead"``: inductor, the forward and backward replayed as CUDA graphs
instead of hundreds of small kernels; ``scale --compile reduce-overhead``). One JSON line on
stdout.

    python benchmarks/frontier_probe.py --preset gpu-code --family tokenformer --mode graphs

With ``--barrier DIR`` the process writes ``DIR/ready-<pid>`` after its warm-up steps (compiles
included) and waits for ``DIR/go`` before its timed steps: benchmarks/gpu.py's ``concurrency``
stage starts k of these at once and releases them together, so that the timed steps of the k
runs overlap (issue 35: how many runs one GPU should train at once, and whether CUDA graphs of
the step beat more processes). ``--smoke``: a 2 × 32 batch in fp32, for a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's library

from tokenformer.experiments.frontier.configs import arch, model_configs
from tokenformer.experiments.frontier.presets import get_preset
from tokenformer.models.baselines import model_class
from tokenformer.training.config import TrainConfig
from tokenformer.training.execution import Execution
from tokenformer.training.loop import fit

MODES = ("eager", "compiled", "graphs")
VOCAB = 256  # the presets' byte-level corpora


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpu-code")
    parser.add_argument("--family", default="tokenformer")
    parser.add_argument("--size", default=None, help="a size of the family (default: largest)")
    parser.add_argument("--mode", choices=MODES, default="eager")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compiles too)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--device", default=None, help="default: cuda where available")
    parser.add_argument("--barrier", default=None, help="wait for DIR/go before timing")
    parser.add_argument("--barrier-timeout", type=float, default=600)
    parser.add_argument("--smoke", action="store_true", help="a toy batch in fp32 (a CPU)")
    return parser.parse_args(argv)


def sizes(preset_name: str, family: str, smoke: bool = False) -> dict[str, object]:
    """The family's sizes in the preset, smallest first (their model configs)."""
    return model_configs(preset(preset_name, smoke), family, VOCAB)


def preset(name: str, smoke: bool) -> object:
    found = get_preset(name)
    return dataclasses.replace(found, seq_len=32, batch_size=2) if smoke else found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke:  # k toy runs on a CPU: one thread each, as the frontier's workers
        torch.set_num_threads(1)
    p = preset(args.preset, args.smoke)
    configs = sizes(args.preset, args.family, args.smoke)
    size = args.size or list(configs)[-1]
    if size not in configs:
        print(f"error: {args.family} has no size {size!r} in {args.preset} "
              f"({', '.join(configs)})", file=sys.stderr)
        return 2
    precision = "bf16" if device.type == "cuda" and str(p.dtype).startswith("bf") else "fp32"
    torch.manual_seed(0)
    model = model_class(arch(args.family))(configs[size]).to(device)
    cfg = TrainConfig(arch=arch(args.family), seq_len=p.seq_len, batch_size=p.batch_size,
                      steps=args.warmup + args.steps, lr=1e-3, warmup_steps=0,
                      precision=precision, device=str(device), eval_interval=0, samples=0,
                      compile=args.mode != "eager", pattention_impl=p.pattention_impl,
                      # graphs: what `tokenformer scale --compile reduce-overhead` trains with
                      compile_mode="reduce-overhead" if args.mode == "graphs" else "default")
    ids = torch.randint(0, VOCAB, (p.batch_size, p.seq_len), device=device)
    released = [args.barrier is None]

    def wait_for_go(record: dict, model: torch.nn.Module) -> None:
        if record["type"] != "train" or record["step"] != args.warmup or released[0]:
            return
        barrier = Path(args.barrier)
        (barrier / f"ready-{os.getpid()}").touch()
        deadline = time.monotonic() + args.barrier_timeout
        while not (barrier / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {barrier / 'go'} after {args.barrier_timeout:.0f} s")
            time.sleep(0.01)
        released[0] = True

    start = time.perf_counter()
    result = fit(model, lambda step: {"input_ids": ids, "labels": ids}, cfg,
                 execution=Execution(device=device),
                 progress=False, callbacks=[wait_for_go])
    seconds = [cfg.batch_size * cfg.seq_len / r["tokens_per_s"] for r in result.records
               if r["type"] == "train"]
    timed = seconds[args.warmup:]
    print(json.dumps({"preset": args.preset, "family": args.family, "size": size,
                      "mode": args.mode, "device": device.type, "precision": precision,
                      "ms_per_step": 1000 * statistics.median(timed),
                      "ms_per_step_mean": 1000 * statistics.fmean(timed),
                      "first_step_s": seconds[0], "wall_s": time.perf_counter() - start,
                      "pid": os.getpid()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
