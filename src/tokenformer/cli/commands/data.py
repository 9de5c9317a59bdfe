"""``tokenformer prepare``: text files, directories or a saved HF dataset → token files."""

from __future__ import annotations

import argparse

from ...data.corpus import default_dataset
from ...data.datasets import summary, unigram_entropy
from ...data.prepare import prepare
from ...errors import ConfigError
from ..options import DeprecatedFlag


def prepare_command(args: argparse.Namespace) -> None:
    if args.default:
        if args.inputs or args.out:
            raise ConfigError("--default prepares the embedded corpus into the cache; "
                              "give no inputs and no --out with it")
        dataset = default_dataset(args.tokenizer, cache_dir=args.cache_dir,
                                  progress=not args.no_progress)
    else:
        if not args.inputs or not args.out:
            raise ConfigError("give input files or directories and --out DIR "
                              "(or --default for the embedded corpus)")
        dataset = prepare(args.inputs, args.tokenizer, args.out, val_fraction=args.val_fraction,
                          progress=not args.no_progress, overwrite=args.overwrite)
    print(summary(dataset))
    print(f"unigram entropy (train) {unigram_entropy(dataset):.4f} nats/token")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare", help="tokenize text into train.bin/val.bin/meta.json",
        description="Tokenize text files, directories (every non-hidden file, sorted) or a saved "
                    "Hugging Face dataset into DIR/train.bin, DIR/val.bin and DIR/meta.json. The "
                    "validation split is the last --val-fraction of the text.")
    p.add_argument("inputs", nargs="*", help="text files, directories, or a saved HF dataset")
    p.add_argument("--tokenizer", default="bytes",
                   help="'bytes' (default), a tokenizer.json path, or bpe:VOCAB to train a "
                        "byte-level BPE on the training text")
    p.add_argument("--out", default=None, help="output directory (must not exist)")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="fraction of the text, taken from its end, held out (default 0.05)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if an earlier tokenformer prepare wrote it (never a "
                        "folder it did not write)")
    p.add_argument("--default", action="store_true",
                   help="prepare the embedded King James Bible corpus into the cache instead")
    p.add_argument("--cache-dir", default=None,
                   help="cache for --default (default $TOKENFORMER_CACHE or ~/.cache/tokenformer)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", dest="no_progress", action=DeprecatedFlag, new="--no-progress")
    p.set_defaults(func=prepare_command)
