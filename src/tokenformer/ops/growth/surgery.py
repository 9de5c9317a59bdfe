"""Token surgery: :func:`rebuild`, the one place a model is rebuilt with new Pattention tokens
(every growth stage and :mod:`tokenformer.ops.pruning`), and the :class:`Growth` record of
which new tensor carries which old one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ...errors import GrowthError
from ...nn.pattention import Pattention


@dataclass
class Growth:
    """One rebuilt model and where each of its tensors came from."""

    model: nn.Module
    # New parameter/buffer name -> the old name it carries over. A block inserted by depth growth
    # maps to the same tensor of its template (the old block before it): optimizer groups and step
    # counts come from there, while its contents are new.
    source: dict[str, str]
    inserted: set[str]
    # How an optimizer state tensor of a parameter carries over, when not by rows:
    # carry(new name, state key, old value) -> new value (width: tiled and rescaled moments;
    # stacking: copies).
    carry: Callable[[str, str, torch.Tensor], torch.Tensor] | None = None


def layers_prefix(model: nn.Module) -> str:
    """The name prefix of the model's blocks (``"layers."``); GrowthError without them."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise GrowthError(f"{type(model).__name__} has no .layers ModuleList of blocks; "
                          f"grow() needs the TokenFormerLM structure")
    name = next(n for n, m in model.named_modules() if m is layers)
    return f"{name}."


def rebuild(model: nn.Module, new_config: Any, tokens_for: Any, source_of: Any = None, *,
            tensor_for: Any = None, copy: bool = True, progress: bool = False,
            desc: str = "resize") -> Growth:
    """The one place token surgery happens (growth and :mod:`tokenformer.ops.pruning`): a new model
    of ``type(model)`` built for ``new_config`` whose every Pattention gets the K and V that
    ``tokens_for(name, new_module, old_module)`` returns, every other tensor copied (or shared,
    ``copy=False``, except into an inserted block) from the old tensor ``source_of(name) ->
    (old name, is_new)`` names (default: the same name), or, given ``tensor_for(name, old)``,
    what it returns. Per-module settings not in the config (``impl``) carry over."""
    source_of = source_of or (lambda name: (name, False))
    # Built on the meta device (no init cost), then every tensor is assigned below.
    with torch.device("meta"):
        new = type(model)(new_config)
    old_state = model.state_dict(keep_vars=True)
    old_modules = dict(model.named_modules())
    state: dict[str, torch.Tensor] = {}
    pattentions = [(n, m) for n, m in new.named_modules() if isinstance(m, Pattention)]
    for name, module in tqdm(pattentions, desc=desc, unit="Pattention",
                             disable=None if progress else True):
        old = old_modules[source_of(name)[0]]
        if hasattr(old, "impl"):  # per-module choice of forward implementation, not in the config
            module.impl = old.impl
        keys, values = tokens_for(name, module, old)
        state[f"{name}.key_param_tokens"], state[f"{name}.value_param_tokens"] = keys, values

    source, inserted = {}, set()
    for name, meta in new.state_dict(keep_vars=True).items():
        old_name, is_new = source_of(name)
        source[name] = old_name
        if is_new:
            inserted.add(name)
        if name in state:
            continue
        old = old_state[old_name]
        if tensor_for is not None:
            old = tensor_for(name, old)
        if old.shape != meta.shape:
            raise GrowthError(f"cannot resize {name}: shape {tuple(old.shape)} would have to "
                              f"become {tuple(meta.shape)}, which token surgery does not do")
        # An inserted block's tensors are its own even when the rest is shared: two parameters
        # on one storage would each apply the other's updates.
        state[name] = old.detach() if tensor_for or not (copy or is_new) else old.detach().clone()
    new.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (e.g. rotary tables) are not in a state dict: carry them over.
    old_buffers = dict(model.named_buffers())
    for name, buffer in new.named_buffers():
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(new.get_submodule(owner), leaf, old_buffers[source_of(name)[0]].clone())
    old_params = dict(model.named_parameters())
    for name, param in new.named_parameters():
        param.requires_grad_(old_params[source[name]].requires_grad)
    new.train(model.training)
    return Growth(new, source, inserted)
