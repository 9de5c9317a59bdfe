"""Serving with vLLM: the plugin that registers TokenFormer (docs/serving.md).

``pip install "tokenformer[vllm]"`` declares :func:`register` under vLLM's
``vllm.general_plugins`` entry point, which vLLM calls in every process it starts (the one that
parses its arguments, the engine, the workers) before it reads a model's config. From then on
``vllm serve FOLDER`` and ``vllm.LLM(FOLDER)`` take a Hugging Face folder written by ``tokenformer
convert to-hf`` or :func:`tokenformer.hf.save_hf` — a converted release, a model trained or
grown here, a Transformer baseline — with no ``--trust-remote-code`` and no fork of vLLM.

Importing this package imports nothing of vLLM (nor transformers): the core and the CLI never
import it, and :func:`register` imports vLLM and :mod:`tokenformer.hf` only when vLLM calls it.
The model itself is :mod:`tokenformer.serving.vllm_model` (imported by :func:`register`, with
vLLM); :mod:`tokenformer.serving.checks` holds what it refuses.
"""

from __future__ import annotations

from .checks import ServingCheck

# config.json's "architectures" entry that vLLM looks the model up by (save_hf writes it)
ARCHITECTURE = "TokenFormerForCausalLM"

__all__ = ["ARCHITECTURE", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; vLLM may call it more than once).

    * ``model_type = "tokenformer"`` is registered with transformers' ``AutoConfig`` (importing
      :mod:`tokenformer.hf`), so vLLM reads ``config.json`` without remote code;
    * the architecture is registered with vLLM's ``ModelRegistry`` as the class itself: vLLM's
      other form, a ``"module:Class"`` path, makes it inspect the class in a fresh Python
      process on first use (≈ 1 minute here, mostly importing vLLM again), and the module
      initialises no device when imported;
    * :class:`~tokenformer.serving.checks.ServingCheck` joins vLLM's per-architecture config
      hooks, so a bad folder or option is refused before any worker starts.
    """
    from vllm import ModelRegistry

    import tokenformer.hf  # noqa: F401  (registers the config with AutoConfig)

    from .vllm_model import TokenFormerForCausalLM  # imports vLLM at its top

    ModelRegistry.register_model(ARCHITECTURE, TokenFormerForCausalLM)
    try:  # vLLM's own table of these hooks (an internal name: tested with 0.32)
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    except ImportError:  # moved in another release: the model's constructor still refuses, later
        return
    MODELS_CONFIG_MAP[ARCHITECTURE] = ServingCheck  # type: ignore[assignment]
