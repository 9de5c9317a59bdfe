"""TokenFormer: Transformers whose every linear projection is attention over parameter tokens."""

from .adapters import adapt, load_adapter, merge, remove_adapter, save_adapter, set_active
from .config import PRESETS, TokenFormerConfig, flops_per_token
from .errors import CheckpointError, ConfigError, DataError, GrowthError, TokenFormerError
from .grow import grow, grow_with_optimizer
from .model import CausalLMOutput, KVCache, TokenFormerLM, load_model
from .pattention import THETA_VARIANTS, Pattention, theta
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .vit import TokenFormerViT, TokenFormerViTConfig

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "THETA_VARIANTS", "ByteTokenizer", "CausalLMOutput", "CheckpointError",
    "ConfigError", "DataError", "GrowthError", "HFTokenizer", "KVCache", "Pattention",
    "TokenFormerConfig", "TokenFormerError", "TokenFormerLM", "TokenFormerViT",
    "TokenFormerViTConfig", "adapt", "flops_per_token",
    "grow", "grow_with_optimizer", "load_adapter", "load_model", "load_tokenizer", "merge",
    "remove_adapter", "save_adapter", "set_active", "theta",
]
