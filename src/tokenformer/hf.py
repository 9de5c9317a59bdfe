"""Hugging Face ``transformers`` integration (the only module of the package that imports it).

Importing this module registers ``model_type = "tokenformer"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so a folder written by ``save_pretrained`` (or by
``tokenformer convert official``) loads with::

    import tokenformer.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out_dir")
    tokenizer = AutoTokenizer.from_pretrained("out_dir")

``TokenFormerForCausalLM`` wraps the core :class:`~tokenformer.model.TokenFormerLM` as its
``model`` attribute; nothing is re-implemented. The folder's weights are therefore named
``model.<core name>`` (``model.layers.0.attention.query.key_param_tokens``), and going back to the
official layout is a rename (:func:`tokenformer.official.ours_to_official`).

Decisions worth knowing:

* Logits cover the padded vocabulary (50304 rows for the released models), exactly as the official
  model and :class:`TokenFormerLM` compute them. Generation never emits the padding ids: the saved
  ``generation_config.json`` lists them in ``suppress_tokens`` — the same rule as our own
  ``generate``.
* The output head *is* the embedding matrix (``F.linear(h, E)``): there is no second tensor, so
  ``_tied_weights_keys`` is empty and nothing needs tying after loading.
* Our attention calls ``cache.update(k, v, layer_idx)`` and ``cache.get_seq_length(layer_idx)``,
  the interface of a transformers ``Cache``, so ``generate()`` runs on a ``DynamicCache``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import TokenFormerConfig
from .errors import CheckpointError, ConfigError
from .io import atomic_dir
from .model import LayerNorm, RotaryEmbedding, TokenFormerLM, load_model
from .official import load_official, save_official
from .pattention import Pattention
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

EOS_TOKEN = "<|endoftext|>"
REMOTE_MODULE = "modeling_tokenformer"
REMOTE_CODE = (
    '"""TokenFormer for transformers\' trust_remote_code=True: pip install "tokenformer[hf]"."""\n'
    "from tokenformer.hf import TokenFormerForCausalLM, TokenFormerHFConfig\n\n"
    '__all__ = ["TokenFormerForCausalLM", "TokenFormerHFConfig"]\n')
_CORE_FIELDS = tuple(f.name for f in dataclasses.fields(TokenFormerConfig))


# ---------------------------------------------------------------------------------------- config
class TokenFormerHFConfig(PretrainedConfig):
    """A ``PretrainedConfig`` holding every :class:`TokenFormerConfig` field under the same name.

    The fields are read from the dataclass rather than listed here, so the two cannot drift apart.
    The usual transformers names (``num_hidden_layers``, ``num_attention_heads``,
    ``max_position_embeddings``) are aliases of ours. ``vocab_size`` is the tokenizer's vocabulary;
    the embedding (and the logits) have ``padded_vocab_size`` rows.
    """

    model_type = "tokenformer"
    attribute_map: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
        "max_position_embeddings": "max_seq_len"}
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(self, use_cache: bool = True, tie_word_embeddings: bool = True,
                 **kwargs: Any) -> None:
        defaults = TokenFormerConfig()
        for name in _CORE_FIELDS:
            setattr(self, name, kwargs.pop(name, getattr(defaults, name)))
        self.use_cache = use_cache
        # Informational: the head reads the embedding matrix itself (see the module docstring).
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)

    @property
    def padded_vocab_size(self) -> int:
        return self.to_core().padded_vocab_size

    def to_core(self) -> TokenFormerConfig:
        return TokenFormerConfig(**{name: getattr(self, name) for name in _CORE_FIELDS})

    @classmethod
    def from_core(cls, config: TokenFormerConfig) -> TokenFormerHFConfig:
        return cls(**config.to_dict())


# ----------------------------------------------------------------------------------------- model
class TokenFormerPreTrainedModel(PreTrainedModel):
    config: TokenFormerHFConfig
    config_class = TokenFormerHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values"]
    _tied_weights_keys = None  # the head is the embedding matrix itself: nothing to tie

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Official init; also refills the rotary tables, which transformers creates on the meta
        device and (being non-persistent buffers) never finds in the checkpoint."""
        if isinstance(module, Pattention):
            module.reset_parameters()  # torch.nn.init here is guarded by transformers: loaded
            # tensors (flagged ``_is_hf_initialized``) are left alone
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=self.config.init_std)
        elif isinstance(module, LayerNorm):
            if module.weight is not None:
                init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(module.dim, module.max_seq_len, self.config.rotary_base)
            init.copy_(module.cos_cached, fresh.cos_cached.to(module.cos_cached.device))
            init.copy_(module.sin_cached, fresh.sin_cached.to(module.sin_cached.device))


class TokenFormerForCausalLM(TokenFormerPreTrainedModel, GenerationMixin):
    """The core :class:`TokenFormerLM` behind the transformers ``PreTrainedModel`` API."""

    def __init__(self, config: TokenFormerHFConfig) -> None:
        super().__init__(config)
        self.model = TokenFormerLM(config.to_core())
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        if input_ids is None:
            raise ConfigError("TokenFormerForCausalLM needs input_ids (inputs_embeds is not "
                              "supported)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if attention_mask is not None and position_ids is None:
            # Left padding: real tokens count positions from 0, as in TokenFormerLM.generate.
            T = input_ids.shape[1]
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # all ones: let the core take its fused causal path
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, labels=labels, use_cache=use_cache,
                         logits_to_keep=logits_to_keep)
        result = CausalLMOutputWithPast(loss=out.loss, logits=out.logits,
                                        past_key_values=out.past_key_values)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_core(cls, core: TokenFormerLM) -> TokenFormerForCausalLM:
        """Wrap an existing core model (no copy: the wrapper shares its tensors)."""
        config = TokenFormerHFConfig.from_core(core.config)
        with torch.device("meta"), init.no_init_weights():
            wrapper = cls(config)
        wrapper.model = core
        wrapper.generation_config = default_generation_config(config)
        return wrapper.to(dtype=next(core.parameters()).dtype)


def default_generation_config(config: TokenFormerHFConfig) -> GenerationConfig:
    """Greedy by default; never emit the embedding's padding rows (as our own ``generate``)."""
    padded = config.padded_vocab_size
    return GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id,
        bos_token_id=None, do_sample=False,
        suppress_tokens=list(range(config.vocab_size, padded)) or None)


AutoConfig.register("tokenformer", TokenFormerHFConfig, exist_ok=True)
AutoModelForCausalLM.register(TokenFormerHFConfig, TokenFormerForCausalLM, exist_ok=True)


# ------------------------------------------------------------------------------------- tokenizer
def byte_level_backend():
    """A ``tokenizers`` tokenizer giving exactly :class:`ByteTokenizer`'s ids.

    Byte-level BPE with the 256 single-byte tokens (id = byte value, GPT-2's byte→character
    alphabet) and no merges, plus ``<|endoftext|>`` = 256 as a special token.
    """
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = _Tok(models.BPE(vocab=vocab, merges=[]))
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
def save_hf(model: TokenFormerLM | TokenFormerForCausalLM, out_dir: str | Path,
            tokenizer: Tokenizer | PreTrainedTokenizerFast | None = None,
            overwrite: bool = False) -> Path:
    """Write a ``from_pretrained``-loadable folder (safetensors, config, generation config and,
    when given, the tokenizer); built under a temporary name and renamed when complete."""
    hf = model if isinstance(model, TokenFormerForCausalLM) else \
        TokenFormerForCausalLM.from_core(model)
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerFast):
        tokenizer = to_hf_tokenizer(tokenizer, hf.config.max_seq_len)
    if tokenizer is not None and len(tokenizer) > hf.config.padded_vocab_size:
        raise ConfigError(f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
                          f"{hf.config.padded_vocab_size} rows")
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        hf.generation_config.pad_token_id = tokenizer.pad_token_id  # <|padding|> for GPT-NeoX
    out_dir = Path(out_dir)
    # auto_map + a two-line modeling file: trust_remote_code=True loads the folder without a
    # prior ``import tokenformer.hf`` (e.g. lm-eval's own CLI); the package must be installed.
    hf.config.auto_map = {"AutoConfig": f"{REMOTE_MODULE}.TokenFormerHFConfig",
                          "AutoModelForCausalLM": f"{REMOTE_MODULE}.TokenFormerForCausalLM"}
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        (tmp / f"{REMOTE_MODULE}.py").write_text(REMOTE_CODE)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out_dir


def load_hf(path: str | Path, **kwargs: Any) -> TokenFormerForCausalLM:
    """``AutoModelForCausalLM.from_pretrained`` on a local folder, errors as one sentence."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder not found: {path}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} is not a loadable tokenformer folder: {first}") from None
    if not isinstance(model, TokenFormerForCausalLM):
        raise CheckpointError(f"{path} holds a {type(model).__name__}, not a tokenformer model")
    return model.eval()


def load_for_transformers(spec: str | Path, tokenizer: str | Path | None = None
                          ) -> tuple[TokenFormerForCausalLM, PreTrainedTokenizerFast]:
    """Model and tokenizer objects for transformers/lm-eval from any model spec."""
    from .tokenizer import resolve_tokenizer

    model = TokenFormerForCausalLM.from_core(load_model(spec)).eval()
    tok = resolve_tokenizer(spec, model.config.to_core(), tokenizer)
    return model, to_hf_tokenizer(tok, model.config.max_seq_len)


# ---------------------------------------------------------------------------------- conversions
def convert_official(src: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None,
                     overwrite: bool = False, **official_kwargs: Any) -> Path:
    """Released checkpoint (``pytorch_model.bin``, its folder, or a DeepSpeed file) → HF folder.

    The tokenizer is ``tokenizer`` if given, else a ``tokenizer.json`` beside the checkpoint; with
    neither, the folder is written without one (loading the model still works).
    """
    src = Path(src)
    core = load_official(src, **official_kwargs)
    tok: Tokenizer | None = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        beside = (src if src.is_dir() else src.parent) / "tokenizer.json"
        if beside.is_file():
            tok = load_tokenizer(beside)
    return save_hf(core, out_dir, tok, overwrite=overwrite)


def convert_to_official(model_dir: str | Path, out_path: str | Path) -> Path:
    """An HF folder (or our own folder) → the official ``pytorch_model.bin`` key layout."""
    model = load_model(model_dir)
    save_official(model, out_path)
    return Path(out_path)
