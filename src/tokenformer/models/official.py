"""Official checkpoint I/O: the released ``pytorch_model.bin`` / DeepSpeed layouts ↔ our modules.

The official GPT-NeoX code names modules by their index in one ``nn.Sequential``: the embedding is
``sequential.0``, block i is ``sequential.{i+2}``, the final norm ``sequential.{L+3}``. Our
modules keep the official leaf names (``attention.query.key_param_tokens``, ``mlp...``), so
conversion is a prefix rename in both directions.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..io.checkpoint import verify_checkpoint
from ..io.files import atomic_write
from ..io.paths import has_regular_file
from ..io.untrusted import safe_torch_load
from ..nn.pattention import kind_names
from .config import TokenFormerConfig

# Heads of the released models by hidden size (not recoverable from tensor shapes).
OFFICIAL_HEADS = {768: 12, 1024: 16, 1280: 16, 1536: 16}
OFFICIAL_VOCAB_SIZE = 50277  # GPT-NeoX-20B tokenizer; the embedding is padded to 50304

_BLOCK_KEY = re.compile(r"^sequential\.(\d+)\.(.+)$")


def official_to_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename official keys to ours. Raises CheckpointError on a key of unknown layout."""
    if "sequential.0.word_embeddings.weight" not in state:
        raise CheckpointError("not an official TokenFormer state dict: missing key "
                              "'sequential.0.word_embeddings.weight'")
    # The final norm is found by name, not as the last index, so that a checkpoint missing it is
    # reported as such rather than as a last block of unexpected keys.
    norms = [int(m.group(1)) for k in state
             if (m := _BLOCK_KEY.match(k)) and m.group(2).startswith("norm.")]
    final = max(norms, default=None)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _BLOCK_KEY.match(key)
        if m is None:
            raise CheckpointError(f"unexpected key {key!r} in official checkpoint")
        index, rest = int(m.group(1)), m.group(2)
        if index == 0 and rest == "word_embeddings.weight":
            out["word_embeddings.weight"] = tensor
        elif index == final and rest.startswith("norm."):
            out["final_" + rest] = tensor
        elif index >= 2 and index != final:
            out[f"layers.{index - 2}.{rest}"] = tensor
        else:
            raise CheckpointError(f"unexpected key {key!r} in official checkpoint")
    return out


def ours_to_official(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Rename our keys to the official layout (key order as in the released files)."""
    out: dict[str, torch.Tensor] = {"sequential.0.word_embeddings.weight":
                                    state["word_embeddings.weight"]}
    for key, tensor in state.items():
        if key.startswith("layers."):
            _, index, rest = key.split(".", 2)
            out[f"sequential.{int(index) + 2}.{rest}"] = tensor
    for name in ("weight", "bias"):
        out[f"sequential.{num_layers + 3}.norm.{name}"] = state[f"final_norm.{name}"]
    return out


def _read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Find and read the weights (and config.json, if any) behind ``path``."""
    config_json = None
    if path.is_dir():
        if has_regular_file(path / "config.json", folder=path):
            try:
                config_json = json.loads((path / "config.json").read_text(encoding="utf-8"))
            except ValueError as exc:  # not JSON, or not UTF-8
                raise CheckpointError(f"{path / 'config.json'} is malformed: {exc}") from None
        candidates = [path / "pytorch_model.bin", path / "mp_rank_00_model_states.pt"]
        latest = path / "latest"
        if has_regular_file(latest, folder=path):
            tag = latest.read_text(errors="replace").strip()
            if not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
                raise CheckpointError(f"{latest} names {tag[:80]!r}, not a folder beside it")
            candidates.append(path / tag / "mp_rank_00_model_states.pt")
        candidates += sorted(path.glob("global_step*/mp_rank_00_model_states.pt"))[-1:]
        found = next((c for c in candidates if has_regular_file(c, "checkpoint", folder=path)),
                     None)
        if found is None:
            raise CheckpointError(f"{path}: no pytorch_model.bin or DeepSpeed "
                                  f"mp_rank_00_model_states.pt found")
        path = found
    loaded = safe_torch_load(path)
    if isinstance(loaded, dict) and "module" in loaded and isinstance(loaded["module"], dict):
        loaded = loaded["module"]  # DeepSpeed model-states file
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor)
                                               for v in loaded.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return dict(loaded), config_json


def infer_config(state: dict[str, torch.Tensor], config_json: dict[str, Any] | None = None, *,
                 num_heads: int | None = None, rotary_pct: float | None = None,
                 max_seq_len: int | None = None, norm: str | None = None) -> TokenFormerConfig:
    """Build the config from tensor shapes (our key names), then ``config.json``, then arguments.

    Shapes give layers, hidden size, vocab rows and token counts. Heads, rotary fraction, context
    and Θ variant come from ``config.json`` when present, else the arguments, else the official
    defaults (heads by hidden size as released, rotary_pct 0.25, 2048, ``l2_norm_gelu``).
    """
    cfg = config_json or {}
    vocab_rows, d = state["word_embeddings.weight"].shape
    layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")})
    if layers != list(range(len(layers))):
        raise CheckpointError(f"block indices are not contiguous: {layers}")

    def tokens(name: str) -> int:
        key = f"layers.0.{name}.key_param_tokens"
        if key not in state:  # named as in the official file, which is what the user has
            raise CheckpointError(f"missing key 'sequential.2.{name}.key_param_tokens'")
        return int(state[key].shape[0])

    for key, actual in (("num_layers", len(layers)), ("hidden_size", d),
                        ("qkv_slot_num", tokens(kind_names("qkv")[0]))):
        if key in cfg and int(cfg[key]) != int(actual):
            raise CheckpointError(f"config.json says {key}={cfg[key]} but the weights have "
                                  f"{actual}")
    heads = num_heads or cfg.get("num_attention_heads") or OFFICIAL_HEADS.get(d, max(1, d // 64))
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise CheckpointError(f"config.json: num_attention_heads must be a positive integer, got "
                              f"{heads!r}")
    # The tokenizer's vocabulary and eos: config.json when it says (to-official writes them),
    # else the released models' values.
    vocab = int(cfg.get("vocab_size") or (OFFICIAL_VOCAB_SIZE if vocab_rows == 50304
                                          else vocab_rows))
    multiple = int(cfg.get("vocab_multiple") or (128 if vocab_rows % 128 == 0 else 1))
    config = TokenFormerConfig(
        vocab_size=vocab, vocab_multiple=multiple, eos_token_id=cfg.get("eos_token_id", 0),
        hidden_size=int(d), num_layers=len(layers), num_heads=int(heads),
        qkv_tokens=tokens(kind_names("qkv")[0]), proj_tokens=tokens(kind_names("proj")[0]),
        ffn_tokens=tokens(kind_names("ffn")[0]),
        max_seq_len=int(max_seq_len or cfg.get("seq_length") or cfg.get("max_position_embeddings")
                        or 2048),
        rotary_pct=float(rotary_pct if rotary_pct is not None else cfg.get("rotary_pct", 0.25)),
        norm=norm or cfg.get("norm_activation_type") or "l2_norm_gelu",
        name="official")
    if config.padded_vocab_size != vocab_rows:
        raise CheckpointError(f"config.json's vocab_size={vocab} (padded to a multiple of "
                              f"{multiple}) does not match the embedding's {vocab_rows} rows")
    return config


def read_official(path: str | Path, *, num_heads: int | None = None,
                  rotary_pct: float | None = None, max_seq_len: int | None = None,
                  norm: str | None = None, config: TokenFormerConfig | None = None
                  ) -> tuple[TokenFormerConfig, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The config and weights of a released checkpoint (``pytorch_model.bin``, its folder, or a
    DeepSpeed file), never unpickling code: ``(config, state, official)`` with ``state`` under our
    key names and ``official`` as the file names them (errors name a key as the user's file does).
    ``config`` (else inferred by :func:`infer_config` from the shapes, ``config.json`` and the
    other arguments). :meth:`tokenformer.TokenFormerLM.from_official` builds the model."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        verify_checkpoint(path)  # the manifest rule (a folder with one), before reading it
    official, config_json = _read_state_dict(path)
    state = official_to_ours(official)
    if config is None:
        config = infer_config(state, config_json, num_heads=num_heads, rotary_pct=rotary_pct,
                              max_seq_len=max_seq_len, norm=norm)
    return config, state, official


def save_official(model: nn.Module, path: str | Path) -> None:
    """Write ``model`` as an official-layout ``pytorch_model.bin`` (plain fp32 state dict)."""
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    out = ours_to_official(state, model.config.num_layers)
    atomic_write(path, lambda tmp: torch.save(out, tmp))


# Our config fields under the names the released repos' config.json gives them (the NeoX keys
# infer_config reads), plus vocab_size, vocab_multiple and eos_token_id: the tokenizer's facts,
# which the padded embedding cannot tell.
OFFICIAL_KEYS = {"num_layers": "num_layers", "hidden_size": "hidden_size",
                 "num_heads": "num_attention_heads", "qkv_tokens": "qkv_slot_num",
                 "proj_tokens": "proj_slot_num", "ffn_tokens": "ffn_slot_num",
                 "max_seq_len": "seq_length", "rotary_pct": "rotary_pct",
                 "norm": "norm_activation_type", "vocab_size": "vocab_size",
                 "vocab_multiple": "vocab_multiple", "eos_token_id": "eos_token_id"}
# Fields that do not change what a model computes: the official layout need not carry them.
_NOT_COMPUTED = ("init_std", "name")


def official_config(config: TokenFormerConfig) -> dict[str, Any]:
    """``config.json`` as the released repos write it (:data:`OFFICIAL_KEYS`)."""
    return {neox: getattr(config, ours) for ours, neox in OFFICIAL_KEYS.items()}


def inexpressible(config: TokenFormerConfig) -> list[str]:
    """``field=value`` for every field of ``config`` that the official layout cannot carry and
    that differs from its default (product keys, Θ's factors and ε, top-k, rotary base, block
    norms...): with any of them the official code would compute another function from the
    weights, or fail to load them. Derived from the dataclass, so a new field is covered."""
    return [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
            if f.name not in OFFICIAL_KEYS and f.name not in _NOT_COMPUTED
            and getattr(config, f.name) != f.default
            and not (f.name == "ffn_product_k" and config.ffn_keys == "dense")]  # unused then
