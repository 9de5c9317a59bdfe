"""The training config: every setting of a run, read from YAML and ``--key value`` overrides, each
value coerced to its field's type and validated before anything is written.

Weight decay follows the official GPT-NeoX code (``get_params_for_weight_decay_optimization``):
every parameter except those of norm layers and biases is decayed; parameter tokens (keys and
values) and the embedding *are* decayed (:mod:`.optim`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..errors import ConfigError
from ..io.paths import regular_file
from ..io.process_group import STRATEGIES
from ..models.baselines import ARCHS, TransformerConfig
from ..models.config import NON_NEGATIVE, SEED, FieldRule, TokenFormerConfig, check_fields
from ..nn.pattention import PATTENTION_IMPLS
from .growth_events import GrowthEvent, check_steps, parse_grow_at, run_options
from .schedule import SCHEDULES, LrSchedule

DEVICE_TYPES = ("cpu", "cuda", "mps")


def parse_device(spec: str) -> torch.device:
    """``spec`` as a torch device of a type this package runs on (:data:`DEVICE_TYPES`), else one
    ConfigError line (torch's own error lists every device type it knows). Whether CUDA is there
    is :func:`.execution.resolve_device`'s question."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ConfigError(f"unknown device {spec!r} (use cpu, cuda, cuda:N or mps)")
    return device


CONFIGS_DIR = Path(__file__).parent / "configs"
RUN_CONFIG = "config.json"  # the run folder's copy of its TrainConfig
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")  # torch.compile's
# Ranges TrainConfig.validate checks with config.check_fields, beside every field's type. AdamW
# would refuse betas outside [0, 1) and a negative eps itself, but only once the run folder exists.
TRAIN_RULES = {**dict.fromkeys(("beta1", "beta2"), FieldRule("{a} in [0, 1)",
                                                             lambda value: 0 <= value < 1)),
               "eps": NON_NEGATIVE, "seed": SEED}


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
    grow_at: list[GrowthEvent] = field(default_factory=list)
    """growth inside the run: STEP:qkv=..,proj=..,ffn=..,layers=..,recipe=..,lr=.. (--grow-at,
    docs/training.md); each spec is parsed once into its GrowthEvent, which code may also give"""
    growth_lr: str = "continue"
    """continue: one schedule over the run; restart: warmup + decay per stage"""
    growth_optimizer: str = "carry"
    """AdamW moments at a growth: carry (new rows zero), carry-mean (new rows' second moments at
    the old rows' mean, grow.grow_with_optimizer) or reset"""
    growth_freeze_old: str = "0"
    """every growth's freeze_old unless its --grow-at sets one: the old parameter tokens get no
    update for this many steps, or forever (0: they train)"""
    growth_noise_old: float = 0.0
    """every growth's noise_old unless its --grow-at sets one: noise added to the old parameter
    tokens, a std relative to each tensor's rms (0: none)"""
    anneal_steps: int = 0
    """after each exact growth (--grow-at ...recipe=exact), Θ's factor moves linearly from the
    value that kept the grown model exact to √n over this many steps (the paper's Θ-factor
    anneal; 0: off)"""
    # execution
    device: str = "auto"
    """auto, cpu, cuda or cuda:N"""
    precision: str = "fp32"
    """fp32, or bf16 (autocast)"""
    compile: bool = False
    """torch.compile the model"""
    compile_mode: str = "default"
    """torch.compile's mode with compile: default (inductor), reduce-overhead (inductor, the
    forward and backward replayed as CUDA graphs: a few launches instead of hundreds, for small
    models on a GPU) or max-autotune-no-cudagraphs"""
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
        if isinstance(self.grow_at, (list, tuple)):  # each spec parsed once, into its event
            self.grow_at = [e if isinstance(e, GrowthEvent) else parse_grow_at(e)
                            for e in self.grow_at]
        self.validate()

    def validate(self) -> None:
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
        choice("compile_mode", COMPILE_MODES)
        choice("strategy", STRATEGIES)
        for key in ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches",
                    "sample_tokens", "keep_last"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_interval", "checkpoint_interval", "threads", "seed",
                    "samples", "weight_decay", "grad_clip", "min_lr", "temperature",
                    "anneal_steps"):
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
        # a malformed --grow-at fails here (each spec parsed at construction), before anything
        # is written; the plan as a whole (freezes, the anneal) where it runs:
        # training.growth.growth_plan, at the start of fit and train
        run_options(self.growth_freeze_old, self.growth_noise_old)
        check_steps(self.grow_at, self.steps, self.min_lr)

    def lr_schedule(self) -> LrSchedule:
        """The run's learning-rate schedule (:func:`.schedule.lr_at`): the peak ``lr``, its
        warmup and shape, and what each growth does to it."""
        return LrSchedule(self.lr, self.min_lr, self.steps, self.warmup_steps, self.schedule,
                          self.decay_fraction, tuple(e.lr_stage for e in self.grow_at),
                          restart_all=self.growth_lr == "restart")

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON holds it (the run folder's ``config.json``, a checkpoint's
        trainer state): each growth as its ``--grow-at`` spec."""
        data = dataclasses.asdict(self)
        data["grow_at"] = [e.spec for e in self.grow_at]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a training config must be a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(data) - set(hints))
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; known keys: "
                              f"{', '.join(hints)}")
        values = {k: coerce(v, hints[k], k) for k, v in data.items()}
        for key in ("model", "baseline"):
            if key in values:
                values[key] = coerce_nested(values[key], key)
        return cls(**values)


def coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` (from YAML or a command-line string) as the type ``hint`` names; ``key`` names it
    in the error."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        # each type in order: "3" is the count 3 of ``int | float``, "0.9" the fraction 0.9
        kinds = [a for a in args if a is not type(None)]
        for kind in kinds[:-1]:
            try:
                return coerce(value, kind, key)
            except ConfigError:
                continue
        try:
            return coerce(value, kinds[-1], key)
        except ConfigError:
            if len(kinds) == 1:
                raise
            names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
            allowed = " or ".join(names.get(k, getattr(k, "__name__", str(k))) for k in kinds)
            raise ConfigError(f"{key} must be {allowed} (or null), got {value!r}") from None
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, list):
            value = [value]
        return [coerce(v, args[0] if args else str, key) for v in value]
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


def coerce_nested(values: dict[str, Any], key: str) -> dict[str, Any]:
    """``model`` (a TokenFormer config plus ``preset``) or ``baseline`` overrides, each value as its
    field's type."""
    cls = TokenFormerConfig if key == "model" else TransformerConfig
    hints = typing.get_type_hints(cls)
    if key == "model":
        hints["preset"] = str
    out = {}
    for name, value in values.items():
        if name not in hints:
            raise ConfigError(f"unknown {key} key {name!r}; known keys: {', '.join(hints)}")
        out[name] = coerce(value, hints[name], f"{key}.{name}")
    return out


def config_path(spec: str | Path) -> Path:
    """A YAML file path, or the bare name of a config shipped with the package (``demo``)."""
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
                overrides: dict[str, Any] | None = None, *, recorded: bool = False
                ) -> TrainConfig:
    """Load a YAML config (a path or shipped name; ``None`` = defaults) and apply ``overrides``:
    ``{"lr": "3e-4", "model.ffn_tokens": 512}`` (dotted keys reach into ``model`` / ``baseline``;
    string values are parsed as the field's type). ``recorded``: the file is a run's record (its
    ``config.json``), whose ``--grow-at`` specs are read without the deprecation warning of an
    old spelling (:func:`.growth_events.parse_grow_at`)."""
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
    if recorded and isinstance(data.get("grow_at"), list):
        data["grow_at"] = [parse_grow_at(g, recorded=True) if isinstance(g, str) else g
                           for g in data["grow_at"]]
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
