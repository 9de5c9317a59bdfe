"""``tokenformer convert official | to-hf | to-official`` (needs the hf extra)."""

from __future__ import annotations

import argparse
import contextlib

from ...errors import ConfigError
from ...io.files import stop_on_disk_full
from ...io.outputs import check_output


def _hf():
    """:mod:`tokenformer.formats.convert`, which needs the optional transformers."""
    try:
        from ...formats import convert
    except ImportError:
        raise ConfigError("this command needs transformers: "
                          "pip install 'tokenformer[hf]'") from None
    return convert


def _on_disk_full(out_dir: str) -> contextlib.AbstractContextManager[None]:
    """A conversion builds its folder under a temporary name (removed on failure) and renames it
    when complete: a full disk leaves ``out_dir`` as it was."""
    return stop_on_disk_full(out_dir, "nothing was written; free space and rerun the same "
                                      "command")


def convert_official(args: argparse.Namespace) -> None:
    check_output(args.out_dir, [args.checkpoint, args.tokenizer], command="convert official",
                 overwrite=args.overwrite, flag="out_dir")
    with _on_disk_full(args.out_dir):
        out = _hf().convert_official(args.checkpoint, args.out_dir, tokenizer=args.tokenizer,
                                     overwrite=args.overwrite, num_heads=args.num_heads,
                                     rotary_pct=args.rotary_pct, max_seq_len=args.max_seq_len,
                                     norm=args.norm, command="convert official")
    _print_loadable(out)


def convert_to_hf(args: argparse.Namespace) -> None:
    check_output(args.out_dir, [args.model_dir, args.tokenizer], command="convert to-hf",
                 overwrite=args.overwrite, flag="out_dir")
    with _on_disk_full(args.out_dir):
        out = _hf().convert_to_hf(args.model_dir, args.out_dir, tokenizer=args.tokenizer,
                                  overwrite=args.overwrite, command="convert to-hf")
    _print_loadable(out)


def _print_loadable(out: object) -> None:
    print(f"wrote {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}, "
          f"trust_remote_code=True), or without trust_remote_code after import tokenformer.hf)")


def convert_to_official(args: argparse.Namespace) -> None:
    check_output(args.out_dir, [args.model_dir, args.tokenizer], command="convert to-official",
                 overwrite=args.overwrite, flag="out_dir")
    with _on_disk_full(args.out_dir):
        out = _hf().convert_to_official(args.model_dir, args.out_dir, tokenizer=args.tokenizer,
                                        overwrite=args.overwrite, command="convert to-official")
    print(f"wrote {out} (pytorch_model.bin in the official GPT-NeoX TokenFormer key layout, fp32; "
          f"config.json)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert between official checkpoints, our model "
                                       "directories and Hugging Face folders")
    conv = p.add_subparsers(dest="direction", metavar="DIRECTION", parser_class=type(p))
    conv.required = True

    q = conv.add_parser("official", help="official pytorch_model.bin (or its folder, or a "
                                         "DeepSpeed checkpoint) -> Hugging Face folder")
    q.add_argument("checkpoint", help="pytorch_model.bin, its folder, or a DeepSpeed folder")
    q.add_argument("out_dir", help="output folder (safetensors + config + tokenizer)")
    q.add_argument("--tokenizer", default=None,
                   help="tokenizer.json to include (default: the one beside the checkpoint)")
    q.add_argument("--num-heads", type=int, default=None,
                   help="attention heads (default: config.json, else as released for the size)")
    q.add_argument("--rotary-pct", type=float, default=None)
    q.add_argument("--max-seq-len", type=int, default=None)
    q.add_argument("--norm", default=None, help="Θ variant (default: config.json or "
                                                "l2_norm_gelu)")
    q.add_argument("--overwrite", action="store_true",
                   help="replace out_dir if an earlier convert official wrote it (never a "
                        "folder it did not write)")
    q.set_defaults(func=convert_official)

    q = conv.add_parser("to-hf", help="a model directory of ours (TokenFormer or a Transformer "
                                      "baseline: train's final/ or a checkpoint, grow's output) "
                                      "-> Hugging Face folder")
    q.add_argument("model_dir", help="model directory (config.json + model.safetensors)")
    q.add_argument("out_dir", help="output folder (safetensors, config, remote code, tokenizer)")
    q.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or 'bytes' (default: the one saved beside the model, "
                        "else bytes for a 257-token vocabulary)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    q.set_defaults(func=convert_to_hf)

    q = conv.add_parser("to-official", help="TokenFormer folder (ours or Hugging Face) -> folder "
                                            "like the released repos (pytorch_model.bin, "
                                            "config.json, tokenizer.json)")
    q.add_argument("model_dir")
    q.add_argument("out_dir", help="output folder")
    q.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or 'bytes' to include (default: the model's own)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    q.set_defaults(func=convert_to_official)
