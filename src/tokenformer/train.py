"""Training: a task-agnostic loop (:func:`fit`) and the language-model front end (:func:`train`).

``fit(model, batch_fn, cfg)`` trains any module whose ``model(**batch_fn(step))`` returns an object
with ``.loss``; batches are a pure function of the step, so the step *is* the data position and a
resumed run replays exactly the batches an uninterrupted one sees. The learning rate is a pure
function of the step too (:func:`lr_at`), written into the optimizer's param groups every step.

``train(cfg)`` (``tokenformer train --config NAME``) builds the model (TokenFormer or a baseline by
``arch``), the data (the embedded corpus or a prepared directory) and an evaluation function
(validation loss, perplexity, bits per byte), calls :func:`fit`, then prints a summary, the
corpus's unigram entropy and samples.

Weight decay: the official GPT-NeoX code (``get_params_for_weight_decay_optimization``) decays
every parameter except those of norm layers and biases; parameter tokens (keys and values) and the
embedding *are* decayed. We do the same: every parameter with >= 2 dimensions is decayed, 1-D ones
(norm weights/biases, Linear biases of the baselines) are not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed as dist_
from . import outputs
from .config import (
    NON_NEGATIVE,
    PRESETS,
    FieldRule,
    TokenFormerConfig,
    check_fields,
    flops_per_token,
)
from .errors import CheckpointError, ConfigError, DivergedError, TokenFormerError
from .pattention import PATTENTION_IMPLS, set_pattention_impl
from .progress import progress_bar

CONFIGS_DIR = Path(__file__).parent / "configs"
RUN_CONFIG = "config.json"
METRICS = "metrics.jsonl"
SCHEDULES = ("cosine", "wsd", "constant")
GROW_KEYS = ("qkv", "proj", "ffn", "layers", "strategy")
# Ranges TrainConfig.validate checks with config.check_fields, beside every field's type. AdamW
# would refuse betas outside [0, 1) and a negative eps itself, but only once the run folder exists.
TRAIN_RULES = {**dict.fromkeys(("beta1", "beta2"), FieldRule("{a} in [0, 1)",
                                                             lambda value: 0 <= value < 1)),
               "eps": NON_NEGATIVE}
DEVICE_TYPES = ("cpu", "cuda", "mps")


# ------------------------------------------------------------------------------------ config
@dataclass
class TrainConfig:
    """Everything a training run needs; YAML files and ``--key value`` overrides fill it."""

    # Each field's docstring is its ``tokenformer train --help`` text (cli.field_docs).
    # model: ``model`` is a TokenFormer config (``preset`` plus overrides); a baseline ``arch`` is
    # built matched to it (baselines.matched_config), then ``baseline`` overrides apply.
    arch: str = "tokenformer"
    """tokenformer, or a FLOP-matched baseline: transformer, transformer++"""
    model: dict = field(default_factory=lambda: {"preset": "small"})
    """TokenFormer config: a preset plus overrides (--model.KEY VALUE)"""
    baseline: dict = field(default_factory=dict)
    """overrides of the matched baseline's config (--baseline.KEY VALUE)"""
    data: str = "default"
    """'default' (the embedded corpus, prepared with --tokenizer) or a prepared directory"""
    tokenizer: str = "bytes"
    """tokenizer of the default corpus: bytes, bpe:VOCAB or a tokenizer.json"""
    seq_len: int = 256
    """tokens per training sequence (<= the model's context)"""
    batch_size: int = 16
    """sequences per optimizer step, all ranks together"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    steps: int = 1000
    """optimizer steps"""
    # optimisation (official recipe: Adam β (0.9, 0.95), eps 1e-8, wd 0.1, clip 1.0)
    lr: float = 1e-3
    """peak learning rate"""
    min_lr: float = 1e-4
    """learning rate at the end of the decay"""
    schedule: str = "cosine"
    """cosine, wsd (warmup-stable-decay) or constant, after a linear warmup"""
    warmup_steps: int = 100
    """linear warmup steps"""
    decay_fraction: float = 0.2
    """wsd: the last fraction of steps decays linearly to min_lr"""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices and parameter tokens; not norms, biases)"""
    beta1: float = 0.9
    """AdamW β1"""
    beta2: float = 0.95
    """AdamW β2"""
    eps: float = 1e-8
    """AdamW ε"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0: off)"""
    grow_at: list[str] = field(default_factory=list)
    """growth inside the run: STEP:qkv=..,proj=..,ffn=..,layers=..,strategy=.. (--grow-at)"""
    growth_lr: str = "continue"
    """continue: one schedule over the run; restart: warmup + decay per stage"""
    growth_optimizer: str = "carry"
    """AdamW moments at a growth: carry (new rows zero), carry-mean (new rows' second moments at
    the old rows' mean, grow.grow_with_optimizer) or reset"""
    # execution
    device: str = "auto"
    """auto, cpu, cuda or cuda:N"""
    precision: str = "fp32"
    """fp32, or bf16 (autocast)"""
    compile: bool = False
    """torch.compile the model"""
    pattention_impl: str = "auto"
    """Pattention implementation set on every Pattention (pattention.PATTENTION_IMPLS):
    reference, fused, kernel (the C++ Θ kernel, built on first use, docs/performance.md), or auto
    (each module's own setting)"""
    activation_checkpointing: bool = False
    """recompute each block's activations in the backward pass (less memory, one more forward)"""
    strategy: str = "auto"
    """single, ddp or fsdp; auto = ddp under torchrun"""
    threads: int = 0
    """torch CPU threads (0: torch's default)"""
    seed: int = 0
    """seed of the initialisation, data order and samples"""
    # evaluation, logging, checkpoints
    eval_interval: int = 100
    """evaluate every this many steps (0: only at eval_at and the end)"""
    eval_batches: int = 16
    """validation batches per evaluation"""
    eval_at: list[int] = field(default_factory=list)
    """extra steps to evaluate at"""
    eval_after_growth: list[int] = field(default_factory=list)
    """evaluate at these offsets after each growth step"""
    checkpoint_interval: int = 0
    """save a resumable checkpoint every this many steps (0: only the final one)"""
    keep_last: int = 2
    """periodic checkpoints kept"""
    out: str = "runs/run"
    """run directory"""
    init_from: str = ""
    """start from a model directory (e.g. what `tokenformer grow` wrote): its weights, and its
    optimizer.pt when present; model/arch then come from the directory"""
    tensorboard: bool = False
    """also write TensorBoard events to OUT/tensorboard (needs the tensorboard extra)"""
    samples: int = 2
    """text samples generated after training"""
    sample_tokens: int = 200
    """tokens per sample"""
    sample_prompt: str = "And"
    """prompt of the samples"""
    temperature: float = 0.8
    """sampling temperature of the samples (0: greedy)"""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from .baselines import ARCHS

        def choice(key: str, options: Sequence[str]) -> None:
            if getattr(self, key) not in options:
                raise ConfigError(f"{key} must be one of {', '.join(options)}, "
                                  f"got {getattr(self, key)!r}")

        check_fields(self, TRAIN_RULES, prefix="")  # every field's type; the AdamW ranges
        if self.device != "auto":
            parse_device(self.device)
        choice("arch", ARCHS)
        choice("schedule", SCHEDULES)
        choice("growth_lr", ("continue", "restart"))
        choice("growth_optimizer", ("carry", "carry-mean", "reset"))
        choice("precision", ("fp32", "bf16"))
        choice("pattention_impl", PATTENTION_IMPLS)
        choice("strategy", dist_.STRATEGIES)
        for key in ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches",
                    "sample_tokens", "keep_last"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_interval", "checkpoint_interval", "threads", "seed",
                    "samples", "weight_decay", "grad_clip", "min_lr", "temperature"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr {self.min_lr} exceeds lr {self.lr}")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"batch_size {self.batch_size} is not divisible by grad_accum "
                              f"{self.grad_accum}")
        if not isinstance(self.model, dict) or not isinstance(self.baseline, dict):
            raise ConfigError("model and baseline must be mappings of config keys")
        growth_events(self)  # malformed --grow-at fails here, before anything is written

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a training config must be a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(data) - set(hints))
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known keys: "
                              f"{', '.join(hints)}")
        values = {k: _coerce(v, hints[k], k) for k, v in data.items()}
        for key in ("model", "baseline"):
            if key in values:
                values[key] = _coerce_nested(values[key], key)
        return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` (from YAML or a command-line string) as the type ``hint`` names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, list):
            value = [value]
        return [_coerce(v, args[0] if args else str, key) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            number = float(value) if hint is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {'a number' if hint is float else 'an integer'}"
                              f", got {value!r}") from None
        if hint is float and not math.isfinite(number):
            raise ConfigError(f"{key} must be finite, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def _coerce_nested(values: dict[str, Any], key: str) -> dict[str, Any]:
    from .baselines import TransformerConfig

    cls = TokenFormerConfig if key == "model" else TransformerConfig
    hints = typing.get_type_hints(cls)
    if key == "model":
        hints["preset"] = str
    out = {}
    for name, value in values.items():
        if name not in hints:
            raise ConfigError(f"unknown {key} key {name!r}; known keys: {', '.join(hints)}")
        out[name] = _coerce(value, hints[name], f"{key}.{name}")
    return out


def config_path(spec: str | Path) -> Path:
    """A YAML file path, or the bare name of a config shipped with the package (``demo``)."""
    from .io import regular_file

    path = Path(spec)
    shipped = CONFIGS_DIR / f"{path.stem if path.suffix in ('.yaml', '.yml') else spec}.yaml"
    if (path.exists() or path.is_symlink()) and not (path.is_dir() and shipped.is_file()):
        return regular_file(path, "config")  # never a FIFO, nor a folder named like the config
    if shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
    raise ConfigError(f"config {str(spec)!r} not found (neither a file nor a shipped config: "
                      f"{names})")


def load_config(spec: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Load a YAML config (a path or shipped name; ``None`` = defaults) and apply ``overrides``:
    ``{"lr": "3e-4", "model.ffn_tokens": 512}`` (dotted keys reach into ``model`` / ``baseline``;
    string values are parsed as the field's type)."""
    import yaml

    data: dict[str, Any] = {}
    if spec is not None:
        path = config_path(spec)
        try:
            text = path.read_text(encoding="utf-8")
            data = yaml.safe_load(text)
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config {path} is malformed: {str(exc).splitlines()[0]}") from None
        if data is None:  # an empty file (or only comments): a truncated config, never all defaults
            raise ConfigError(f"config {path} is empty: give the keys to set (an empty mapping "
                              f"{{}} means every default)")
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values")
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in (overrides or {}).items():
        if "." in key:
            outer, inner = key.split(".", 1)
            if outer not in ("model", "baseline"):
                raise ConfigError(f"unknown config key {key!r} (only model.* and baseline.* "
                                  f"take dotted keys)")
            data.setdefault(outer, {} if outer == "baseline" else {"preset": "small"})
            data[outer][inner] = value
        else:
            data[key] = value
    return TrainConfig.from_dict(data)


# ------------------------------------------------------------------------------------ growth
@dataclass(frozen=True)
class GrowthEvent:
    step: int
    kwargs: dict[str, Any]
    spec: str


def parse_grow_at(spec: str) -> GrowthEvent:
    """``"STEP:qkv=2x,ffn=512,layers=6,strategy=exact"`` → GrowthEvent."""
    usage = (f"--grow-at {spec!r} is malformed: expected STEP:key=value,... with keys "
             f"{', '.join(GROW_KEYS)} (e.g. 500:qkv=2x,proj=2x,ffn=2x,strategy=exact)")
    step_text, sep, rest = str(spec).partition(":")
    if not sep or not step_text.strip().isdecimal() or not rest.strip():
        raise ConfigError(usage)
    kwargs: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or key not in GROW_KEYS or not value or key in kwargs:
            raise ConfigError(usage)
        if key == "strategy":
            from .grow import STRATEGIES

            if value not in STRATEGIES:
                raise ConfigError(f"--grow-at {spec!r}: unknown strategy {value!r}; choose one "
                                  f"of {', '.join(STRATEGIES)}")
            kwargs[key] = value
        elif value.isdecimal() and int(value) > 0:
            kwargs[key] = int(value)
        elif value.endswith("x") and _is_positive_float(value[:-1]):
            if float(value[:-1]) < 1:
                raise ConfigError(f"--grow-at {spec!r}: {key}={value} would shrink the model; "
                                  f"growth only adds (use a multiplier >= 1x)")
            kwargs[key] = value
        else:
            raise ConfigError(f"--grow-at {spec!r}: {key}={value!r} must be a positive integer "
                              f"or a multiplier like 2x")
    return GrowthEvent(int(step_text), kwargs, str(spec))


def _is_positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def growth_events(cfg: TrainConfig) -> list[GrowthEvent]:
    events = sorted((parse_grow_at(s) for s in cfg.grow_at), key=lambda e: e.step)
    for event in events:
        if not 0 < event.step < cfg.steps:
            raise ConfigError(f"--grow-at {event.spec!r}: the step must be in 1..{cfg.steps - 1}")
    if len({e.step for e in events}) != len(events):
        raise ConfigError("--grow-at: two growths at the same step; merge them into one")
    return events


def check_growth_plan(config: Any, events: Sequence[GrowthEvent]) -> None:
    """Apply every growth to the model config in order, before the first step: a shrink, an
    unknown strategy, an impossible multiple or a model too large for memory fails now, not after
    the steps before it."""
    from .grow import check_memory, plan_growth

    if not events or not hasattr(config, "qkv_tokens"):
        return
    for event in events:
        try:
            config = plan_growth(config, **event.kwargs)
            check_memory(config, 4, "the grown model")  # weights, gradients, two moments
        except TokenFormerError as exc:
            raise ConfigError(f"--grow-at {event.spec!r}: {exc}") from None


# ------------------------------------------------------------------------------------ schedule
def lr_at(step: int, cfg: TrainConfig, growth_steps: Sequence[int] = ()) -> float:
    """Learning rate of optimizer step ``step`` (0-based), a pure function of the step.

    Linear warmup over ``warmup_steps`` (step 0 already has lr/warmup), then ``cosine`` down to
    ``min_lr`` at the last step, ``wsd`` (stable at ``lr``, then a linear decay to ``min_lr`` over
    the last ``decay_fraction`` of the steps) or ``constant``. With ``growth_lr: restart`` every
    stage between growth steps runs its own schedule from warmup, as the released code does.
    """
    start, end = 0, cfg.steps
    if cfg.growth_lr == "restart":
        for g in sorted(growth_steps):
            if g <= step:
                start = g
            elif g < end:
                end = g
                break
    s, n = step - start, end - start
    warmup = min(cfg.warmup_steps, n)
    if s < warmup:
        return cfg.lr * (s + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = (s - warmup) / max(n - 1 - warmup, 1)
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr -
                                                                                  cfg.min_lr)
    decay = max(1, round(cfg.decay_fraction * n))  # wsd
    decay_start = max(n - decay, warmup)
    if s < decay_start:
        return cfg.lr
    progress = (s - decay_start + 1) / (n - decay_start)
    return cfg.lr - progress * (cfg.lr - cfg.min_lr)


# ------------------------------------------------------------------------------------ optimizer
def param_groups(model: nn.Module, weight_decay: float,
                 names: Sequence[Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: ``decay`` (>= 2-D: embeddings, parameter tokens, Linear weights) and
    ``no_decay`` (norms, biases). ``names`` rebuilds saved groups in their saved order."""
    params = dict(model.named_parameters())
    if names is None:
        decay = [n for n, p in params.items() if p.requires_grad and p.ndim >= 2]
        no_decay = [n for n, p in params.items() if p.requires_grad and p.ndim < 2]
        names = [decay, no_decay]
    if len(names) != 2:
        raise CheckpointError(f"expected 2 optimizer param groups, the checkpoint has "
                              f"{len(names)}")
    missing = [n for group in names for n in group if n not in params]
    if missing:
        raise CheckpointError(f"the optimizer state names parameter {missing[0]!r}, which the "
                              f"model does not have")
    return [{"params": [params[n] for n in names[0]], "weight_decay": weight_decay,
             "name": "decay"},
            {"params": [params[n] for n in names[1]], "weight_decay": 0.0, "name": "no_decay"}]


def make_optimizer(model: nn.Module, cfg: TrainConfig,
                   names: Sequence[Sequence[str]] | None = None) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, names), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


# ------------------------------------------------------------------------------------ the loop
@dataclass
class FitResult:
    model: nn.Module  # the final (possibly grown) model, unwrapped
    optimizer: torch.optim.Optimizer
    step: int
    losses: list[float]  # per-step training loss of this call
    records: list[dict[str, Any]]  # every train / eval / grow record of this call
    tokens: int
    flops: float
    train_time: float
    elapsed: float
    run_dir: Path | None = None

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == "eval"]

    @property
    def final_eval(self) -> dict[str, Any] | None:
        evals = self.evals
        return evals[-1] if evals else None


def lm_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Training FLOPs of one LM batch: the one analytic count × tokens."""
    ids = batch["input_ids"]
    return flops_per_token(model.config, ids.shape[1], training=True)["total"] * ids.numel()


def _count_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "input_ids" in batch:
        return batch["input_ids"].numel()
    return next(iter(batch.values())).shape[0]


def _micro_batches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    if n == 1:
        return [batch]
    sizes = {v.shape[0] for v in batch.values() if torch.is_tensor(v)}
    if len(sizes) != 1 or next(iter(sizes)) % n:
        raise ConfigError(f"the per-rank batch ({sizes}) is not divisible into grad_accum={n} "
                          f"equal micro-batches")
    chunks = {k: v.chunk(n) if torch.is_tensor(v) else [v] * n for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(n)]


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _prepare(model: nn.Module, cfg: TrainConfig, world: dist_.World,
             device: torch.device) -> nn.Module:
    """Pattention impl, activation checkpointing per block, DDP/FSDP, torch.compile: the module
    training calls."""
    if cfg.pattention_impl != "auto":
        set_pattention_impl(model, cfg.pattention_impl)
    if cfg.activation_checkpointing:
        for block in dist_._blocks(model):
            if not isinstance(block.forward, functools.partial):
                block.forward = functools.partial(_checkpointed, block.forward)
    module = dist_.wrap_model(model, world, device)
    if cfg.compile and cfg.pattention_impl in ("auto", "kernel"):
        from . import kernels

        kernels.available()  # build/load before tracing: a decision made mid-trace breaks graphs
    return torch.compile(module) if cfg.compile else module


def fit(
    model: nn.Module,
    batch_fn: Callable[[int], dict[str, torch.Tensor]],
    cfg: TrainConfig,
    *,
    eval_fn: Callable[[nn.Module], dict[str, float]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    start_step: int = 0,
    out_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    callbacks: Sequence[Callable[[dict[str, Any], nn.Module], None]] = (),
    flops_fn: Callable[[nn.Module, dict[str, torch.Tensor]], float] | None = None,
    save_extra: Callable[[Path], None] | None = None,
    world: dist_.World | None = None,
    device: torch.device | str | None = None,
    progress: bool | None = None,
) -> FitResult:
    """Train ``model`` from ``start_step`` to ``cfg.steps``; see the module docstring.

    ``batch_fn(step)`` returns this rank's slice of the global batch (a dict of tensors, already
    on the device, whose keys ``model`` accepts). ``eval_fn(model)`` returns metrics; it runs on
    every rank at ``eval_interval``, ``eval_at``, around growths and at the end. ``flops_fn``
    counts the training FLOPs of a batch (default: :func:`lm_flops`). ``resume_from`` (a
    checkpoint directory) restores model, optimizer, RNG, step and counters, and ``model``'s class
    loads it. ``callbacks`` see every metrics record and the current model.

    With ``out_dir`` the run folder is locked for the call (:mod:`tokenformer.outputs`), and
    SIGINT/SIGTERM stop the loop after the current step with a checkpoint written
    (:class:`Interrupted`); a second signal stops at once.
    """
    world = world or dist_.World()
    lock = (outputs.hold_run_folder(out_dir, command="train", world=world)
            if out_dir is not None else contextlib.nullcontext())
    with lock, _StopOnSignal(enabled=out_dir is not None) as stopper:
        return _fit(model, batch_fn, cfg, eval_fn=eval_fn, optimizer=optimizer,
                    start_step=start_step, out_dir=out_dir, resume_from=resume_from,
                    callbacks=callbacks, flops_fn=flops_fn, save_extra=save_extra, world=world,
                    device=device, progress=progress, stopper=stopper)


class Interrupted(TokenFormerError):
    """SIGINT or SIGTERM stopped a run after its current step, with a checkpoint written; the
    CLI exits with ``exit_code`` (128 + the signal number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _StopOnSignal:
    """While training into a run folder: the first SIGINT/SIGTERM asks the loop to stop after
    the current step; a second one raises KeyboardInterrupt at once (the CLI then exits 130).

    Signals within ``ECHO`` seconds of the first count as the same one: a Ctrl-C under torchrun
    reaches each worker twice, from the terminal and forwarded by the launcher.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    ECHO = 0.5

    def __init__(self, enabled: bool) -> None:
        self.signum = 0
        self.first = 0.0
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopOnSignal:
        if self.enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            if time.monotonic() - self.first < self.ECHO:
                return
            raise KeyboardInterrupt
        self.signum, self.first = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then writing a "
              f"checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self, world: dist_.World) -> int:
        """The signal that asked to stop (0: none), the same on every rank."""
        return dist_.max_across(self.signum, world)


@contextlib.contextmanager
def interrupt_on_signal(kept: str) -> Iterator[None]:
    """For commands with no checkpoint to write when stopped (adapt, scale): SIGINT or SIGTERM
    during the block stops the command at once with :class:`Interrupted`, whose one line says
    ``kept`` (what is saved and how to go on), and the CLI exits 128 + the signal number, as a
    ``train`` interrupt does. Signal handlers belong to the main thread: elsewhere, no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}: {kept}", 128 + signum)

    previous = {sig: signal.signal(sig, handle) for sig in _StopOnSignal.SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fit(model: nn.Module, batch_fn: Callable[[int], dict[str, torch.Tensor]], cfg: TrainConfig,
         *, eval_fn: Callable[[nn.Module], dict[str, float]] | None,
         optimizer: torch.optim.Optimizer | None, start_step: int, out_dir: str | Path | None,
         resume_from: str | Path | None,
         callbacks: Sequence[Callable[[dict[str, Any], nn.Module], None]],
         flops_fn: Callable[[nn.Module, dict[str, torch.Tensor]], float] | None,
         save_extra: Callable[[Path], None] | None, world: dist_.World,
         device: torch.device | str | None, progress: bool | None, stopper: _StopOnSignal
         ) -> FitResult:
    device = torch.device(device) if device is not None else next(model.parameters()).device
    flops_fn = flops_fn or lm_flops
    events = growth_events(cfg)
    if events and world.strategy == "fsdp":
        raise ConfigError("growth inside a run is not supported with strategy fsdp; use ddp")
    growth_steps = [e.step for e in events]
    run_dir = Path(out_dir) if out_dir is not None else None
    counters = {"tokens": 0, "flops": 0.0, "train_time": 0.0, "elapsed": 0.0}
    model = model.to(device)

    if resume_from is not None:
        if optimizer is not None:
            raise ConfigError("pass either an optimizer or resume_from, not both")
        model, optimizer, state = _restore(type(model), Path(resume_from), cfg, world, device)
        start_step = state["step"]
        counters = {k: state[k] for k in counters}
    module = _prepare(model, cfg, world, device)
    if optimizer is None:
        optimizer = make_optimizer(model, cfg)
    # Named now: after an FSDP forward the root's parameters may be unsharded stand-ins.
    names = group_names(model, optimizer)
    if run_dir is not None and resume_from is not None and world.is_main:
        ckpt.MetricsLog.truncate(run_dir / METRICS, start_step)

    log = None
    if run_dir is not None and world.is_main:
        log = ckpt.MetricsLog(run_dir / METRICS, run_dir / "tensorboard" if cfg.tensorboard
                              else None)
    records: list[dict[str, Any]] = []
    losses: list[float] = []
    eval_steps = {cfg.steps, *cfg.eval_at,
                  *(g + o for g in growth_steps for o in cfg.eval_after_growth)}
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16,
                                 enabled=cfg.precision == "bf16")
    bar = None
    if world.is_main:  # a bar on a terminal, plain lines in a log, nothing if progress=False
        bar = progress_bar(cfg.steps, "train", progress=progress, unit="step",
                           initial=start_step)

    def emit(record: dict[str, Any]) -> None:
        records.append(record)
        if log is not None:
            log.append(record)
        for callback in callbacks:
            callback(record, model)

    def evaluate(step: int, target: nn.Module | None = None) -> dict[str, Any]:
        target = model if target is None else target  # _grow evaluates the grown model
        was_training = target.training
        target.eval()
        with torch.no_grad(), autocast():
            metrics = eval_fn(target)
        target.train(was_training)
        return {k: float(v) for k, v in metrics.items()}

    def save(step: int, path: Path) -> None:
        state = {"format": "tokenformer-trainer-v1", "step": step, **counters,
                 "param_groups": names, "world_size": world.world_size,
                 "strategy": world.strategy, "growth": [e.spec for e in events
                                                       if e.step <= step],
                 "train_config": cfg.to_dict()}
        try:
            if world.strategy == "fsdp":
                def rest(tmp: Path) -> None:
                    model.config.save(tmp / "config.json")
                    if save_extra is not None:
                        save_extra(tmp)
                    ckpt.write_state(tmp, state)

                dist_.save_sharded(path, model, optimizer, world, rest)
            elif world.is_main:
                ckpt.save_checkpoint(path, model, optimizer, state, save_extra)
        except (OSError, RuntimeError) as exc:
            if not outputs.is_disk_full(exc):
                raise
            raise CheckpointError(f"no space left on device while writing the checkpoint {path} "
                                  f"(step {step}); nothing was replaced, earlier checkpoints are "
                                  f"intact: free some space, then resume") from None
        dist_.barrier(world)

    model.train()
    wall_start = time.perf_counter() - counters["elapsed"]
    try:
        for step in range(start_step, cfg.steps):
            event = next((e for e in events if e.step == step), None)
            if event is not None:
                model, optimizer, module, record = _grow(model, optimizer, event, cfg, world,
                                                         device, eval_fn and evaluate, counters)
                names = group_names(model, optimizer)
                emit(record)
            lr = lr_at(step, cfg, growth_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            batch = batch_fn(step)
            micro = _micro_batches(batch, cfg.grad_accum)
            loss_sum = torch.zeros((), device=device)
            for i, mb in enumerate(micro):
                with dist_.no_gradient_sync(module, world, skip=i < len(micro) - 1), autocast():
                    loss = module(**mb).loss / len(micro)
                loss.backward()
                loss_sum += loss.detach().float()
            grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                         if cfg.grad_clip > 0 else None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = dist_.mean_across(loss_sum, world)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            tokens = _count_tokens(batch) * world.world_size
            flops = flops_fn(model, batch) * world.world_size
            counters["tokens"] += tokens
            counters["flops"] += flops
            counters["train_time"] += dt
            counters["elapsed"] = time.perf_counter() - wall_start
            done = step + 1
            losses.append(loss_value)
            record = {"type": "train", "step": done, "loss": loss_value, "lr": lr,
                      "grad_norm": _scalar(grad_norm), **counters,
                      "tokens_per_s": tokens / dt, "flops_per_s": flops / dt}
            emit(record)
            if not math.isfinite(loss_value):
                raise DivergedError(f"the training loss became {loss_value} at step {done}; "
                                       f"lower the learning rate or enable grad_clip")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                                tok_s=f"{tokens / dt:,.0f}", refresh=False)
            if eval_fn is not None and (done in eval_steps or (
                    cfg.eval_interval and done % cfg.eval_interval == 0)):
                metrics = evaluate(done)
                emit({"type": "eval", "step": done, **metrics, **counters})
                if bar is not None:
                    bar.write(f"step {done}: " + "  ".join(f"{k} {v:.4f}"
                                                           for k, v in metrics.items()))
            if run_dir is not None:
                signum = stopper.requested(world)  # the same on every rank: all save or none
                periodic = cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0
                if done == cfg.steps:
                    save(done, run_dir / ckpt.FINAL)
                elif periodic or signum:
                    save(done, ckpt.step_dir(run_dir, done))
                    if world.is_main:
                        ckpt.prune_checkpoints(run_dir, cfg.keep_last)
                if signum and done < cfg.steps:
                    raise Interrupted(f"interrupted by {signal.Signals(signum).name} after step "
                                      f"{done} of {cfg.steps}: checkpoint written to "
                                      f"{ckpt.step_dir(run_dir, done)}", 128 + signum)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    return FitResult(model, optimizer, max(start_step, cfg.steps), losses, records,
                     counters["tokens"], counters["flops"], counters["train_time"],
                     counters["elapsed"], run_dir)


def _scalar(value: torch.Tensor | None) -> float | None:
    if value is None:
        return None
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)  # FSDP: DTensor


def _grow(model: nn.Module, optimizer: torch.optim.Optimizer, event: GrowthEvent,
          cfg: TrainConfig, world: dist_.World, device: torch.device,
          evaluate: Callable | None, counters: dict[str, Any]
          ) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, dict[str, Any]]:
    """Grow model and optimizer; evaluate before and after; the record of the event."""
    from .grow import grow_with_optimizer

    before = evaluate(event.step, model) if evaluate else {}
    params_before = sum(p.numel() for p in model.parameters())
    config_before = getattr(model, "config", None)
    # The same generator on every rank and on resume: new tokens are identical everywhere.
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + event.step)
    model, optimizer = grow_with_optimizer(model, optimizer,
                                           reset_optimizer=cfg.growth_optimizer == "reset",
                                           new_row_moments="mean" if cfg.growth_optimizer
                                           == "carry-mean" else "zero",
                                           generator=generator, **event.kwargs)
    model = model.to(device).train()
    module = _prepare(model, cfg, world, device)
    after = evaluate(event.step, model) if evaluate else {}
    record: dict[str, Any] = {
        "type": "grow", "step": event.step, "spec": event.spec,
        "params_before": params_before, "params_after": sum(p.numel() for p in
                                                            model.parameters()),
        "before": before, "after": after, **counters}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "projection_flops"):
        record["flops_per_token_before"] = flops_per_token(config_before, cfg.seq_len, True
                                                           )["total"]
        record["flops_per_token_after"] = flops_per_token(config, cfg.seq_len, True)["total"]
    return model, optimizer, module, record


def _restore(cls: type, path: Path, cfg: TrainConfig, world: dist_.World, device: torch.device
             ) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """Model, optimizer and trainer state of a checkpoint, for :func:`fit` to continue from."""
    state = ckpt.read_state(path)
    _check_state(state, path)
    if dist_.is_sharded(path):
        if world.strategy != "fsdp":
            raise CheckpointError(f"{path} is an FSDP (sharded) checkpoint; resume it with "
                                  f"strategy fsdp, or consolidate it first")
        from .model import check_buildable

        config_class = getattr(cls, "config_class", None)
        config = config_class.load(path / "config.json")
        check_buildable(config, str(path / "config.json"))  # before any tensor is made
        model = cls(config).to(device)
        dist_.wrap_model(model, world, device)
        optimizer = make_optimizer(model, cfg, state["param_groups"])
        dist_.load_sharded(path, model, optimizer)
    else:
        model = cls.load(path).to(device)
        optimizer = make_optimizer(model, cfg, state["param_groups"])
        try:
            optimizer.load_state_dict(ckpt.load_optimizer_state(path))
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{path}/{ckpt.OPTIMIZER_NAME} does not match the model: "
                                  f"{exc}") from None
    ckpt.load_rng_state(path)
    return model, optimizer, state


def _check_state(state: Any, path: Path) -> None:
    """A trainer state to resume from holds a step, the counters and the param-group names."""
    file = path / ckpt.STATE_NAME

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file} is malformed ({what}); resume from an earlier "
                               f"checkpoint or restore the file")

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad(f"step is {step!r}, expected an integer >= 0")
    for key in ("tokens", "flops", "train_time", "elapsed"):
        value = state.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
                math.isfinite(value) and value >= 0):
            raise bad(f"{key} is {value!r}, expected a number >= 0")
    groups = state.get("param_groups")
    if not (isinstance(groups, list) and all(isinstance(g, list) and all(
            isinstance(n, str) for n in g) for g in groups)):
        raise bad("param_groups is not a list of lists of parameter names")


# ------------------------------------------------------------------------------- the LM front end
def build_model_config(cfg: TrainConfig, vocab_size: int | None = None,
                       eos_token_id: int | None = None) -> Any:
    """The model config a training config names: ``model`` (a preset plus overrides; vocabulary
    and EOS from the data, context = ``seq_len`` unless set) and, for a baseline ``arch``, the
    matched baseline with ``baseline`` overrides."""
    from .baselines import TransformerConfig, matched_config

    overrides = dict(cfg.model)
    preset = overrides.pop("preset", None)
    data: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown model preset {preset!r}; known presets: "
                              f"{', '.join(PRESETS)}")
        data.update(PRESETS[preset], name=preset)
    if vocab_size is not None:
        data["vocab_size"] = vocab_size
        data["eos_token_id"] = eos_token_id
    data["max_seq_len"] = cfg.seq_len
    data.update(overrides)
    config = TokenFormerConfig.from_dict(data)
    if cfg.seq_len > config.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds model.max_seq_len "
                          f"{config.max_seq_len}")
    if cfg.arch == "tokenformer":
        if cfg.baseline:
            raise ConfigError("baseline overrides were given but arch is tokenformer")
        return config
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(cfg.baseline) - known)
    if unknown:
        raise ConfigError(f"unknown baseline key(s): {', '.join(unknown)}")
    return matched_config(config, cfg.arch, **cfg.baseline)


def open_dataset(cfg: TrainConfig, progress: bool = True) -> Any:
    from . import data

    if cfg.data == "default":
        return data.default_dataset(cfg.tokenizer, progress=progress)
    return data.TokenDataset.open(cfg.data)


def lm_batches(dataset: Any, batch_size: int, seq_len: int, seed: int,
               device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1
               ) -> Callable[[int], dict[str, torch.Tensor]]:
    """``fit``'s batch function for a language model: step → this rank's share of the training
    batch (a pure function of seed and step, so runs of one seed see the same data)."""
    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = dataset.batch("train", step, batch_size, seq_len, seed=seed, rank=rank,
                            world_size=world_size).to(device)
        return {"input_ids": ids, "labels": ids}

    return batch_fn


def lm_evaluator(dataset: Any, seq_len: int, batch_size: int, max_batches: int,
                 device: torch.device) -> Callable[[nn.Module], dict[str, float]]:
    """Validation loss (nats/token), perplexity and bits per byte over fixed, evenly spread
    windows of the held-out split."""
    windows = list(dataset.eval_windows("val", seq_len, batch_size, max_batches=max_batches))
    bytes_per_token = dataset.bytes_per_token("val")

    def evaluate(model: nn.Module) -> dict[str, float]:
        total, count = 0.0, 0
        for ids in windows:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            n = ids.shape[0] * (ids.shape[1] - 1)
            total += float(loss) * n
            count += n
        loss = total / count
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)),
                "val_bpb": loss / math.log(2) / bytes_per_token}

    return evaluate


def parse_device(spec: str) -> torch.device:
    """``spec`` as a torch device of a type this package runs on (:data:`DEVICE_TYPES`), else one
    ConfigError line (torch's own error lists every device type it knows). Whether CUDA is there
    is :func:`resolve_device`'s question."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {spec!r} (use cpu, cuda, cuda:N or mps)")
    return device


def resolve_device(spec: str, world: dist_.World | None = None) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but CUDA is not available")
        if world is not None and world.distributed:
            device = torch.device("cuda", world.local_rank)
            torch.cuda.set_device(device)
    return device


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool | None = None,
          print_fn: Callable[[str], None] = print) -> FitResult:
    """Train a language model as ``cfg`` says, into ``cfg.out``; see the module docstring.

    ``resume=True`` continues the run in ``cfg.out`` from its newest checkpoint, bit for bit.
    """
    from .baselines import model_class

    world = dist_.World()
    stack = contextlib.ExitStack()
    try:
        device = resolve_device(cfg.device)
        world = dist_.init(cfg.strategy, device)
        device = resolve_device(cfg.device, world)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        show = progress if world.is_main else False
        dataset = open_dataset(cfg, progress=show)
        tokenizer = dataset.tokenizer
        initial = _initial_model(cfg) if cfg.init_from and not resume else None
        # read before the run folder is made: a bad optimizer file leaves nothing behind
        optimizer = _initial_optimizer(initial, cfg) if initial is not None else None
        model_config = (initial.config if initial is not None else
                        build_model_config(cfg, dataset.vocab_size, tokenizer.eos_token_id))
        if cfg.seq_len > model_config.max_seq_len:
            raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context "
                              f"{model_config.max_seq_len}")
        dataset.check_model(model_config.vocab_size, cfg.seq_len)
        check_growth_plan(model_config, growth_events(cfg))
        if cfg.batch_size % (world.world_size * cfg.grad_accum):
            raise ConfigError(f"batch_size {cfg.batch_size} must be divisible by world size "
                              f"{world.world_size} × grad_accum {cfg.grad_accum}")
        if cfg.tensorboard:
            try:
                importlib.import_module("torch.utils.tensorboard")
            except ImportError:
                raise ConfigError("tensorboard: true needs the tensorboard package: "
                                  "pip install 'tokenformer[tensorboard]'") from None
        run_dir = Path(cfg.out)
        inputs = [cfg.data if cfg.data != "default" else cfg.tokenizer, cfg.init_from or None]
        # before the folder is created or locked: not an input, not someone else's folder. A run
        # of an earlier version (no marker) has metrics.jsonl; config.json alone may be a model
        # folder (a merge or adapt output), which a lock and marker would spoil.
        outputs.check_run_folder(run_dir, inputs, command="train", legacy=(METRICS,))
        dist_.barrier(world)  # every rank checked before rank 0 writes the lock and marker
        stack.enter_context(outputs.hold_run_folder(run_dir, command="train", world=world))
        if not resume and ((run_dir / METRICS).exists() or (run_dir / RUN_CONFIG).exists()):
            raise ConfigError(f"{run_dir} already holds a run; resume it with --resume "
                              f"{run_dir}, or choose another --out")
        resume_from = None
        if resume and ckpt.list_checkpoints(run_dir):
            resume_from = ckpt.latest_checkpoint(run_dir)
            # a malformed state or log fails here, on every rank, before anything changes
            state = ckpt.read_state(resume_from)
            _check_state(state, resume_from)
            ckpt.MetricsLog.kept(run_dir / METRICS, state["step"])
        elif resume:  # a crash before the first checkpoint: start over with the saved config
            ckpt.MetricsLog.kept(run_dir / METRICS, 0)  # malformed: fails on every rank
            if world.is_main:
                ckpt.MetricsLog.truncate(run_dir / METRICS, 0)
                print_fn(f"{run_dir} has no checkpoint yet: starting from step 0 with its "
                         f"saved config")
        dist_.barrier(world)  # every rank has looked at run_dir before rank 0 writes into it
        # Every rank evaluates the same windows, so the metrics do not depend on the world size.
        eval_fn = lm_evaluator(dataset, cfg.seq_len, cfg.batch_size, cfg.eval_batches, device)
        torch.manual_seed(cfg.seed)
        model = initial if initial is not None else model_class(cfg.arch)(model_config)
        if world.is_main:
            from .io import atomic_write_text

            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / RUN_CONFIG, json.dumps(cfg.to_dict(), indent=2) + "\n")
        per_rank = cfg.batch_size // world.world_size

        rank_batches = lm_batches(dataset, cfg.batch_size, cfg.seq_len, cfg.seed, device,
                                  world.rank, world.world_size)

        def batch_fn(step: int) -> dict[str, torch.Tensor]:
            batch = rank_batches(step)
            assert batch["input_ids"].shape[0] == per_rank
            return batch

        if world.is_main:
            n = model.num_parameters()
            print_fn(f"training {cfg.arch} {model_config.name}: {n:,} parameters "
                     f"({model.num_parameters(non_embedding=True):,} non-embedding), "
                     f"{flops_per_token(model_config, cfg.seq_len, True)['total']:.4g} "
                     f"training FLOPs/token, {cfg.steps} steps × {cfg.batch_size} × "
                     f"{cfg.seq_len} tokens on {world.world_size}× {device.type} "
                     f"({world.strategy}, {cfg.precision})")
        try:
            result = fit(model, batch_fn, cfg, eval_fn=eval_fn, out_dir=run_dir,
                         resume_from=resume_from, save_extra=tokenizer.save, world=world,
                         device=device, progress=show, optimizer=optimizer)
        except Interrupted as exc:
            exc.args = (f"{exc}; continue with: tokenformer train --resume {run_dir}",)
            raise
    except BaseException:
        stack.close()
        raise
    finally:
        dist_.shutdown()
    with stack:  # the run folder stays locked until the report is written
        if world.is_main:
            if world.strategy == "fsdp":
                # The final model as a plain model.safetensors directory, read without the group.
                final = dist_.consolidate_checkpoint(run_dir / ckpt.FINAL)
                result.model = model_class(cfg.arch).load(final).to(device)
            _report(result, dataset, cfg, print_fn)
    return result



def _initial_model(cfg: TrainConfig) -> nn.Module:
    from .baselines import load_model_dir

    model = load_model_dir(cfg.init_from)  # checked against its manifest first
    arch = getattr(model.config, "arch", "tokenformer")
    if arch != cfg.arch:
        raise ConfigError(f"init_from {cfg.init_from} holds a {arch} model but arch is "
                          f"{cfg.arch}; set --arch {arch}")
    return model


def _initial_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | None:
    """AdamW with the state saved beside ``init_from`` (e.g. carried over by growth), if any."""
    if not ckpt.has_optimizer_state(cfg.init_from):
        return None
    optimizer = make_optimizer(model, cfg)
    state = ckpt.load_optimizer_state(cfg.init_from)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{cfg.init_from}/{ckpt.OPTIMIZER_NAME} does not match the "
                              f"model: {exc}") from None
    for p in params:
        moment = optimizer.state.get(p, {}).get("exp_avg")
        if moment is not None and moment.shape != p.shape:
            raise CheckpointError(f"{cfg.init_from}/{ckpt.OPTIMIZER_NAME} does not match the "
                                  f"model (a moment of shape {tuple(moment.shape)} for a "
                                  f"parameter of shape {tuple(p.shape)})")
    return optimizer


def _report(result: FitResult, dataset: Any, cfg: TrainConfig,
            print_fn: Callable[[str], None]) -> None:
    from .data import unigram_entropy

    final = result.final_eval
    ln2_bpt = math.log(2) * dataset.bytes_per_token("val")
    entropy = unigram_entropy(dataset, "train")
    line = (f"done: {result.step} steps, {result.tokens:,} tokens, {result.flops:.3e} FLOPs, "
            f"{result.elapsed:.1f} s ({result.tokens / max(result.train_time, 1e-9):,.0f} "
            f"tokens/s)")
    if final is not None:
        line += (f"; val loss {final['val_loss']:.4f} nats/token, ppl {final['val_ppl']:.2f}, "
                 f"{final['val_bpb']:.4f} bits/byte")
    print_fn(line)
    print_fn(f"unigram entropy of the corpus: {entropy:.4f} nats/token "
             f"({entropy / ln2_bpt:.4f} bits/byte); final val loss "
             + (f"{final['val_loss']:.4f} nats/token" if final else "n/a"))
    print_fn(f"model and optimizer: {result.run_dir / ckpt.FINAL}")
    if cfg.samples:
        for i, text in enumerate(sample(result.model, dataset.tokenizer, cfg)):
            print_fn(f"--- sample {i + 1} ---\n{text}")


def sample(model: nn.Module, tokenizer: Any, cfg: TrainConfig) -> list[str]:
    """``cfg.samples`` continuations of ``cfg.sample_prompt`` (seeded: reproducible)."""
    ids = tokenizer.encode(cfg.sample_prompt) or [tokenizer.eos_token_id or 0]
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    model.eval()
    prompt = torch.tensor([ids] * cfg.samples, device=device)
    out = model.generate(prompt, cfg.sample_tokens, do_sample=cfg.temperature > 0,
                         temperature=cfg.temperature or 1.0, generator=generator)
    return [tokenizer.decode(row.tolist()) for row in out]
