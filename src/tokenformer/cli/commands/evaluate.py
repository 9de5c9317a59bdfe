"""``tokenformer eval``: perplexity on text, or lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...errors import ConfigError
from ...eval import evaluate
from ...eval import tasks as eval_tasks
from ...io.outputs import check_not_input
from ..options import device, positive


def task_dir() -> Path:
    """The installed folder of the shipped lm-eval task YAMLs (for ``lm_eval --include_path``)."""
    return Path(eval_tasks.__file__).parent


def run(args: argparse.Namespace) -> None:
    if args.task_dir:
        print(task_dir())
        return
    if args.model is None or (args.data is None and args.tasks is None):
        raise ConfigError("give a MODEL and one of --data or --tasks (or --task-dir alone)")
    if args.data is not None:
        if args.output_path is not None or args.log_samples:
            raise ConfigError("--output-path and --log-samples apply to --tasks; --json prints "
                              "the --data result")
        result = evaluate.evaluate_data(args.model, args.data, tokenizer=args.tokenizer,
                                        seq_len=args.seq_len, stride=args.stride,
                                        batch_size=args.batch_size, device=args.device,
                                        progress=not args.no_progress)
        print(json.dumps(result) if args.json else evaluate.format_result(result))
        return
    if args.stride is not None or args.seq_len is not None:
        raise ConfigError("--stride and --seq-len apply to --data, not --tasks")
    if args.output_path is not None:  # lm-eval adds files there: never into the model folder

        check_not_input(args.output_path, [args.model, args.tokenizer], "--output-path")
    results = evaluate.run_tasks(args.model, args.tasks.split(","), limit=args.limit,
                                 batch_size=args.batch_size, device=args.device,
                                 tokenizer=args.tokenizer, num_fewshot=args.num_fewshot,
                                 output_path=args.output_path, log_samples=args.log_samples)
    if args.output_path is not None:
        print(f"lm-eval results{' and samples' if args.log_samples else ''} written under "
              f"{args.output_path}", file=sys.stderr)
    print(json.dumps(results) if args.json else evaluate.format_tasks(results))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss/perplexity/bits-per-byte on text, or lm-eval tasks")
    p.add_argument("model", nargs="?", help="model folder (ours or Hugging Face), official "
                                            "checkpoint, or preset name (random weights)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--data", help="a UTF-8 text file, or a prepared folder (val split)")
    what.add_argument("--tasks", help="comma-separated lm-eval tasks, e.g. kjv_lastword,"
                                      "kjv_choice (offline) or lambada_openai,hellaswag (download)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or 'bytes' (default: the one saved with the model)")
    p.add_argument("--seq-len", type=positive(int), default=None,
                   help="window length (default: the model's context)")
    p.add_argument("--stride", type=positive(int), default=None,
                   help="tokens scored per window after the first, <= seq-len - 1 (default: "
                        "seq-len - 1); each token sees >= seq-len - stride tokens of context")
    p.add_argument("--batch-size", type=positive(int), default=8)
    p.add_argument("--limit", type=positive(int), default=None,
                   help="lm-eval: at most this many examples per task")
    p.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: few-shot examples")
    p.add_argument("--device", type=device, default="cpu")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="--data: no progress bar")
    p.add_argument("--output-path", default=None, metavar="DIR",
                   help="lm-eval: write the results JSON under DIR, as lm_eval --output_path")
    p.add_argument("--log-samples", action="store_true",
                   help="lm-eval: also write every document's inputs and outputs (JSONL per "
                        "task) under --output-path, as lm_eval --log_samples")
    p.add_argument("--task-dir", action="store_true",
                   help="print the folder of the shipped offline tasks and exit: "
                        "lm_eval --include_path \"$(tokenformer eval --task-dir)\"")
    p.set_defaults(func=run)
