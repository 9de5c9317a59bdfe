"""Conversions between model formats: released checkpoints, our folders and Hugging Face folders.

Each function reads any model spec :func:`tokenformer.formats.loading.load_model` reads, or a
released checkpoint, and writes another format (``tokenformer convert``). The Hugging Face side
(:mod:`tokenformer.hf`) needs the ``hf`` extra; this module imports it, so it is imported only
where a conversion is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from ..data.tokenizer import (
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    resolve_tokenizer,
    saved_tokenizer_folder,
)
from ..errors import ConfigError
from ..hf import TokenFormerForCausalLM, save_hf, to_hf_tokenizer
from ..io.files import atomic_dir
from ..io.outputs import check_not_input
from ..io.paths import has_regular_file
from ..models.lm import TokenFormerLM
from ..models.official import inexpressible, official_config, save_official
from .loading import load_model


def load_for_transformers(spec: str | Path, tokenizer: str | Path | None = None
                          ) -> tuple[TokenFormerForCausalLM, PreTrainedTokenizerFast]:
    """Model and tokenizer objects for transformers/lm-eval from any model spec."""
    model = TokenFormerForCausalLM.from_core(load_model(spec)).eval()
    tok = resolve_tokenizer(spec, model.config.to_core(), tokenizer)
    return model, to_hf_tokenizer(tok, model.config.max_seq_len)


def convert_official(src: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None,
                     overwrite: bool = False, command: str | None = None,
                     **official_kwargs: Any) -> Path:
    """Released checkpoint (``pytorch_model.bin``, its folder, or a DeepSpeed file) → HF folder.

    The tokenizer is ``tokenizer`` if given, else a ``tokenizer.json`` beside the checkpoint; with
    neither, the folder is written without one (loading the model still works).
    """
    check_not_input(out_dir, [src, tokenizer])  # overwrite=True would replace what it reads
    src = Path(src)
    core = TokenFormerLM.from_official(src, **official_kwargs)
    tok: Tokenizer | None = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        folder = src if src.is_dir() else src.parent
        if has_regular_file(folder / "tokenizer.json", folder=folder):
            tok = HFTokenizer(folder / "tokenizer.json", folder=folder)
    return save_hf(core, out_dir, tok, overwrite=overwrite, command=command)


def convert_to_hf(model_dir: str | Path, out_dir: str | Path, *,
                  tokenizer: str | Path | None = None, overwrite: bool = False,
                  command: str | None = None) -> Path:
    """Any model directory we write (``train``'s ``final`` or a checkpoint, ``grow``'s output; a
    TokenFormer or a Transformer baseline), or a preset, → a Hugging Face folder with its
    tokenizer (the one saved beside the model, ``tokenizer``, or bytes for 257 tokens)."""
    check_not_input(out_dir, [model_dir, tokenizer])
    core = load_model(model_dir)
    tok = resolve_tokenizer(model_dir, core.config, tokenizer)
    return save_hf(core, out_dir, tok, overwrite=overwrite, command=command)


def convert_to_official(model_dir: str | Path, out_dir: str | Path, *,
                        tokenizer: str | Path | None = None, overwrite: bool = False,
                        command: str | None = None) -> Path:
    """A TokenFormer folder (ours or Hugging Face) → a folder laid out like the released repos:
    ``pytorch_model.bin`` (official key names and order, fp32), ``config.json`` (the NeoX keys plus
    ``vocab_size``/``eos_token_id``, so converting back restores them) and, when the model has one,
    ``tokenizer.json``."""
    check_not_input(out_dir, [model_dir, tokenizer])
    out_dir = Path(out_dir)
    if out_dir.suffix == ".bin":
        raise ConfigError(f"to-official writes a folder like the released repos "
                          f"(pytorch_model.bin, config.json, tokenizer.json): give a folder "
                          f"name, not {out_dir.name}")
    model = load_model(model_dir)
    if type(model) is not TokenFormerLM:
        raise ConfigError(f"{model_dir} holds a {model.config.arch} baseline: the official "
                          f"layout exists only for TokenFormer (use to-hf)")
    beyond = inexpressible(model.config)
    if beyond:  # the official code would load the weights and compute another function
        raise ConfigError(f"the official layout cannot express {', '.join(beyond)}: use to-hf")
    tok: Tokenizer | None = None
    try:
        tok = resolve_tokenizer(model_dir, model.config, tokenizer)
    except ConfigError:
        # one was given or found (resolve_tokenizer's own rule), and it does not fit
        if tokenizer is not None or saved_tokenizer_folder(model_dir) is not None:
            raise
        # none beside the model (e.g. an official checkpoint converted without one): the
        # folder holds the weights and the config only
    with atomic_dir(out_dir, overwrite=overwrite, command=command) as tmp:
        save_official(model, tmp / "pytorch_model.bin")
        (tmp / "config.json").write_text(json.dumps(official_config(model.config), indent=2)
                                         + "\n")
        if tok is not None:
            to_hf_tokenizer(tok).backend_tokenizer.save(str(tmp / "tokenizer.json"))
    return out_dir
