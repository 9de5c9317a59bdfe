"""TokenFormer: Transformers whose every linear projection is attention over parameter tokens.

The public names below are imported on first use (PEP 562), so that ``import tokenformer`` (and
the command line's ``--help``) does not pay for importing torch; ``from tokenformer import X``
works as usual.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    "adapt": "adapters", "load_adapter": "adapters", "merge": "adapters",
    "remove_adapter": "adapters", "save_adapter": "adapters", "set_active": "adapters",
    "PRESETS": "config", "TokenFormerConfig": "config", "flops_per_token": "config",
    "CheckpointError": "errors", "ConfigError": "errors", "DataError": "errors",
    "GrowthError": "errors", "TokenFormerError": "errors",
    "grow": "grow", "grow_with_optimizer": "grow", "prune": "prune",
    "ProductKeyPattention": "product_keys",
    "CausalLMOutput": "model", "KVCache": "model", "TokenFormerLM": "model",
    "load_model": "loading",
    "THETA_VARIANTS": "pattention", "Pattention": "pattention", "theta": "pattention",
    "set_pattention_top_k": "pattention",
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "TokenFormerViT": "vit", "TokenFormerViTConfig": "vit",
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


class _Package(types.ModuleType):
    """``tokenformer.grow`` and ``tokenformer.prune`` are the functions, as with eager imports:
    importing the submodules (which makes the import system set the package attribute to the
    module) must not shadow them."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("grow", "prune") and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from .adapters import adapt, load_adapter, merge, remove_adapter, save_adapter, set_active  # noqa: F401
    from .config import PRESETS, TokenFormerConfig, flops_per_token  # noqa: F401
    from .errors import CheckpointError, ConfigError, DataError, GrowthError, TokenFormerError  # noqa: F401
    from .grow import grow, grow_with_optimizer  # noqa: F401
    from .loading import load_model  # noqa: F401
    from .model import CausalLMOutput, KVCache, TokenFormerLM  # noqa: F401
    from .pattention import THETA_VARIANTS, Pattention, set_pattention_top_k, theta  # noqa: F401
    from .product_keys import ProductKeyPattention  # noqa: F401
    from .prune import prune  # noqa: F401
    from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401
    from .vit import TokenFormerViT, TokenFormerViTConfig  # noqa: F401
