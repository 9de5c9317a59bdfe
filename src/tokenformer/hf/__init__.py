"""Hugging Face ``transformers`` integration: registration, tokenizers, saving, conversions.

Importing this module registers ``model_type = "tokenformer"`` with ``AutoConfig``, ``AutoModel``,
``AutoModelForCausalLM`` and ``AutoModelForSequenceClassification``, so a folder written by
``save_pretrained`` (or ``save_hf``, a ``Trainer`` checkpoint, ``tokenformer convert``) loads with::

    import tokenformer.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out_dir")
    tokenizer = AutoTokenizer.from_pretrained("out_dir")

Every save also writes self-contained ``modeling_tokenformer.py`` / ``configuration_tokenformer.py``
(:mod:`tokenformer.hf.remote`), so ``trust_remote_code=True`` loads the folder where this package
is not installed. The classes are in :mod:`tokenformer.hf.modeling`; they wrap the core
:class:`~tokenformer.models.lm.TokenFormerLM` (or a Transformer baseline) as their ``model``
attribute, so weights are named ``model.<core name>`` and going back to the official layout is a
rename (:func:`tokenformer.models.official.ours_to_official`).

Decisions worth knowing:

* Logits cover the padded vocabulary (50304 rows for the released models), exactly as the official
  model and :class:`TokenFormerLM` compute them. Generation never emits the padding ids: the
  generation config lists them in ``suppress_tokens`` — the same rule as our own ``generate``.
* The output head *is* the embedding matrix (``F.linear(h, E)``): there is no second tensor, so
  ``_tied_weights_keys`` is empty and nothing needs tying after loading.
* Our attention calls ``cache.update(k, v, layer_idx)`` and ``cache.get_seq_length(layer_idx)``,
  the interface of a transformers ``Cache``, so ``generate()`` runs on a ``DynamicCache``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tok
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.utils import logging as hf_logging

from ..data.tokenizer import EOS_TOKEN, ByteTokenizer, HFTokenizer, Tokenizer
from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import verify_checkpoint
from ..io.files import atomic_dir
from ..io.paths import check_folder_files
from ..models.checks import check_buildable
from ..models.lm import TokenFormerLM
from ..nn.pattention import BLOCK_PATTENTIONS
from .modeling import (
    AUTO_MAP,
    REMOTE_MODULE,
    TokenFormerForCausalLM,
    TokenFormerForSequenceClassification,
    TokenFormerHFConfig,
    TokenFormerModel,
    TokenFormerPreTrainedModel,
    default_generation_config,
)
from .remote import write_remote_code

__all__ = [
    "AUTO_MAP", "REMOTE_MODULE", "TokenFormerForCausalLM", "TokenFormerForSequenceClassification",
    "TokenFormerHFConfig", "TokenFormerModel", "TokenFormerPreTrainedModel",
    "default_generation_config", "load_hf", "lora_target_parameters", "save_hf",
    "to_hf_tokenizer",
]


TokenFormerHFConfig.remote_code_writer = staticmethod(write_remote_code)
AutoConfig.register("tokenformer", TokenFormerHFConfig, exist_ok=True)
for _auto, _cls in ((AutoModel, TokenFormerModel), (AutoModelForCausalLM, TokenFormerForCausalLM),
                    (AutoModelForSequenceClassification, TokenFormerForSequenceClassification)):
    _auto.register(TokenFormerHFConfig, _cls, exist_ok=True)


# ------------------------------------------------------------------------------------- tokenizer
def byte_level_backend():
    """A ``tokenizers`` tokenizer giving exactly :class:`ByteTokenizer`'s ids.

    Byte-level BPE with the 256 single-byte tokens (id = byte value, GPT-2's byte→character
    alphabet) and no merges, plus ``<|endoftext|>`` = 256 as a special token.
    """
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = _Tok(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    return tok


def to_hf_tokenizer(tokenizer: Tokenizer, max_seq_len: int | None = None
                    ) -> PreTrainedTokenizerFast:
    """Our tokenizer (GPT-NeoX ``tokenizer.json`` or bytes) as a ``PreTrainedTokenizerFast``."""
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
    elif isinstance(tokenizer, ByteTokenizer):
        backend = byte_level_backend()
    else:
        raise ConfigError(f"cannot express tokenizer {type(tokenizer).__name__} as a "
                          f"PreTrainedTokenizerFast")
    special: dict[str, str] = {}
    if backend.token_to_id(EOS_TOKEN) is not None:
        special = {"eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN, "unk_token": EOS_TOKEN}
        # GPT-NeoX has a dedicated padding token; otherwise pad with eos, as GPT-2 does.
        special["pad_token"] = "<|padding|>" if backend.token_to_id("<|padding|>") is not None \
            else EOS_TOKEN
    extra = {"model_max_length": max_seq_len} if max_seq_len else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   **special, **extra)


# ------------------------------------------------------------------------------ saving, loading
def save_hf(model: TokenFormerLM | TokenFormerPreTrainedModel, out_dir: str | Path,
            tokenizer: Tokenizer | PreTrainedTokenizerFast | None = None,
            overwrite: bool = False, *, command: str | None = None) -> Path:
    """Write a ``from_pretrained``-loadable folder (safetensors, config, generation config, the
    remote code and, when given, the tokenizer); built under a temporary name and renamed when
    complete (:func:`tokenformer.io.files.atomic_dir`: ``command`` marks the folder, and with
    ``overwrite`` only a folder with that mark is replaced). A core model (TokenFormer or a
    baseline) is saved as ``TokenFormerForCausalLM``."""
    hf = model if isinstance(model, TokenFormerPreTrainedModel) else \
        TokenFormerForCausalLM.from_core(model)
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer = to_hf_tokenizer(tokenizer, hf.config.max_seq_len)
    if tokenizer is not None and len(tokenizer) > hf.config.padded_vocab_size:
        raise ConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
                          f"{hf.config.padded_vocab_size} rows")
    generation = getattr(hf, "generation_config", None)
    if tokenizer is not None and tokenizer.pad_token_id is not None and generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id  # <|padding|> for GPT-NeoX
    with atomic_dir(Path(out_dir), overwrite=overwrite, command=command) as tmp, \
            _no_progress_bars():
        hf.save_pretrained(tmp)  # + modeling_tokenformer.py, configuration_tokenformer.py
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without transformers' "Writing model shards" bar: for the one shard of these folders it
    says nothing, and a write that fails (a full disk) left it half drawn before the error."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_hf(path: str | Path, *, verify: bool = True, **kwargs: Any) -> TokenFormerForCausalLM:
    """``AutoModelForCausalLM.from_pretrained`` on a local folder, errors as one sentence.

    Before transformers reads it: the manifest rule (a folder with ``manifest.json`` is verified;
    ``verify=False`` only for a caller that just did) and, for our config, the model it describes
    against the weights file's header and the memory available
    (:func:`tokenformer.models.checks.check_buildable`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder not found: {path}")
    check_folder_files(path)  # transformers opens what it finds there: never a FIFO or a link
    if verify:
        verify_checkpoint(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if isinstance(config, TokenFormerHFConfig):
            weights = path / "model.safetensors"
            check_buildable(config.to_core(), str(path / "config.json"),
                            weights if weights.is_file() else None)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a loadable tokenformer folder: {first}") from None
    if not isinstance(model, TokenFormerForCausalLM):
        raise CheckpointError(f"{path} holds a {type(model).__name__}, not a tokenformer model")
    return model.eval()


# ----------------------------------------------------------------------------------------- PEFT
# The Pattentions of a block by their module names (PEFT targets the leaf name)
PATTENTION_NAMES = tuple(name.rsplit(".", 1)[-1] for name in BLOCK_PATTENTIONS)


def lora_target_parameters(modules: tuple[str, ...] | list[str] = PATTENTION_NAMES) -> list[str]:
    """``LoraConfig(target_parameters=...)`` for the parameter tokens of the named Pattentions.

    PEFT's ``target_modules`` route accepts only its known layer types (``nn.Linear`` …) and
    refuses a Pattention; its ``target_parameters`` route adds a low-rank update to a parameter
    itself, ``K_P + B·A``, which is exactly a LoRA of the token matrices, and merges exactly.
    """
    unknown = sorted(set(modules) - set(PATTENTION_NAMES))
    if unknown:
        raise ConfigError(f"unknown Pattention {unknown[0]!r}; choose from "
                          f"{', '.join(PATTENTION_NAMES)}")
    return [f"{m}.{t}" for m in modules for t in ("key_param_tokens", "value_param_tokens")]
