"""The transformers classes: config, base model, causal LM and sequence classifier.

Every class wraps a core model (:class:`~tokenformer.models.lm.TokenFormerLM`, or a Transformer
baseline of :mod:`tokenformer.models.baselines` when ``config.arch`` names one) as its ``model``
attribute and calls its :meth:`~tokenformer.models.lm.TokenFormerLM.body` / ``forward``: nothing is
re-implemented, so weights are named ``model.<core name>`` in every class.

This module imports only torch, transformers and the pure-PyTorch core, because it is also the
source of the self-contained ``modeling_tokenformer.py`` written beside every saved model
(:mod:`tokenformer.hf.remote` inlines it with the core modules). Registration with the ``Auto*``
classes, tokenizers and conversions live in :mod:`tokenformer.hf`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import (
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)

from ..errors import ConfigError
from ..models.baselines import model_class
from ..models.generation import positions_from_mask
from ..models.lm import LayerNorm, RotaryEmbedding, TokenFormerLM
from ..nn.pattention import Pattention
from ..nn.product_keys import ProductKeyPattention

REMOTE_MODULE = "modeling_tokenformer"
REMOTE_CONFIG_MODULE = "configuration_tokenformer"
# config.json's auto_map: trust_remote_code=True loads a saved folder from its own files.
AUTO_MAP = {"AutoConfig": f"{REMOTE_CONFIG_MODULE}.TokenFormerHFConfig",
            "AutoModel": f"{REMOTE_MODULE}.TokenFormerModel",
            "AutoModelForCausalLM": f"{REMOTE_MODULE}.TokenFormerForCausalLM",
            "AutoModelForSequenceClassification":
                f"{REMOTE_MODULE}.TokenFormerForSequenceClassification"}
# The refusals, word for word as docs/huggingface.md quotes them.
OUTPUT_ATTENTIONS_REFUSED = (
    "output_attentions is not supported: TokenFormer's attention runs in torch's "
    "scaled_dot_product_attention, which never materialises the attention weights")
SLIDING_CACHE_REFUSED = (
    "a sliding-window cache is not supported: TokenFormer attends over every earlier position; "
    "use the default dynamic cache or cache_implementation='static'")
# With config.sliding_window set, transformers makes every cache it builds from the config slide
# (the default dynamic one and the static one alike): the advice above would not help. (One
# forward still runs, even one that returns a cache: only continuing from it would drop positions.)
SLIDING_WINDOW_REFUSED = (
    "config.sliding_window is {window}, so transformers builds every cache (the default dynamic "
    "one and the static one alike) as a sliding window, which TokenFormer does not support: it "
    "attends over every earlier position; set model.config.sliding_window = None (or run "
    "with use_cache=False)")
# transformers 5.24 renamed the cache from ``past_key_values`` to ``cache``: ``generate`` passes
# ``cache=`` to forward and reads ``outputs["cache"]`` back (generation/utils.py,
# prepare_inputs_for_generation and _update_model_kwargs_for_generation). Earlier 5.x releases use
# ``past_key_values`` for both. Forward takes either name; outputs use the installed release's
# field, so that generate finds the cache it handed in.
CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
               else "past_key_values")
BOTH_CACHE_NAMES_REFUSED = ("pass the cache as cache= or as past_key_values= (its name before "
                            "transformers 5.24), not both")
# PEFT's LoRA on the embedding adapts the input lookup only (the head reads the base matrix);
# merge_and_unload then folds the adapter into the one shared matrix, so the outputs change.
LORA_ON_EMBEDDING_WARNING = (
    "LoRA on word_embeddings adapts the input lookup but not the tied output head, which reads "
    "the same matrix; merge_and_unload() folds it into both and changes the outputs. Adapt the "
    "Pattention tokens instead: target_parameters=['key_param_tokens', 'value_param_tokens']")


# ---------------------------------------------------------------------------------------- config
def _core_fields(arch: str) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(model_class(arch).config_class)
                 if f.name != "arch")


class TokenFormerHFConfig(PretrainedConfig):
    """A ``PretrainedConfig`` holding every field of the core config under the same name.

    ``arch`` picks the core: ``tokenformer``
    (:class:`~tokenformer.models.config.TokenFormerConfig`) or a baseline (``transformer``,
    ``transformer++``:
    :class:`~tokenformer.models.baselines.TransformerConfig`).
    The fields are read from the dataclass rather than listed here, so the two cannot drift
    apart. The usual transformers names (``num_hidden_layers``, ``num_attention_heads``,
    ``max_position_embeddings``) are aliases of ours. ``vocab_size`` is the tokenizer's
    vocabulary; the embedding (and the logits) have ``padded_vocab_size`` rows.
    """

    model_type = "tokenformer"
    attribute_map: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
        "max_position_embeddings": "max_seq_len"}
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]
    # Writes the remote-code files beside config.json: tokenformer.hf sets it to
    # tokenformer.hf.remote.write_remote_code when the package is imported. In the generated
    # files it stays None: transformers copies them into a folder saved from remote code.
    remote_code_writer: ClassVar[Callable[[Any], None] | None] = None

    def __init__(self, arch: str = "tokenformer", use_cache: bool = True,
                 tie_word_embeddings: bool = True, **kwargs: Any) -> None:
        self.arch = arch
        defaults = model_class(arch).config_class(**({} if arch == "tokenformer"
                                                     else {"arch": arch}))
        for name in _core_fields(arch):
            setattr(self, name, kwargs.pop(name, getattr(defaults, name)))
        self.use_cache = use_cache
        # Informational: the head reads the embedding matrix itself (see TokenFormerLM).
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)

    @property
    def padded_vocab_size(self) -> int:
        return self.to_core().padded_vocab_size

    def to_core(self) -> Any:
        """The core config (``TokenFormerConfig`` or ``TransformerConfig``)."""
        values = {name: getattr(self, name) for name in _core_fields(self.arch)}
        if self.arch != "tokenformer":
            values["arch"] = self.arch
        return model_class(self.arch).config_class(**values)

    @classmethod
    def from_core(cls, config: Any) -> TokenFormerHFConfig:
        return cls(**config.to_dict())

    def save_pretrained(self, save_directory: Any, push_to_hub: bool = False,
                        **kwargs: Any) -> None:
        """``config.json`` with an ``auto_map``, plus the self-contained ``modeling_tokenformer.py``
        / ``configuration_tokenformer.py`` it names: ``trust_remote_code=True`` then loads the
        folder with nothing but torch and transformers installed. A model's ``save_pretrained``
        (so every ``Trainer`` checkpoint, and ``push_to_hub``) saves its config through here."""
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        if self.remote_code_writer is not None:  # None in the generated files themselves
            self.remote_code_writer(save_directory)


def default_generation_config(config: TokenFormerHFConfig) -> GenerationConfig:
    """Greedy by default; never emit the embedding's padding rows (as our own ``generate``)."""
    padded = config.padded_vocab_size
    return GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.eos_token_id,
        bos_token_id=None, do_sample=False,
        suppress_tokens=list(range(config.vocab_size, padded)) or None)


# ----------------------------------------------------------------------------------------- model
def _one_cache(past_key_values: Any | None, cache: Any | None) -> Any | None:
    """The cache under either of its names (see CACHE_FIELD)."""
    if past_key_values is not None and cache is not None:
        raise ConfigError(BOTH_CACHE_NAMES_REFUSED)
    return cache if cache is not None else past_key_values


class TokenFormerPreTrainedModel(PreTrainedModel):
    """What every class shares: the core as ``model``, init, gradient checkpointing and the
    argument checks. (The remote code is written by the config's ``save_pretrained``.)"""

    config: TokenFormerHFConfig
    config_class = TokenFormerHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # the only attention there is: F.scaled_dot_product_attention
    _no_split_modules: ClassVar[list[str]] = ["Block", "TransformerBlock"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["past_key_values", "cache"]
    _tied_weights_keys = None  # the head is the embedding matrix itself: nothing to tie

    def _build_core(self, config: TokenFormerHFConfig) -> None:
        core = config.to_core()
        self.model: TokenFormerLM = model_class(config.arch)(core)
        self.gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Official init; also refills the rotary tables, which transformers creates on the meta
        device and (being non-persistent buffers) never finds in the checkpoint. (``init.*``
        leaves tensors loaded from a checkpoint alone.)"""
        std = self.config.init_std
        if isinstance(module, (Pattention, ProductKeyPattention)):
            module.reset_parameters()  # torch.nn.init is guarded by transformers the same way
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Linear):  # baselines' projections, the classifier's score
            init.normal_(module.weight, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (LayerNorm, nn.RMSNorm)):
            if module.weight is not None:
                init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(module.dim, module.max_seq_len, self.config.rotary_base)
            init.copy_(module.cos_cached, fresh.cos_cached.to(module.cos_cached.device))
            init.copy_(module.sin_cached, fresh.sin_cached.to(module.sin_cached.device))

    @classmethod
    def from_core(cls, core: TokenFormerLM) -> Any:
        """Wrap an existing core model (no copy: the wrapper shares its tensors). For the classes
        whose weights are all the core's (``TokenFormerModel``, ``TokenFormerForCausalLM``)."""
        config = TokenFormerHFConfig.from_core(core.config)
        with torch.device("meta"), init.no_init_weights():
            wrapper = cls(config)
        wrapper.model = core
        if any(p.is_meta for p in wrapper.parameters()):
            raise ConfigError(f"{cls.__name__} has weights beyond the core model's; build it "
                              f"with from_pretrained or from its config instead")
        return wrapper.to(dtype=next(core.parameters()).dtype)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

    # ------------------------------------------------------------------ gradient checkpointing
    def _set_gradient_checkpointing(self, enable: bool = True,
                                    gradient_checkpointing_func: Any = checkpoint,
                                    every_n_layers: int = 1) -> None:
        """Checkpoint each block (every ``every_n_layers``-th), as the trainer's
        ``activation_checkpointing`` does: the block's forward runs under the given function."""
        for i, block in enumerate(self.model.layers):
            block.__dict__.pop("forward", None)  # back to the class's forward
            if enable and i % every_n_layers == 0:
                block.forward = functools.partial(gradient_checkpointing_func, block.forward)
        self.gradient_checkpointing = enable

    # ------------------------------------------------------------------ arguments
    def _core_kwargs(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                     past_key_values: Any | None, use_cache: bool | None,
                     output_attentions: bool | None, output_hidden_states: bool | None,
                     cache: Any | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """transformers' arguments → the core's; refuses what the core cannot do. The cache
        comes as ``past_key_values`` or ``cache`` (see CACHE_FIELD); ``kwargs["cache_position"]``:
        the static cache's slots, which generate passes before transformers 5.24 (later releases
        keep the count in the cache itself)."""
        past_key_values = _one_cache(past_key_values, cache)
        cache_position = kwargs.get("cache_position")
        if output_attentions or (output_attentions is None
                                 and getattr(self.config, "output_attentions", False)):
            raise ConfigError(OUTPUT_ATTENTIONS_REFUSED)
        if hasattr(self.model.word_embeddings, "base_layer"):  # wrapped by a PEFT adapter
            warnings.warn(LORA_ON_EMBEDDING_WARNING, UserWarning, stacklevel=3)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if past_key_values is not None and any(getattr(past_key_values, "is_sliding", ())):
            window = getattr(self.config, "sliding_window", None)
            raise ConfigError(SLIDING_CACHE_REFUSED if window is None
                              else SLIDING_WINDOW_REFUSED.format(window=window))
        if use_cache and self.gradient_checkpointing and self.training:
            use_cache = False  # recomputing a block would append its keys to the cache twice
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        # A 4-D mask is transformers' own for a static cache (generate builds it): the core's
        # static branch takes it as it is, and positions come from the cache slots.
        padding_mask = attention_mask is not None and attention_mask.dim() == 2
        if padding_mask and position_ids is None:
            # Left padding: real tokens count positions from 0, as in TokenFormerLM.generate.
            T = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            position_ids = positions_from_mask(attention_mask, T)
        if (padding_mask and not torch.compiler.is_compiling()
                and bool(attention_mask.all())):  # a compiled forward keeps the mask instead
            attention_mask = None  # all ones: let the core take its fused causal path
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        return dict(input_ids=input_ids, inputs_embeds=inputs_embeds,
                    attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past_key_values, use_cache=use_cache,
                    output_hidden_states=output_hidden_states, cache_position=cache_position)

    def _return(self, result: Any, return_dict: bool | None) -> Any:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return result if return_dict else result.to_tuple()


class TokenFormerModel(TokenFormerPreTrainedModel):
    """The base model (``AutoModel``): the final-normed hidden states, no head."""

    def __init__(self, config: TokenFormerHFConfig) -> None:
        super().__init__(config)
        self._build_core(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Any | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        body = self.model.body(**self._core_kwargs(
            input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, use_cache,
            output_attentions, output_hidden_states, cache, kwargs))
        return self._return(BaseModelOutputWithPast(
            last_hidden_state=body.last_hidden_state, hidden_states=body.hidden_states,
            **{CACHE_FIELD: body.past_key_values}), return_dict)


class TokenFormerForCausalLM(TokenFormerPreTrainedModel, GenerationMixin):
    """The core language model behind the transformers ``PreTrainedModel`` API."""

    def __init__(self, config: TokenFormerHFConfig) -> None:
        super().__init__(config)
        self._build_core(config)
        self.post_init()
        self.generation_config = default_generation_config(config)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, refusing a cache given under both of its names as forward
        does (transformers 5.24 would warn and use ``cache=``, dropping the other)."""
        _one_cache(kwargs.get("past_key_values"), kwargs.get("cache"))
        return super().generate(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: Any | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        # logits_to_keep: generate asks for the last position's logits only (with labels every
        # position is kept). Trainer with gradient accumulation passes the number of target
        # tokens of the whole accumulated batch (and then does not divide the loss itself): the
        # loss is then the sum over this micro-batch divided by it (transformers' causal-LM loss),
        # so that micro-batches are weighted by their tokens. Otherwise the core's mean, as always.
        num_items = kwargs.get("num_items_in_batch")
        core_kwargs = self._core_kwargs(input_ids, inputs_embeds, attention_mask, position_ids,
                                        past_key_values, use_cache, output_attentions,
                                        output_hidden_states, cache, kwargs)
        out = self.model(labels=labels if num_items is None else None,
                         logits_to_keep=0 if labels is not None else logits_to_keep,
                         **core_kwargs)
        loss = out.loss
        if labels is not None and num_items is not None:
            loss = self.loss_function(out.logits, labels, vocab_size=out.logits.shape[-1],
                                      num_items_in_batch=num_items)
        return self._return(CausalLMOutputWithPast(
            loss=loss, logits=out.logits, hidden_states=out.hidden_states,
            **{CACHE_FIELD: out.past_key_values}), return_dict)

    def resize_token_embeddings(self, new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """``new_num_tokens`` is the tokenizer's vocabulary (``len(tokenizer)``), as usual; the
        embedding keeps ``padded_vocab_size`` rows (a multiple of ``pad_to_multiple_of``, default
        the config's ``vocab_multiple``), so the config describes the resized model exactly and
        the saved folder reloads. The padding rows stay out of generation (``suppress_tokens``).
        """
        vocab = self.config.vocab_size if new_num_tokens is None else int(new_num_tokens)
        multiple = int(pad_to_multiple_of or self.config.vocab_multiple)
        if vocab <= 0 or multiple <= 0:
            raise ConfigError(f"resize_token_embeddings: need positive sizes, got "
                              f"new_num_tokens={new_num_tokens}, "
                              f"pad_to_multiple_of={pad_to_multiple_of}")
        rows = dataclasses.replace(self.model.config, vocab_size=vocab,
                                   vocab_multiple=multiple).padded_vocab_size
        embeddings = super().resize_token_embeddings(rows, None, mean_resizing)
        for config in (self.config, self.model.config):
            config.vocab_size, config.vocab_multiple = vocab, multiple
        self.generation_config.suppress_tokens = list(range(vocab, rows)) or None
        return embeddings


class TokenFormerForSequenceClassification(TokenFormerPreTrainedModel):
    """A linear ``score`` head on the hidden state of each sequence's last real token (the last
    position with ``attention_mask`` 1; without a mask, the last token that is not
    ``pad_token_id``, as transformers' decoders do; else the last position)."""

    # The loss is a mean over the batch and ignores num_items_in_batch: Trainer must divide it by
    # the gradient accumulation steps itself (it would not, seeing forward's **kwargs).
    accepts_loss_kwargs = False

    def __init__(self, config: TokenFormerHFConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self._build_core(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: Any | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutputWithPast | tuple:
        body = self.model.body(**self._core_kwargs(
            input_ids, inputs_embeds, attention_mask, position_ids,
            past_key_values, False if use_cache is None else use_cache, output_attentions,
            output_hidden_states, cache, kwargs))
        logits = self.score(body.last_hidden_state)
        B, T = logits.shape[:2]
        positions = torch.arange(T, device=logits.device)
        if attention_mask is not None:
            last = (attention_mask.to(logits.device).long() * positions).argmax(-1)
        elif input_ids is not None and getattr(self.config, "pad_token_id", None) is not None:
            last = ((input_ids != self.config.pad_token_id).long() * positions).argmax(-1)
        else:
            last = torch.full((B,), T - 1, device=logits.device)
        pooled = logits[torch.arange(B, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=pooled, config=self.config)
        return self._return(SequenceClassifierOutputWithPast(
            loss=loss, logits=pooled, hidden_states=body.hidden_states,
            **{CACHE_FIELD: body.past_key_values}), return_dict)

