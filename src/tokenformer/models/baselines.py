"""Transformer baselines trained by the same trainer: GPT-NeoX-style and Transformer++.

Both reuse TokenFormer's modules wherever the architectures agree: the rotary embedding, the KV
cache, the attention forward (:class:`tokenformer.models.lm.Attention`, with ``nn.Linear`` in place
of the Pattentions), the pre-norm block, the LM forward, tying and generation
(:class:`tokenformer.models.lm.TokenFormerLM`). What differs:

==================  ===================================  ====================================
                    ``transformer`` (GPT-NeoX style)      ``transformer++`` (Llama style)
==================  ===================================  ====================================
projections         ``nn.Linear`` with biases             ``nn.Linear``, no biases
MLP                 up → GELU → down                      SwiGLU: down(SiLU(gate) · up)
block norms         non-parametric LayerNorm (as TF)      RMSNorm with weight
final norm          parametric LayerNorm (as TF)          RMSNorm with weight
rotary              GPT-NeoX, first 25 % of head dims     all head dims (rotate-half)
output head         tied to the embeddings (as TF)        tied to the embeddings
==================  ===================================  ====================================

:func:`matched_config` sizes the MLP so that a baseline has the non-embedding parameters of a given
TokenFormer config (and so, up to Θ's elementwise work, its FLOPs per token).

``fused_projections`` computes Q, K and V with one Linear (``attention.qkv``: [3d, d], rows
Q, K, V) and the SwiGLU's gate and up with one (``mlp.gate_up``: [2f, d], rows gate, up), as
fast Transformer implementations do: the same function, parameters and FLOPs, one GEMM instead of
three (two), the fair speed baseline for TokenFormer, which computes its Q/K/V in one GEMM too.
A fused model's weights are saved under those names (its ``config.json`` says
``fused_projections``); :func:`convert_projections` turns a state dict of one layout into the
other, and a model built with the same seed holds the same weights in either layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import verify_checkpoint
from ..io.paths import has_regular_file, read_json_object
from .checks import check_buildable
from .config import FIELD_RULES, TokenFormerConfig, check_fields, embedding_parameters, one_of
from .lm import Attention, Block, LayerNorm, RotaryEmbedding, TokenFormerLM, output_head
from .persistence import CONFIG_NAME

ARCHS = ("tokenformer", "transformer", "transformer++")
GELU_FLOPS = 4  # x·0.5·(1+erf(x/√2)), as Θ's GELU is charged in config.py
SILU_FLOPS = 4  # x / (1 + exp(-x)): negate/exp, add, divide


@dataclass
class TransformerConfig:
    """Hyper-parameters of :class:`TransformerLM`. ``None`` fields take the ``arch`` default:
    ``rotary_pct`` 0.25 / 1.0 and ``bias`` True / False for ``transformer`` / ``transformer++``."""

    arch: str = "transformer"
    """transformer or transformer++"""
    vocab_size: int = 257
    """the tokenizer's vocabulary"""
    hidden_size: int = 128
    """width of every token"""
    num_layers: int = 4
    """blocks"""
    num_heads: int = 4
    """attention heads"""
    intermediate_size: int = 512
    """MLP width (default: parameter-matched to the TokenFormer block)"""
    max_seq_len: int = 256
    """context length"""
    rotary_pct: float | None = None
    """fraction of each head's dimensions with rotary (None: 0.25 / 1.0 by arch)"""
    rotary_base: float = 10000.0
    """rotary base frequency"""
    bias: bool | None = None
    """biases in the linear layers (None: True for transformer, False for transformer++)"""
    layernorm_eps: float = 1e-5
    """norm ε"""
    tie_embeddings: bool = True
    """the output head is the embedding matrix; false: a separate [padded vocab, hidden] head"""
    vocab_multiple: int = 128
    """the embedding's rows are rounded up to a multiple of this"""
    init_std: float = 0.02
    """initialisation standard deviation"""
    eos_token_id: int | None = 0
    """end-of-text token id"""
    fused_projections: bool = False
    """one Linear for Q, K and V and one for SwiGLU's gate and up (the same function, parameters
    and FLOPs; faster); saved under its own names (attention.qkv, mlp.gate_up)"""
    name: str = field(default="custom", compare=False)
    """a label, shown in reports"""

    # Derived sizes and (de)serialisation are TokenFormerConfig's: one implementation.
    head_dim = TokenFormerConfig.head_dim
    rotary_dim = TokenFormerConfig.rotary_dim
    padded_vocab_size = TokenFormerConfig.padded_vocab_size
    value_init_std = TokenFormerConfig.value_init_std
    to_dict = TokenFormerConfig.to_dict
    save = TokenFormerConfig.save
    from_dict = classmethod(TokenFormerConfig.from_dict.__func__)  # type: ignore[attr-defined]
    load = classmethod(TokenFormerConfig.load.__func__)  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        if self.rotary_pct is None:
            self.rotary_pct = 0.25 if self.arch == "transformer" else 1.0
        if self.bias is None:
            self.bias = self.arch == "transformer"
        self.validate()

    def validate(self) -> None:
        check_fields(self, {**FIELD_RULES, "arch": one_of(ARCHS[1:])})  # types and ranges
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"config: hidden_size {self.hidden_size} is not divisible by "
                              f"num_heads {self.num_heads}")
        if self.rotary_dim % 2:
            raise ConfigError(f"config: rotary_pct {self.rotary_pct} must give an even number of "
                              f"rotary dims (got {self.rotary_dim})")

    @property
    def gated(self) -> bool:
        return self.arch == "transformer++"

    def block_parameters(self) -> int:
        d, f, b = self.hidden_size, self.intermediate_size, int(self.bias)
        attention = 4 * (d * d + b * d)
        mlp = (3 * d * f) if self.gated else (2 * d * f + b * (f + d))
        norms = 2 * d if self.gated else 0  # RMSNorm weights; NeoX-style block norms have none
        return attention + mlp + norms

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Exact parameter count, from shapes alone (nothing is allocated)."""
        final_norm = self.hidden_size if self.gated else 2 * self.hidden_size
        body = self.num_layers * self.block_parameters() + final_norm
        return body if non_embedding else body + embedding_parameters(self)

    def projection_flops(self) -> tuple[float, float]:
        """Forward FLOPs per token of one block's Q/K/V/O Linears and MLP (for flops_per_token)."""
        d, f, b = self.hidden_size, self.intermediate_size, int(self.bias)

        def linear(n_in: int, n_out: int) -> float:
            return 2 * n_in * n_out + b * n_out

        attention = 4 * linear(d, d)
        if self.gated:
            mlp = 2 * linear(d, f) + (SILU_FLOPS + 1) * f + linear(f, d)
        else:
            mlp = linear(d, f) + GELU_FLOPS * f + linear(f, d)
        return attention, mlp


# ------------------------------------------------------------------------------------- modules
def _linear(n_in: int, n_out: int, bias: bool, std: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    nn.init.normal_(layer.weight, std=std)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


def _side_by_side(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the outputs of ``parts`` concatenated, holding their weights
    (made without drawing from the RNG: the parts drew what the unfused model draws)."""
    first = parts[0]
    layer = skip_init(nn.Linear, first.in_features, sum(p.out_features for p in parts),
                      bias=first.bias is not None)
    with torch.no_grad():
        layer.weight.copy_(torch.cat([p.weight for p in parts]))
        if layer.bias is not None:
            layer.bias.copy_(torch.cat([p.bias for p in parts]))
    return layer


# Each fused Linear of a fused_projections model: its name and the Linears it holds, in order
FUSED = {"attention.qkv": ("attention.query", "attention.key", "attention.value"),
         "mlp.gate_up": ("mlp.gate", "mlp.up")}


class LinearAttention(Attention):
    """:class:`tokenformer.models.lm.Attention` (same rotary, cache and SDPA) with Linear
    Q/K/V/O; with ``fused_projections`` one Linear ``qkv`` computes Q, K and V."""

    def __init__(self, config: TransformerConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        d, b = config.hidden_size, config.bias
        self.layer_idx = layer_idx
        self.is_causal = True
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        qkv = [_linear(d, d, b, config.init_std) for _ in range(3)]
        self.qkv = _side_by_side(qkv) if config.fused_projections else None
        if self.qkv is None:
            self.query, self.key, self.value = qkv
        # Output projections get GPT-NeoX's "wang init", like TokenFormer's value tokens.
        self.proj = _linear(d, d, b, config.value_init_std)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return super().project_qkv(x)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q, k, v


class MLP(nn.Module):
    """GELU MLP (GPT-NeoX) or SwiGLU (Transformer++); with ``fused_projections`` one Linear
    ``gate_up`` computes SwiGLU's gate and up."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        d, f, b = config.hidden_size, config.intermediate_size, config.bias
        self.gated = config.gated
        self.up = _linear(d, f, b, config.init_std)
        self.gate = _linear(d, f, b, config.init_std) if self.gated else None
        self.gate_up = None
        if self.gated and config.fused_projections:
            self.gate_up = _side_by_side([self.gate, self.up])
            self.up = self.gate = None
        self.down = _linear(f, d, b, config.value_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


def _norm(config: TransformerConfig, affine: str) -> nn.Module:
    if config.gated:
        return nn.RMSNorm(config.hidden_size, eps=config.layernorm_eps)
    return LayerNorm(config.hidden_size, config.layernorm_eps, affine)


class TransformerBlock(Block):
    """:class:`tokenformer.models.lm.Block`'s pre-norm forward over Linear attention and an MLP."""

    def __init__(self, config: TransformerConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = _norm(config, "none")
        self.attention = LinearAttention(config, layer_idx)
        self.post_attention_layernorm = _norm(config, "none")
        self.mlp = MLP(config)


class TransformerLM(TokenFormerLM):
    """A Transformer baseline with TokenFormerLM's forward, generation and save format.

    ``config.json`` carries ``arch``; :func:`load_model_dir` dispatches on it.
    """

    config_class = TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        nn.Module.__init__(self)
        config.validate()
        self.config = config
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.final_norm = _norm(config, "both")
        self.lm_head = output_head(config)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.max_seq_len, config.rotary_base)
        nn.init.normal_(self.word_embeddings.weight, std=config.init_std)

    def pattentions(self) -> dict:
        return {}


# ------------------------------------------------------------------------------------ helpers
def matched_config(config: TokenFormerConfig, arch: str = "transformer", *,
                   multiple_of: int = 1, **overrides: Any) -> TransformerConfig:
    """The ``arch`` baseline with ``config``'s width, depth, heads, vocabulary and context, and the
    MLP width whose non-embedding parameters per block are closest to the TokenFormer block's.

    Linear layers cost 2 FLOPs per parameter like Pattention's two matmuls, so FLOPs per token match
    too, up to Θ's elementwise work (≈ 2/d relative: 3 % at d = 64, 0.4 % at d = 512).
    """
    if arch not in ARCHS[1:]:
        raise ConfigError(f"arch must be one of {', '.join(ARCHS[1:])}, got {arch!r}")
    probe = TransformerConfig(arch=arch, vocab_size=config.vocab_size,
                              hidden_size=config.hidden_size, num_layers=config.num_layers,
                              num_heads=config.num_heads, intermediate_size=1,
                              max_seq_len=config.max_seq_len, rotary_base=config.rotary_base,
                              layernorm_eps=config.layernorm_eps,
                              vocab_multiple=config.vocab_multiple, init_std=config.init_std,
                              eos_token_id=config.eos_token_id,
                              name=f"{arch}-matched-{config.name}")
    for key, value in overrides.items():
        setattr(probe, key, value)
    probe.__post_init__()
    # block_parameters is affine in intermediate_size: solve for the width.
    base = probe.block_parameters()
    probe.intermediate_size = 2
    per_unit = probe.block_parameters() - base
    width = (config.block_parameters() - base) / per_unit + 1
    width = multiple_of * round(width / multiple_of)
    if width < 1:
        raise ConfigError(f"a {arch} block with hidden size {config.hidden_size} has more "
                          f"parameters than the TokenFormer block ({config.block_parameters()}) "
                          f"even without an MLP; no matched config exists")
    probe.intermediate_size = int(width)
    probe.validate()
    return probe


def convert_projections(state: dict[str, torch.Tensor], fused: bool
                        ) -> dict[str, torch.Tensor]:
    """A baseline's state dict in the other layout of :data:`FUSED`: ``fused=True`` concatenates
    each block's Q/K/V (and gate/up) weights and biases into its fused Linear's, ``False`` splits
    them back. Keys already in the asked layout, and every other key, are kept as they are."""
    out = dict(state)
    for key in state:
        for whole, parts in FUSED.items():
            for leaf in ("weight", "bias"):
                if fused and key.endswith(f".{parts[0]}.{leaf}"):
                    stem = key[:-len(f"{parts[0]}.{leaf}")]
                    names = [f"{stem}{part}.{leaf}" for part in parts]
                    if all(n in out for n in names):
                        out[f"{stem}{whole}.{leaf}"] = torch.cat([out.pop(n) for n in names])
                elif not fused and key.endswith(f".{whole}.{leaf}"):
                    stem = key[:-len(f"{whole}.{leaf}")]
                    chunks = out.pop(key).chunk(len(parts))
                    out.update({f"{stem}{part}.{leaf}": c.clone()
                                for part, c in zip(parts, chunks, strict=True)})
    return out


def model_class(arch: str) -> type[TokenFormerLM]:
    if arch == "tokenformer":
        return TokenFormerLM
    if arch in ARCHS:
        return TransformerLM
    raise ConfigError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")


def _arch_of(directory: str | Path) -> str:
    config_file = Path(directory) / CONFIG_NAME
    if not has_regular_file(config_file, folder=directory):
        raise CheckpointError(f"{directory} is not a model directory (no {CONFIG_NAME})")
    return read_json_object(config_file).get("arch", "tokenformer")


def load_model_dir(directory: str | Path, *, verify: bool = True) -> TokenFormerLM:
    """Load a model directory of any architecture (``config.json``'s ``arch``; TokenFormer when
    absent), checked against its manifest first (``verify=False``: the caller just did)."""
    if verify:
        verify_checkpoint(directory)  # before its config.json is read to pick the class
    return model_class(_arch_of(directory)).load(directory, verify=False)


def build_from_dir_config(directory: str | Path) -> TokenFormerLM:
    """A freshly initialised model of the architecture and size a directory's config names
    (refused before any tensor is made if this machine cannot hold it)."""
    cls = model_class(_arch_of(directory))
    config = cls.config_class.load(Path(directory) / CONFIG_NAME)
    check_buildable(config, str(Path(directory) / CONFIG_NAME))
    return cls(config)
