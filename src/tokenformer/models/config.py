"""Model configuration: one dataclass, named presets, and the analytic parameter/FLOP counts.

Every number the trainer, the benchmarks and the experiments report about model size or compute
comes from :func:`TokenFormerConfig.num_parameters` and :func:`flops_per_token` here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..io.files import atomic_write_text
from ..io.paths import regular_file
from ..nn.theta import THETAS, default_scale, theta_variant

BLOCK_NORMS = ("none", "weight", "bias", "both")
FFN_KEYS = ("dense", "product")


# ------------------------------------------------------------------------- field validation
@dataclass(frozen=True)
class FieldRule:
    """What a config field allows beyond its type. ``text`` completes "must be ...": ``{a}`` is
    the type with its article ("an integer"), ``{t}`` without ("integer"), or is a function
    giving that text when a check fails (choices that can grow: the Θ table); ``ok`` tests a
    value already of the field's type."""

    text: str | Callable[[], str]
    ok: Callable[[Any], bool]

    def describe(self) -> str:
        return self.text() if callable(self.text) else self.text


def one_of(options: Collection[str]) -> FieldRule:
    """A field that must be one of ``options``, read at each check: a live collection (the Θ
    table, :data:`tokenformer.nn.theta.THETAS`, which
    :func:`~tokenformer.nn.theta.register_theta` extends) is followed."""
    return FieldRule(lambda: f"one of {', '.join(options)}", lambda value: value in options)


POSITIVE = FieldRule("a positive {t}", lambda value: value > 0)
NON_NEGATIVE = FieldRule("{a} >= 0", lambda value: value >= 0)
FRACTION = FieldRule("{a} in [0, 1]", lambda value: 0 <= value <= 1)
# Seeds are 32-bit: torch's generators take 64 bits, and a growth's generator is seeded with
# seed·1_000_003 + step (training.growth), which must still fit.
SEED_MAX = 2**32 - 1
SEED = FieldRule(f"{{a}} in 0..{SEED_MAX}", lambda value: 0 <= value <= SEED_MAX)
TOP_K = FieldRule("a token count >= 1 or a fraction in (0, 1]",
                  lambda value: value >= 1 if isinstance(value, int) else 0 < value <= 1)

# The range of every field of the model configs (LM, vision, baselines) by name; a field not
# listed is checked for its type only. Cross-field rules (divisibility...) stay in validate().
FIELD_RULES: dict[str, FieldRule] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_layers", "num_heads", "qkv_tokens",
                     "proj_tokens", "ffn_tokens", "max_seq_len", "vocab_multiple",
                     "ffn_product_k", "intermediate_size", "image_size", "patch_size",
                     "num_channels", "num_classes", "rotary_base", "layernorm_eps",
                     "qkv_scale", "proj_scale", "ffn_scale"), POSITIVE),
    **dict.fromkeys(("theta_eps", "init_std", "eos_token_id"), NON_NEGATIVE),
    **dict.fromkeys(("qkv_top_k", "proj_top_k", "ffn_top_k"), TOP_K),
    "rotary_pct": FRACTION,
    "norm": one_of(THETAS),
    "block_norm": one_of(BLOCK_NORMS),
    "ffn_keys": one_of(FFN_KEYS),
}


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """``{field: (allowed types, None allowed)}`` from ``cls``'s annotations (``int | None`` →
    ``((int,), True)``)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        kinds = typing.get_args(hint) if union else (hint,)
        out[f.name] = (tuple(k for k in kinds if k is not type(None)), type(None) in kinds)
    return out


def _is_a(value: Any, kind: Any) -> bool:
    """``value`` is of type ``kind``: bools are not numbers, an int is a float (JSON writes
    10000.0 as 10000), a float must be finite, ``list[X]`` checks every item."""
    origin = typing.get_origin(kind)
    if origin is list:
        return isinstance(value, list) and all(_is_a(v, typing.get_args(kind)[0]) for v in value)
    if kind is Any:
        return True
    if kind is dict or origin is dict:
        return isinstance(value, dict)
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float and isinstance(value, (int, float)):
        try:
            return math.isfinite(value)
        except OverflowError:  # an int too large for a float
            return False
    return isinstance(value, kind)


_NOUNS = {int: "integer", float: "finite number", str: "string", bool: "boolean", dict: "mapping"}


def _allowed(kinds: tuple[Any, ...], optional: bool, rule: FieldRule | None) -> str:
    """What a field allows, in words: "a positive integer or null"."""
    if set(kinds) == {int, float}:
        noun = "number"
    else:
        noun = _NOUNS.get(kinds[0], "list" if typing.get_origin(kinds[0]) is list
                          else getattr(kinds[0], "__name__", str(kinds[0])))
    article = "an" if noun[0] in "aeiou" else "a"
    text = (rule.describe() if rule is not None else "{a}").format(a=f"{article} {noun}", t=noun)
    return text.replace("a boolean", "true or false") + (" or null" if optional else "")


def check_fields(config: Any, rules: Mapping[str, FieldRule] = FIELD_RULES,
                 prefix: str = "config: ") -> None:
    """ConfigError naming the first field of the dataclass ``config`` whose value is not of its
    annotated type (NaN and infinities are not numbers here) or breaks its ``rules`` entry: one
    line with the field, the value and what is allowed."""
    for name, (kinds, optional) in _field_types(type(config)).items():
        value = getattr(config, name)
        if value is None and optional:
            continue
        rule = rules.get(name)
        if not any(_is_a(value, kind) for kind in kinds) or (rule is not None
                                                               and not rule.ok(value)):
            raise ConfigError(f"{prefix}{name} must be {_allowed(kinds, optional, rule)}, "
                              f"got {reprlib.repr(value)}")


# FLOPs we charge per score for Θ, one per elementwise arithmetic op (exp/erf count as one):
# each Θ's ``flops_per_score`` in tokenformer.nn.theta.THETAS (why each count, there). This dict
# is the built-in variants' (tests and docs read it); the counts themselves read the table.
THETA_FLOPS_PER_SCORE = {name: variant.flops_per_score for name, variant in THETAS.items()}
SOFTMAX_FLOPS_PER_SCORE = 5  # token-token attention: max, subtract, exp, sum, divide


@dataclass
class TokenFormerConfig:
    """Hyper-parameters of :class:`tokenformer.TokenFormerLM` (the official architecture).

    ``vocab_size`` is the tokenizer's vocabulary; the embedding has ``padded_vocab_size`` rows
    (rounded up to ``vocab_multiple``), as GPT-NeoX does. ``qkv_scale``/``proj_scale``/``ffn_scale``
    override Θ's factor (default √n, or n for L1 variants); growth sets them to hold the function.
    """

    vocab_size: int = 50277
    """the tokenizer's vocabulary (the embedding is padded to vocab_multiple)"""
    hidden_size: int = 768
    """width of every token (residual stream)"""
    num_layers: int = 12
    """blocks"""
    num_heads: int = 12
    """attention heads (hidden_size must divide by it)"""
    qkv_tokens: int = 768
    """parameter tokens of each of the Q, K, V Pattentions"""
    proj_tokens: int = 768
    """parameter tokens of the attention-output Pattention"""
    ffn_tokens: int = 3072
    """parameter tokens of the FFN Pattention"""
    max_seq_len: int = 2048
    """context length"""
    rotary_pct: float = 0.25
    """fraction of each head's dimensions that get rotary embedding"""
    rotary_base: float = 10000.0
    """rotary base frequency"""
    norm: str = "l2_norm_gelu"
    """Θ variant: l2_norm_gelu (official), gelu_l2_norm, gelu_l1_norm, softmax, or gelu (no
    normalisation: the MLP control)"""
    theta_eps: float = 0.0
    """ε added to Θ's norm"""
    qkv_scale: float | None = None
    """Θ factor of the Q/K/V Pattentions (None: √n, or n for L1 variants)"""
    proj_scale: float | None = None
    """Θ factor of the output Pattention (None: default)"""
    ffn_scale: float | None = None
    """Θ factor of the FFN Pattention (None: default)"""
    qkv_top_k: int | float | None = None
    """inference top-k of the Q/K/V Pattentions: a count, a fraction of n, or None (dense)"""
    proj_top_k: int | float | None = None
    """inference top-k of the output Pattention (None: dense)"""
    ffn_top_k: int | float | None = None
    """inference top-k of the FFN Pattention (None: dense)"""
    ffn_keys: str = "dense"
    """FFN keys: dense (a Pattention), or product (ffn_tokens = s² product keys, each row reads
    ffn_product_k tokens; tokenformer.nn.product_keys)"""
    ffn_product_k: int = 32
    """tokens each row reads in a product-key FFN (ignored when ffn_keys is dense)"""
    layernorm_eps: float = 1e-5
    """LayerNorm ε"""
    block_norm: str = "none"
    """learnable parts of the block LayerNorms: none (official), weight, bias or both"""
    tie_embeddings: bool = True
    """the output head is the embedding matrix (official); false: a separate [padded vocab,
    hidden] head"""
    vocab_multiple: int = 128
    """the embedding's rows are rounded up to a multiple of this"""
    init_std: float = 0.02
    """initialisation standard deviation"""
    eos_token_id: int | None = 0
    """end-of-text token id"""
    name: str = field(default="custom", compare=False)
    """a label (the preset's name), shown by `tokenformer info` and in reports"""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        check_fields(self)  # every field's type and range (FIELD_RULES); then what they share
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"config: hidden_size {self.hidden_size} is not divisible by "
                              f"num_heads {self.num_heads}")
        if self.rotary_dim % 2:
            raise ConfigError(f"config: rotary dimension int(head_dim {self.head_dim} × rotary_pct "
                              f"{self.rotary_pct}) = {self.rotary_dim} is odd; it must be even")
        if self.ffn_keys == "product":
            if math.isqrt(self.ffn_tokens) ** 2 != self.ffn_tokens:
                raise ConfigError(f"config: product keys need a square ffn_tokens (s² for s "
                                  f"sub-keys per half), got {self.ffn_tokens}")
            if self.ffn_product_k > self.ffn_tokens:
                raise ConfigError(f"config: ffn_product_k must be a count in [1, "
                                  f"{self.ffn_tokens}], got {self.ffn_product_k!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple

    def theta_scale(self, kind: str) -> float:
        """Θ's factor for the ``qkv``, ``proj`` or ``ffn`` Pattentions."""
        explicit = getattr(self, f"{kind}_scale")
        return float(explicit) if explicit is not None else default_scale(
            self.norm, getattr(self, f"{kind}_tokens"))

    @property
    def value_init_std(self) -> float:
        """GPT-NeoX "wang init" used for every value_param_tokens: 2 / L / √d."""
        return 2.0 / self.num_layers / math.sqrt(self.hidden_size)

    def block_parameters(self) -> int:
        """Parameters of one block (four attention Pattentions, the FFN Pattention, norms)."""
        d = self.hidden_size
        norm = {"none": 0, "weight": 1, "bias": 1, "both": 2}[self.block_norm] * 2 * d
        # called unbound: the vision config borrows block_parameters, not ffn_parameters
        ffn = TokenFormerConfig.ffn_parameters(self)  # type: ignore[arg-type]
        return 2 * d * (3 * self.qkv_tokens + self.proj_tokens) + ffn + norm

    def ffn_parameters(self) -> int:
        """Parameters of one block's FFN: n keys and n values of width d, or, with product keys,
        s sub-keys of d/2 per half (s·d) and n values."""
        d = self.hidden_size
        keys = (math.isqrt(self.ffn_tokens) * d if getattr(self, "ffn_keys", "dense") == "product"
                else self.ffn_tokens * d)
        return keys + self.ffn_tokens * d

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Exact parameter count, from shapes alone (nothing is allocated)."""
        body = self.num_layers * self.block_parameters() + 2 * self.hidden_size
        return body if non_embedding else body + embedding_parameters(self)

    def projection_flops(self) -> tuple[float, float]:
        """Forward FLOPs per token of one block's attention Pattentions and FFN Pattention."""
        d, theta = self.hidden_size, theta_variant(self.norm).flops_per_score

        def pattention(n: int) -> float:
            return 2 * n * (d + d) + theta * n

        ffn = pattention(self.ffn_tokens)
        # product keys: two half-score matmuls, k'² candidate sums, Θ and values over k tokens
        # (getattr: the vision config borrows these methods and has no ffn_keys)
        if getattr(self, "ffn_keys", "dense") == "product":
            s, k = math.isqrt(self.ffn_tokens), self.ffn_product_k
            ffn = 2 * s * d + min(k, s) ** 2 + theta * k + 2 * k * d
        return 3 * pattention(self.qkv_tokens) + pattention(self.proj_tokens), ffn

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenFormerConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"config: unknown key(s) {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as exc:  # e.g. a string where a number belongs
            raise ConfigError(f"config: {exc}") from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            atomic_write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> TokenFormerConfig:
        path = regular_file(path, "config file")
        try:
            text = path.read_text(encoding="utf-8")
            if path.suffix in (".yaml", ".yml"):
                data = _read_yaml(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # any parse error is a malformed file
            raise ConfigError(f"config file {path} is malformed: {exc}".splitlines()[0]) from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> TokenFormerConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        data = dict(PRESETS[name], name=name)
        data.update(overrides)
        return cls.from_dict(data)


def _read_yaml(text: str) -> Any:
    """``yaml.safe_load``, except that ``1e-5`` is a number, as in YAML 1.2 and JSON: PyYAML
    follows YAML 1.1, where a float needs a dot, and would hand ``layernorm_eps: 1e-5`` to the
    config as the string '1e-5' (which check_fields rightly refuses)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)[eE][-+]?[0-9]+$"),
                                 list("-+0123456789."))
    return yaml.load(text, Loader=Loader)  # a SafeLoader: builds plain data only


def embedding_parameters(config: Any) -> int:
    """The embedding table, and the output head when it is not tied to it (both [padded vocab,
    hidden]): what ``num_parameters(non_embedding=True)`` leaves out."""
    tables = 1 if getattr(config, "tie_embeddings", True) else 2
    return tables * config.padded_vocab_size * config.hidden_size


def _official(L: int, d: int, heads: int, qkv: int, proj: int, ffn: int, seq: int) -> dict:
    return dict(num_layers=L, hidden_size=d, num_heads=heads, qkv_tokens=qkv, proj_tokens=proj,
                ffn_tokens=ffn, max_seq_len=seq, vocab_size=50277)


def _small(L: int, d: int, heads: int, qkv: int, proj: int, ffn: int, seq: int = 256,
           vocab: int = 257) -> dict:
    return dict(num_layers=L, hidden_size=d, num_heads=heads, qkv_tokens=qkv, proj_tokens=proj,
                ffn_tokens=ffn, max_seq_len=seq, vocab_size=vocab, eos_token_id=256)


PRESETS: dict[str, dict[str, Any]] = {
    # Released checkpoints (spec §3).
    "tokenformer-150m": _official(12, 768, 12, 768, 768, 3072, 2048),
    "tokenformer-450m": _official(24, 1024, 16, 1024, 1024, 4096, 2048),
    "tokenformer-900m": _official(32, 1280, 16, 1280, 1280, 5120, 2048),
    "tokenformer-1-5b": _official(40, 1536, 16, 1536, 1536, 6144, 2048),
    "tokenformer-354m-owt2": _official(24, 1024, 16, 768, 768, 3072, 1024),
    "tokenformer-757m-owt2": _official(24, 1024, 16, 1792, 1792, 7168, 1024),
    # The paper's 12-layer d=768 scaling chain (qkv = proj = s, ffn = 4s).
    "tokenformer-124m-chain": _official(12, 768, 12, 576, 576, 2304, 2048),
    "tokenformer-354m-chain": _official(12, 768, 12, 2140, 2140, 8560, 2048),
    # Small byte-level models for CPUs, tests and demos (vocab 256 bytes + <|endoftext|>).
    "tiny": _small(2, 64, 4, 32, 32, 128, seq=128),
    "small": _small(4, 128, 4, 64, 64, 256),
    "medium": _small(4, 128, 4, 192, 192, 768),
    "large": _small(4, 128, 4, 576, 576, 2304),
}


def flops_per_token(config: TokenFormerConfig, seq_len: int | None = None,
                    training: bool = False) -> dict[str, float]:
    """Analytic FLOPs per token, broken down by part (the one count used everywhere).

    A matmul of [1, a] by [a, b] costs 2ab. Per block: every Pattention costs
    2·n·(d_in + d_out) for its two matmuls plus Θ's elementwise work (``THETA_FLOPS_PER_SCORE`` per
    score, n scores); token-token attention costs 2·2·T·d for Q·Kᵀ and A·V plus the softmax, with
    T = ``seq_len`` (default: the model's context) counted in full, as in PaLM's MFU accounting;
    rotary is charged 3 FLOPs per rotated element of q and k. The output head costs 2·V·d.
    Training is 3× forward (backward = 2× forward). Keys: ``attention_pattentions``, ``ffn``,
    ``token_attention``, ``per_layer``, ``head``, ``total``.

    Any config with the same size fields and a ``projection_flops()`` method is accepted: the
    Transformer baselines (:mod:`tokenformer.models.baselines`) charge their Linear Q/K/V/O under
    ``attention_pattentions`` and their MLP under ``ffn``, so every architecture shares this count.
    """
    T = seq_len or config.max_seq_len
    d = config.hidden_size
    attention_pattentions, ffn = config.projection_flops()
    rotary = 3 * 2 * config.rotary_dim * config.num_heads
    token_attention = 2 * 2 * T * d + SOFTMAX_FLOPS_PER_SCORE * T * config.num_heads + rotary
    norms = 2 * 5 * d  # two LayerNorms: mean, var, subtract, scale (≈5 per element)
    per_layer = attention_pattentions + ffn + token_attention + norms
    head = 2 * config.padded_vocab_size * d + 5 * d
    total = config.num_layers * per_layer + head
    mult = 3.0 if training else 1.0
    return {"attention_pattentions": mult * attention_pattentions, "ffn": mult * ffn,
            "token_attention": mult * token_attention, "per_layer": mult * per_layer,
            "head": mult * head, "total": mult * total}
