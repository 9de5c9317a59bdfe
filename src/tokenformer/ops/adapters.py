"""Adapters made of parameter tokens: fine-tune a trained TokenFormer by *adding* tokens.

``adapt(model, ffn=64, name="code")`` appends 64 key/value parameter tokens to every FFN
Pattention, initialised by growth's ``exact`` recipe (:mod:`tokenformer.ops.growth`: new keys zero,
new values with the value init, Θ's factor held at the base's), freezes every original parameter and
leaves only the new tokens trainable. The model is changed in place and returned.

* **Where the tokens live.** Each adapted Pattention keeps its own ``key_param_tokens`` /
  ``value_param_tokens`` (names unchanged, so the base state dict is unchanged) and gains
  ``adapters.<name>.key_param_tokens`` [m, d_in] / ``.value_param_tokens`` [m, d_out]: separate
  parameters, so the optimizer (and its weight decay) never touches a base row.
* **Θ over the base and the active adapters' tokens together**, with the base's factor s: the
  forward is the grown layer's, ``Θ_s(x·[K; K_a]ᵀ)·[V; V_a]``. At init the adapter keys are zero,
  so for the L2/L1-GELU variants ‖[a, 0]‖ = ‖a‖ and GELU(0) = 0: the adapted model starts as the
  base exactly. Once trained, the adapter keys are non-zero and enter the norm, so an adapter
  also *re-weights* the base tokens (what growth does; it is also why merging gives a plain grown
  model). Θ = softmax is refused: exp(x·k) > 0, so new tokens can never start silent.
* **Off = base, exactly.** An adapter switched off is dropped from the scores *and* the norm;
  with none active the layer runs the base Pattention's own forward, bit for bit.
* **Stacking.** Several named adapters may be attached; each forward uses the active ones in
  attachment order (:func:`set_active`, :func:`active_adapters`).
* **Saved alone.** :func:`save_adapter` writes ``adapter.safetensors`` (only the new tokens),
  ``adapter_config.json`` (token counts, Θ, the base's :func:`base_fingerprint`) and a manifest;
  :func:`load_adapter` refuses a base whose fingerprint differs, naming both hashes.
* **Remove / merge.** :func:`remove_adapter` gives back the base model (the same tensors);
  :func:`merge` returns a plain, grown :class:`~tokenformer.TokenFormerLM` (growth's ``exact``
  config: Θ's factor held) computing the adapted function.

docs/adapt.md has usage, design choices and the comparison with LoRA.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import types
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..formats.loading import load_model
from ..io import checkpoint as ckpt
from ..io.files import atomic_dir, atomic_write_text, save_safetensors
from ..io.paths import has_regular_file, read_json_object
from ..models.checks import check_state_dict, check_tensors, header_shapes
from ..nn.pattention import KINDS, Pattention, kind_names, pattention_kind
from ..nn.theta import theta_variant
from .growth import grow, grown_tokens

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FORMAT = "tokenformer-adapter-v1"
# An adapter's name is a key of each adapted layer's nn.ModuleDict, which refuses (KeyError) any
# name it has as an attribute itself (forward, keys, training, _modules, ...).
NAME_RULE = ("letters, digits and _, starting with a letter, and not a name torch's "
             "nn.ModuleDict uses itself (forward, keys, items, train, training, ...)")
# Which Pattentions a kind names (the same grouping as the config's qkv/proj/ffn_tokens).


class AdapterTokens(nn.Module):
    """The m key and value tokens one adapter appends to one Pattention."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.key_param_tokens = nn.Parameter(keys)
        self.value_param_tokens = nn.Parameter(values)

    @property
    def num_tokens(self) -> int:
        return self.key_param_tokens.shape[0]


class AdaptedPattention(Pattention):
    """A Pattention carrying named adapters (its class is swapped in place by :func:`adapt`, so
    the base parameters keep their names)."""

    adapters: nn.ModuleDict
    active: tuple[str, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on = [self.adapters[n] for n in self.active if n in self.adapters]
        if not on:
            return Pattention.forward(self, x)
        keys = torch.cat([self.key_param_tokens, *(a.key_param_tokens for a in on)])
        values = torch.cat([self.value_param_tokens, *(a.value_param_tokens for a in on)])
        return self.attend(x, keys, values)  # Pattention's own dispatch (fused/reference/kernel)

    def extra_repr(self) -> str:
        sizes = ", ".join(f"{n}: {a.num_tokens}" for n, a in self.adapters.items())
        return f"{super().extra_repr()}, adapters={{{sizes}}}, active={list(self.active)}"


# ------------------------------------------------------------------------------------- helpers
def check_name(name: object) -> None:
    """Refuse, in one line, a name no adapter can have (:data:`NAME_RULE`)."""
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name)
            and not hasattr(nn.ModuleDict(), name)):
        raise ConfigError(f"adapter name {name!r} is not allowed: use {NAME_RULE}")


def core_model(model: nn.Module) -> nn.Module:
    """The TokenFormerLM inside ``model`` (the HF wrapper keeps it as ``.model``)."""
    inner = getattr(model, "model", None)
    if not hasattr(model, "layers") and isinstance(inner, nn.Module) and hasattr(inner, "layers"):
        return inner
    return model


def _targets(model: nn.Module, kind: str) -> list[tuple[str, Pattention]]:
    found = [(n, m) for n, m in core_model(model).named_modules()
             if isinstance(m, Pattention) and n.endswith(kind_names(kind))]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no {kind} Pattentions to adapt")
    return found


def _adapted(model: nn.Module) -> list[tuple[str, AdaptedPattention]]:
    return [(n, m) for n, m in core_model(model).named_modules()
            if isinstance(m, AdaptedPattention)]


def adapter_names(model: nn.Module) -> list[str]:
    """Attached adapters in attachment order (the order they are stacked in)."""
    return list(getattr(core_model(model), "_adapter_order", []))


def active_adapters(model: nn.Module) -> list[str]:
    return list(getattr(core_model(model), "_adapter_active", ()))


def set_active(model: nn.Module, names: Iterable[str] | str | None) -> None:
    """Switch adapters on (listed, applied in attachment order) and every other one off;
    ``None`` or ``[]`` gives the base model's function exactly."""
    names = [names] if isinstance(names, str) else list(names or [])
    attached = adapter_names(model)
    unknown = [n for n in names if n not in attached]
    if unknown:
        raise ConfigError(f"no adapter named {unknown[0]!r} (attached: "
                          f"{', '.join(attached) or 'none'})")
    order = tuple(n for n in attached if n in names)
    if attached:
        core_model(model)._adapter_active = order
    for _, layer in _adapted(model):
        layer.active = order


@contextlib.contextmanager
def adapters_active(model: nn.Module, names: Iterable[str] | str | None) -> Iterator[None]:
    """``with adapters_active(model, []):`` runs the enclosed forwards with that selection."""
    before = active_adapters(model)
    set_active(model, names)
    try:
        yield
    finally:
        set_active(model, before)


def base_fingerprint(model: nn.Module) -> str:
    """sha256 of the base model's config and every base tensor (names, dtypes, shapes, bytes),
    adapters excluded: the same for a model however it was saved, loaded or wrapped."""
    core = core_model(model)
    digest = hashlib.sha256()
    config = getattr(core, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        data = {k: v for k, v in config.to_dict().items() if k != "name"}
        digest.update(json.dumps(data, sort_keys=True, default=str).encode())
    for name, tensor in sorted(core.state_dict().items()):
        if ".adapters." in name:
            continue
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


# ----------------------------------------------------------------------------------- attaching
def adapt(model: nn.Module, *, qkv: int = 0, proj: int = 0, ffn: int = 0,
          name: str = "adapter", generator: torch.Generator | None = None) -> nn.Module:
    """Attach adapter ``name``: m new tokens per chosen Pattention (growth's exact recipe), every
    other parameter frozen (the base's and earlier adapters'), the new tokens trainable and
    active. Returns ``model`` (changed in place; a Hugging Face wrapper works too)."""
    sizes = {"qkv": qkv, "proj": proj, "ffn": ffn}
    for kind, m in sizes.items():
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"adapter {kind} tokens must be a non-negative integer, got {m!r}")
    if not any(sizes.values()):
        raise ConfigError("an adapter needs tokens: give qkv, proj and/or ffn > 0")
    check_name(name)
    if name in adapter_names(model):
        raise ConfigError(f"an adapter named {name!r} is already attached: give this one another "
                          f"name")
    chosen = {kind: _targets(model, kind) for kind, m in sizes.items() if m}
    norm = next(iter(chosen.values()))[0][1].norm
    if not theta_variant(norm).zero_keys_silent:  # softmax: exp(0) = 1
        raise ConfigError("adapters need an L2/L1-GELU Θ: with Θ=softmax exp(x·k) > 0, so new "
                          "tokens always take a share of the normalisation and cannot start "
                          "silent (growth's exact softmax recipe changes the base rows)")
    active = active_adapters(model)
    _freeze_base(model)
    for kind, layers in chosen.items():
        for _, layer in layers:
            keys, values = _new_tokens(layer, sizes[kind], generator)
            if not isinstance(layer, AdaptedPattention):
                layer.__class__ = AdaptedPattention
                layer.adapters = nn.ModuleDict()
                layer.active = ()
            layer.adapters[name] = AdapterTokens(keys, values)
    core_model(model)._adapter_order.append(name)
    set_active(model, [*active, name])  # every adapted layer shares one selection
    return model


def _new_tokens(layer: Pattention, m: int, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The m rows growth's exact recipe appends to ``layer`` (zero keys, value-init values)."""
    grown = types.SimpleNamespace(num_tokens=layer.num_tokens + m,
                                  key_init_std=layer.key_init_std,
                                  value_init_std=layer.value_init_std)
    keys, values = grown_tokens(layer, grown, "exact", generator)  # type: ignore[arg-type]
    n = layer.num_tokens
    return keys[n:].clone(), values[n:].clone()


def _freeze_base(model: nn.Module) -> None:
    core = core_model(model)
    if not hasattr(core, "_adapter_requires_grad"):  # restored when the last adapter goes
        core._adapter_requires_grad = {n: p.requires_grad for n, p in core.named_parameters()}
        core._adapter_order = []
    for p in core.parameters():  # earlier adapters too: a new one trains on top of them
        p.requires_grad_(False)


def remove_adapter(model: nn.Module, name: str) -> nn.Module:
    """Detach adapter ``name``; with the last one gone the layers are plain Pattentions again and
    the original ``requires_grad`` flags come back: the base model, its own tensors untouched."""
    if name not in adapter_names(model):
        raise ConfigError(f"no adapter named {name!r} (attached: "
                          f"{', '.join(adapter_names(model)) or 'none'})")
    active = [n for n in active_adapters(model) if n != name]
    for _, layer in _adapted(model):
        if name in layer.adapters:
            del layer.adapters[name]
        layer.active = tuple(n for n in layer.active if n != name)
        if not len(layer.adapters):
            del layer.adapters
            del layer.active
            layer.__class__ = Pattention
    core = core_model(model)
    core._adapter_order.remove(name)
    if not _adapted(model):
        for n, p in core.named_parameters():
            p.requires_grad_(core._adapter_requires_grad.get(n, True))
        del core._adapter_requires_grad, core._adapter_order, core._adapter_active
    else:
        set_active(model, active)
    return model


def adapter_state(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors keyed by ``<pattention>.key_param_tokens`` /
    ``.value_param_tokens`` (the base layer's name: what a merge appends rows to)."""
    state = {}
    for layer_name, layer in _adapted(model):
        if name in layer.adapters:
            tokens = layer.adapters[name]
            state[f"{layer_name}.key_param_tokens"] = tokens.key_param_tokens
            state[f"{layer_name}.value_param_tokens"] = tokens.value_param_tokens
    return state


def adapter_sizes(model: nn.Module, name: str) -> dict[str, int]:
    """Tokens per Pattention of each kind for adapter ``name`` (0 where not adapted)."""
    sizes = dict.fromkeys(KINDS, 0)
    for layer_name, layer in _adapted(model):
        if name in layer.adapters:
            kind = pattention_kind(layer_name)
            sizes[kind] = layer.adapters[name].num_tokens
    return sizes


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------- save and load
def save_adapter(model: nn.Module, name: str, directory: str | Path, *,
                 extra: dict[str, Any] | None = None, overwrite: bool = False,
                 command: str | None = None) -> Path:
    """Write adapter ``name`` alone into ``directory`` (atomically, with a manifest; ``command``:
    the output marker, :func:`tokenformer.io.files.atomic_dir`)."""
    if name not in adapter_names(model):
        raise ConfigError(f"no adapter named {name!r} to save")
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state(model, name).items()}
    core = core_model(model)
    config = {"format": ADAPTER_FORMAT, "name": name, "tokens": adapter_sizes(model, name),
              "norm": next(iter(_adapted(model)))[1].norm,
              "base_sha256": base_fingerprint(model),
              "base_config": core.config.to_dict() if hasattr(core, "config") else None,
              "trainable_parameters": sum(t.numel() for t in tensors.values()),
              **(extra or {})}
    directory = Path(directory)
    with atomic_dir(directory, overwrite=overwrite, command=command) as tmp:
        save_safetensors(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        atomic_write_text(tmp / ADAPTER_CONFIG, json.dumps(config, indent=2) + "\n")
        ckpt.write_manifest(tmp)
    return directory


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """The adapter's JSON, after its files were checked against the manifest."""
    directory = Path(directory)
    if not all([has_regular_file(directory / name, folder=directory)
                for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]):
        raise CheckpointError(f"{directory} is not an adapter directory (expected "
                              f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    ckpt.verify_checkpoint(directory)
    config = read_json_object(directory / ADAPTER_CONFIG)
    if config.get("format") != ADAPTER_FORMAT:
        raise CheckpointError(f"{directory / ADAPTER_CONFIG} is not a {ADAPTER_FORMAT} file")
    tokens = config.get("tokens")
    if not isinstance(tokens, dict) or set(tokens) - set(KINDS) or not all(
            type(v) is int and v >= 0 for v in tokens.values()):
        raise CheckpointError(f"{directory / ADAPTER_CONFIG}: malformed 'tokens'")
    try:
        check_name(config.get("name"))
    except ConfigError as exc:
        raise CheckpointError(f"{directory / ADAPTER_CONFIG}: malformed 'name': {exc}") from None
    return config


def load_adapter(model: nn.Module, directory: str | Path, *, name: str | None = None,
                 check_base: bool = True) -> str:
    """Attach the adapter saved in ``directory`` to ``model`` (active) and return its name
    (``name`` loads it under another one).

    Refused, with one line naming both hashes, when ``model`` is not the base it was trained on.
    Its tensors are checked like base weights
    (:func:`tokenformer.models.checks.check_tensors`: keys, shapes, floating point, finite), the
    shapes from the file's header before anything is allocated: a config declaring more tokens
    than the file holds is refused, not built.
    """
    directory = Path(directory)
    config = read_adapter_config(directory)
    if check_base:
        have, want = base_fingerprint(model), str(config.get("base_sha256"))
        if have != want:
            raise CheckpointError(f"adapter {directory} was trained on base sha256 {want[:16]}…, "
                                  f"this model is sha256 {have[:16]}… (hash mismatch: another "
                                  f"base model)")
    name = name or config["name"]
    check_name(name)
    if name in adapter_names(model):
        raise ConfigError(f"cannot stack {directory}: an adapter named {name!r} is already "
                          f"attached, and stacked adapters need distinct names; train each with "
                          f"its own name (tokenformer adapt --name NAME)")
    weights = directory / ADAPTER_WEIGHTS
    expected = _expected_tensors(model, config["tokens"])
    check_state_dict(expected, {k: torch.empty(shape, device="meta")
                                for k, shape in header_shapes(weights).items()}, str(weights))
    try:
        state = safetensors.torch.load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights} is corrupt: {exc}") from None
    check_tensors(expected, state, str(weights))
    adapt(model, **config["tokens"], name=name)
    with torch.no_grad():
        for key, tensor in adapter_state(model, name).items():
            tensor.copy_(state[key])
    return name


def _expected_tensors(model: nn.Module, tokens: dict[str, int]) -> dict[str, torch.Tensor]:
    """The tensors an adapter of ``tokens`` per kind holds for ``model``, named as
    :func:`adapter_state` names them, as meta tensors (shapes only: nothing is allocated)."""
    expected = {}
    for kind, m in tokens.items():
        for layer_name, layer in (_targets(model, kind) if m else []):
            for attr in ("key_param_tokens", "value_param_tokens"):
                width = getattr(layer, attr).shape[1]
                expected[f"{layer_name}.{attr}"] = torch.empty(m, width, device="meta")
    return expected


# ------------------------------------------------------------------------------------- merging
def merge(model: nn.Module, names: Sequence[str] | None = None) -> nn.Module:
    """A plain model computing the adapted function: the base grown (growth's ``exact`` config,
    Θ's factor held) by the adapters' tokens, their rows written in. ``names`` default: the
    active adapters. Every adapted Pattention of a kind must carry the same adapters (a config
    has one token count per kind). The input is not modified; the result is fully trainable."""
    names = list(active_adapters(model) if names is None else names)
    if not names:
        raise ConfigError("nothing to merge: no adapter is active")
    core = core_model(model)
    counts: dict[str, int] = {}
    # Only the kinds an adapter holds tokens of: the others (e.g. a product-key FFN, which has
    # no Pattention) are copied as they are.
    adapted = {k for n in names for k, m in adapter_sizes(model, n).items() if m}
    for kind in sorted(adapted, key=KINDS.index):
        per_layer = {sum(layer.adapters[n].num_tokens if isinstance(layer, AdaptedPattention)
                         and n in layer.adapters else 0 for n in names)
                     for _, layer in _targets(model, kind)}
        if len(per_layer) != 1:
            raise ConfigError(f"cannot merge: the {kind} Pattentions carry different adapter "
                              f"token counts {sorted(per_layer)}; a merged config has one count")
        counts[kind] = per_layer.pop()
    config = core.config
    merged = grow(core, recipe="exact",
                  **{k: getattr(config, f"{k}_tokens") + m for k, m in counts.items() if m})
    params = dict(merged.named_parameters())
    with torch.no_grad():
        for layer_name, layer in _adapted(model):
            on = [layer.adapters[n] for n in names if n in layer.adapters]
            for attr in ("key_param_tokens", "value_param_tokens"):
                rows = torch.cat([getattr(layer, attr), *(getattr(a, attr) for a in on)])
                params[f"{layer_name}.{attr}"].copy_(rows)
    requires = getattr(core, "_adapter_requires_grad", {})
    for n, p in merged.named_parameters():
        p.requires_grad_(requires.get(n, True))
    return merged


def load_adapted(base: str | Path, adapters: Sequence[str | Path] = ()) -> nn.Module:
    """The model at ``base`` (:func:`tokenformer.load_model`, which checks a folder against its
    manifest) with ``adapters`` loaded onto it, stacked in order and all active (each refused if
    trained on another base)."""
    model = load_model(base)
    for directory in adapters:
        load_adapter(model, directory)
    return model
