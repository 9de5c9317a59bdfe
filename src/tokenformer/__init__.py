"""TokenFormer: Transformers whose every linear projection is attention over parameter tokens.

The public names below are imported on first use (PEP 562), so that ``import tokenformer`` (and
the command line's ``--help``) does not pay for importing torch; ``from tokenformer import X``
works as usual. The package is layered (docs/architecture.md): ``nn`` (Pattention), ``models``,
``data``, ``hf``, ``formats`` (``load_model``), ``ops`` (grow, prune, adapters), ``training``,
``eval``, ``checkpoints`` (``grow_checkpoint`` ...: a model folder in, a new one out),
``experiments`` and ``cli``, over ``io``. No module shares a public name's name, so
``tokenformer.grow`` and ``tokenformer.prune`` are always the functions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "adapt": "ops.adapters", "load_adapter": "ops.adapters", "merge": "ops.adapters",
    "remove_adapter": "ops.adapters", "save_adapter": "ops.adapters", "set_active": "ops.adapters",
    "PRESETS": "models.config", "TokenFormerConfig": "models.config",
    "flops_per_token": "models.config",
    "CheckpointError": "errors", "ConfigError": "errors", "DataError": "errors",
    "GrowthError": "errors", "TokenFormerError": "errors",
    "grow": "ops.growth", "grow_with_optimizer": "ops.growth", "prune": "ops.pruning",
    "ProductKeyPattention": "nn.product_keys",
    "CausalLMOutput": "models.lm", "TokenFormerLM": "models.lm",
    "KVCache": "models.kv_cache", "StaticKVCache": "models.kv_cache",
    "load_model": "formats.loading",
    "adapt_checkpoint": "checkpoints", "grow_checkpoint": "checkpoints",
    "merge_checkpoint": "checkpoints", "prune_checkpoint": "checkpoints",
    "THETA_VARIANTS": "nn.pattention", "Pattention": "nn.pattention", "theta": "nn.pattention",
    "set_pattention_top_k": "nn.pattention",
    "ByteTokenizer": "data.tokenizer", "HFTokenizer": "data.tokenizer",
    "load_tokenizer": "data.tokenizer",
    "TokenFormerViT": "models.vit", "TokenFormerViTConfig": "models.vit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .checkpoints import adapt_checkpoint, grow_checkpoint, merge_checkpoint, prune_checkpoint  # noqa: F401
    from .data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401
    from .errors import CheckpointError, ConfigError, DataError, GrowthError, TokenFormerError  # noqa: F401
    from .formats.loading import load_model  # noqa: F401
    from .models.config import PRESETS, TokenFormerConfig, flops_per_token  # noqa: F401
    from .models.kv_cache import KVCache, StaticKVCache  # noqa: F401
    from .models.lm import CausalLMOutput, TokenFormerLM  # noqa: F401
    from .models.vit import TokenFormerViT, TokenFormerViTConfig  # noqa: F401
    from .nn.pattention import THETA_VARIANTS, Pattention, set_pattention_top_k, theta  # noqa: F401
    from .nn.product_keys import ProductKeyPattention  # noqa: F401
    from .ops.adapters import adapt, load_adapter, merge, remove_adapter, save_adapter, set_active  # noqa: F401
    from .ops.growth import grow, grow_with_optimizer  # noqa: F401
    from .ops.pruning import prune  # noqa: F401
