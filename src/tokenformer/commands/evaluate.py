"""``tokenformer eval``: perplexity on text, or lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import json

from ..cli import device, positive
from ..errors import ConfigError


def run(args: argparse.Namespace) -> None:
    from .. import evaluate

    if args.data is not None:
        result = evaluate.evaluate_data(args.model, args.data, tokenizer=args.tokenizer,
                                        seq_len=args.seq_len, stride=args.stride,
                                        batch_size=args.batch_size, device=args.device)
        print(json.dumps(result) if args.json else evaluate.format_result(result))
        return
    if args.stride is not None or args.seq_len is not None:
        raise ConfigError("--stride and --seq-len apply to --data, not --tasks")
    results = evaluate.run_tasks(args.model, args.tasks.split(","), limit=args.limit,
                                 batch_size=args.batch_size, device=args.device,
                                 tokenizer=args.tokenizer, num_fewshot=args.num_fewshot)
    print(json.dumps(results) if args.json else evaluate.format_tasks(results))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss/perplexity/bits-per-byte on text, or lm-eval tasks")
    p.add_argument("model", help="model folder (ours or Hugging Face), official checkpoint, "
                                 "or preset name (random weights)")
    what = p.add_mutually_exclusive_group(required=True)
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
    p.set_defaults(func=run)
