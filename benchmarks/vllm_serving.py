"""vLLM against our own ``generate`` on the CPU: greedy tokens per second at batch 1, 8 and 32.

Runs in the virtualenv of the ``vllm`` extra (docs/serving.md), not in run_all's:

    python benchmarks/vllm_serving.py                        # TokenFormer-150M, random weights
    python benchmarks/vllm_serving.py --model tf150m-hf      # a converted checkpoint
    python benchmarks/vllm_serving.py --threads 2 --rounds 5

Both sides run in this process, on the same torch threads (``--threads``), in float32, one after
the other within each round (order rotated; :func:`common.interleaved`): vLLM's engine and
worker in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no thread binding), so that neither
side has cores the other lacks — a deployed ``vllm serve`` runs its worker in a process of its
own, bound to the cores vLLM picks. Each call generates ``--new`` tokens after a ``--prompt``-token
prompt for every row of the batch (vLLM: ``ignore_eos``); tokens/s = batch × new tokens / seconds
of the whole call, prefill included. Prints a section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, interleaved, log, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tokenformer-150m",
                        help="random-weight model of this preset (default tokenformer-150m)")
    parser.add_argument("--model", default=None, help="a Hugging Face folder instead of --preset")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    args = parser.parse_args(argv)
    # Before vLLM is imported: in-process engine, no binding, our thread count kept.
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      OMP_NUM_THREADS=str(args.threads))
    # vLLM logs to stdout by default: keep stdout for the section
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch
    from vllm import LLM, SamplingParams

    from tokenformer import TokenFormerConfig, TokenFormerLM
    from tokenformer.hf import load_hf, save_hf

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            torch.manual_seed(0)
            folder = save_hf(TokenFormerLM(TokenFormerConfig.from_name(args.preset)),
                             Path(tmp) / args.preset)
        else:
            folder = Path(args.model)
        ours = load_hf(folder).model
        config = ours.config
        llm = LLM(str(folder), dtype="float32", enforce_eager=True,
                  max_model_len=args.prompt + args.new, max_num_seqs=max(batches),
                  max_num_batched_tokens=max(batches) * args.prompt + max(batches),
                  kv_cache_memory_bytes=1 << 30, skip_tokenizer_init=True)
        sampling = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
        rows = []
        for batch in batches:
            prompts = torch.randint(0, config.vocab_size, (batch, args.prompt),
                                    generator=torch.Generator().manual_seed(batch))
            requests = [{"prompt_token_ids": p} for p in prompts.tolist()]
            log(f"[vllm_serving] batch {batch}")
            times = interleaved({
                "ours": lambda p=prompts: ours.generate(p, max_new_tokens=args.new),
                "vllm": lambda r=requests: llm.generate(r, sampling, use_tqdm=False),
            }, rounds=args.rounds, warmup=1)
            rows.append((batch, {k: batch * args.new / v["min"] for k, v in times.items()},
                         {k: batch * args.new / v["median"] for k, v in times.items()}))
    name = args.model or f"`{args.preset}` (random weights)"
    print("## vLLM serving (issue 45), CPU\n")
    print(f"Command: `{command_line()}` (in the vllm extra's virtualenv)  ")
    print(f"Machine: {machine()}  ")
    print(f"{name}, float32, greedy, {args.prompt}-token prompts, {args.new} new tokens per row; "
          f"both sides in one process on {args.threads} torch thread(s), interleaved "
          f"({args.rounds} rounds after 1 warm-up). Tokens/s of the fastest round (median in "
          f"brackets); ratio = vLLM / ours.\n")
    print("| batch | ours tok/s | vLLM tok/s | vLLM / ours |")
    print("|---|---|---|---|")
    for batch, best, median in rows:
        print(f"| {batch} | {best['ours']:.1f} ({median['ours']:.1f}) | "
              f"{best['vllm']:.1f} ({median['vllm']:.1f}) | {best['vllm'] / best['ours']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
