"""What the vLLM model serves, checked before vLLM starts a worker: one clear error per refusal.

vLLM calls :class:`ServingCheck` (a per-architecture config hook) in the process that parses its
arguments, before any engine or worker process exists, so a bad folder or an unsupported option
raises one :class:`~tokenformer.errors.CheckpointError` / :class:`~tokenformer.errors.ConfigError`
there — the line ``LLM(...)`` raises and ``vllm serve`` prints last — instead of a traceback from
a worker. The model's constructor repeats :func:`check_servable` (a vLLM without the hook still
refuses, in the worker). Imports no vLLM: it only reads the config objects vLLM hands over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..io.checkpoint import verify_checkpoint
from ..io.paths import check_folder_files, has_regular_file
from ..models.baselines import model_class
from ..models.checks import check_buildable, check_state_dict, header_shapes
from ..models.persistence import CONFIG_NAME, WEIGHTS_NAME
from ..nn.pattention import KINDS
from ..nn.sharded import check_split

# Weight names in a Hugging Face folder: the core model's names under ``model.``
# (tokenformer.hf.modeling); the vLLM model keeps the core as its ``model`` attribute too.
PREFIX = "model."


def check_servable(config: Any, tensor_parallel_size: int = 1) -> None:
    """ConfigError naming what the vLLM model cannot serve at ``tensor_parallel_size`` > 1:
    what does not split by parameter token (the Transformer baselines, top-k, product keys, a Θ
    without a sharded form, token counts or heads that do not divide). At 1 everything the core
    model computes is served."""
    if tensor_parallel_size == 1:
        return
    arch = getattr(config, "arch", "tokenformer")
    tp = f"tensor_parallel_size {tensor_parallel_size}"
    if arch != "tokenformer":
        raise ConfigError(f"the {arch} baseline is served at tensor_parallel_size 1 only; "
                          f"{tp} shards TokenFormer's parameter tokens")
    if config.ffn_keys != "dense":
        raise ConfigError(f"ffn_keys {config.ffn_keys!r} (product keys) cannot be split by token; "
                          f"serve it with tensor_parallel_size 1")
    for kind in KINDS:
        check_split(f"the {kind} Pattentions", config.norm, getattr(config, f"{kind}_top_k"),
                    getattr(config, f"{kind}_tokens"), tensor_parallel_size)
    if config.num_heads % tensor_parallel_size:
        raise ConfigError(f"num_heads {config.num_heads} does not split evenly over {tp}")


def expected_shapes(config: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face folder's weights for ``config``, as meta tensors (nothing allocated)."""
    with torch.device("meta"):
        core = model_class(getattr(config, "arch", "tokenformer"))(config)
    return {PREFIX + name: tensor for name, tensor in core.state_dict().items()}


def check_folder(folder: str | Path, config: Any) -> None:
    """CheckpointError when a local model folder cannot fill the model its config describes: no
    weights file, a manifest that does not verify, or a key or shape the model does not expect
    (read from the safetensors header; no tensor is loaded)."""
    folder = Path(folder)
    check_folder_files(folder)
    verify_checkpoint(folder)
    weights = folder / WEIGHTS_NAME
    if not has_regular_file(weights, folder=folder):
        if any(folder.glob("*.safetensors")):
            return  # a sharded save (model-0000x-of-0000n): vLLM reads the index itself
        raise CheckpointError(f"{folder} holds no {WEIGHTS_NAME}: vLLM serves a Hugging Face "
                              f"folder written by `tokenformer convert to-hf` or save_hf")
    check_buildable(config, str(folder / CONFIG_NAME), weights)
    found = {name: torch.empty(shape, device="meta")
             for name, shape in header_shapes(weights).items()}
    check_state_dict(expected_shapes(config), found, str(weights))


class ServingCheck:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``, filled by the plugin):
    :func:`check_servable` at the parallel sizes asked for, and :func:`check_folder` when the
    model is a local folder.

    Every refusal leaves as a CheckpointError naming the model: vLLM runs the hook inside the
    validation of its pydantic config, which turns a ``ValueError`` (ConfigError is one) into a
    multi-line ``ValidationError``; other exceptions pass through as they are."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        config = model_config.hf_config.to_core()
        try:
            check_servable(config, vllm_config.parallel_config.tensor_parallel_size)
            if Path(model_config.model).is_dir():
                check_folder(model_config.model, config)
        except ConfigError as exc:  # PathError (a link, a FIFO in the folder) is one too
            raise CheckpointError(f"{model_config.model}: {exc}") from None

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return
