"""What an ablation trains: its studies and variants, tasks, presets, LR grids, paper claims.

Two studies, each varying one config field of an otherwise fixed model and recipe:

* ``theta``: the nonlinearity × normalisation inside Θ (``norm``): exp + L1 (``softmax``, the
  official "softmax" = softmax × n), GELU + L1 (``gelu_l1_norm``), the paper's GELU + L2
  (``l2_norm_gelu``: L2-normalise, then GELU, the released default) and ``gelu_l2_norm``
  (GELU, then L2-normalise; in the released code, not in the paper's table).
* ``norm``: learnable weight and/or bias in the block LayerNorms (``block_norm``): none (the
  official non-parametric norm), bias only, weight only, both.

Pure data and checks: nothing here trains (that is :mod:`.run`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ...models.config import BLOCK_NORMS
from ...nn.pattention import THETA_VARIANTS
from ...training.config import TrainConfig
from ...training.vision import DIGITS_TRAIN

SCHEMA = "tokenformer-ablate/1"  # of the results.json that run writes and report reads
TUNING_SEED = 100  # the LR sweeps' seed: never one of the reported seeds (see tuning_seed)
# Paper claims "a better than b" only above this gap (ImageNet top-1 points); below it the
# paper's numbers are read as a tie.
PAPER_TIE = 0.15


# ---------------------------------------------------------------------------------- studies
@dataclass(frozen=True)
class Study:
    """One ablation: the config field it varies, its variants and the paper's numbers."""

    name: str
    key: str  # field of TokenFormerConfig and TokenFormerViTConfig the variants set
    variants: tuple[str, ...]  # in display order
    reference: str  # the official default: every variant is compared with it
    labels: dict[str, str]
    paper: dict[str, float]  # ImageNet top-1 (%) of the paper's base model; absent: not ablated
    title: str


STUDIES: dict[str, Study] = {
    "theta": Study(
        "theta", "norm", ("softmax", "gelu_l1_norm", "l2_norm_gelu", "gelu_l2_norm"),
        "l2_norm_gelu",
        {"softmax": "exp + L1 (softmax × n)", "gelu_l1_norm": "GELU + L1",
         "l2_norm_gelu": "GELU + L2 (L2 norm, then GELU; default)",
         "gelu_l2_norm": "GELU, then L2 norm"},
        {"softmax": 79.6, "gelu_l1_norm": 81.7, "l2_norm_gelu": 82.5},
        "Θ: nonlinearity × normalisation"),
    "norm": Study(
        "norm", "block_norm", ("none", "bias", "weight", "both"), "none",
        {"none": "neither (non-parametric; default)", "bias": "bias only",
         "weight": "weight only", "both": "weight + bias"},
        {"none": 82.5, "bias": 82.5, "both": 82.6},
        "block LayerNorm: learnable weight / bias"),
}
# The studies cover exactly the options the model offers (but the frontier's plain-GELU control,
# which is no Θ of the paper: an MLP).
assert set(STUDIES["theta"].variants) == set(THETA_VARIANTS) - {"gelu"}
assert set(STUDIES["norm"].variants) == set(BLOCK_NORMS)


@dataclass(frozen=True)
class Task:
    metric: str  # the Point column compared: "bpb" or "accuracy"
    label: str
    lower_is_better: bool
    percent: bool  # shown ×100 with a % sign

    def fmt(self, value: float | None, digits: int = 4) -> str:
        """The metric as shown in logs and reports (a fraction as a percentage)."""
        if value is None or math.isnan(value):
            return "—"
        if self.percent and math.isfinite(value):
            return f"{100 * value:.2f} %"
        return f"{value:.{digits}f}"


TASKS: dict[str, Task] = {
    "lm": Task("bpb", "validation bits per byte", True, False),
    "vision": Task("accuracy", "test top-1 accuracy", False, True),
}


# ---------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class AblationPreset:
    """The fixed model and recipe every variant trains with (per task)."""

    name: str
    base: str  # model preset: TokenFormerConfig's (lm) or TokenFormerViTConfig's (vision)
    model: dict[str, Any] = field(default_factory=dict)  # config overrides on ``base``
    steps: int = 300
    batch_size: int = 16
    eval_every: int = 50
    seeds: int = 3
    lr: float | None = None  # None: the task's default recipe; the sweep grid's centre
    warmup_steps: int | None = None
    tune: bool = True  # sweep the LR per variant; False: every variant trains at ``lr``
    sweep_points: int = 5  # factor-2 log grid centred on ``lr``: lr × 2^k, k = -2..2
    max_extensions: int = 2  # per side, when the argmin sits on an edge of the grid
    seq_len: int = 128  # lm only
    eval_batches: int = 8  # lm only
    # The documented runs (docs/ablations.md) predate the C++ kernel as the default: pinned to
    # the pure-PyTorch paths they ran with, so they reproduce bit for bit (pattention.py).
    pattention_impl: str = "torch"

    def validate(self) -> None:
        for key in ("steps", "batch_size", "seeds", "seq_len", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"ablate: {key} must be >= 1, got {getattr(self, key)}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"ablate: lr must be a positive number, got {self.lr}")
        if self.tune and self.sweep_points < 2:
            raise ConfigError(f"ablate: sweep_points must be >= 2, got {self.sweep_points}")
        if self.max_extensions < 0:
            raise ConfigError(f"ablate: max_extensions must be >= 0, got {self.max_extensions}")
        if self.eval_every < 0:
            raise ConfigError(f"ablate: eval_every must be >= 0, got {self.eval_every}")


# Sized on a 2-core CPU (docs/ablations.md): "full" is 4 variants × (5-point LR sweep + 5
# seeds) × 400 steps per (study, task); "quick" is the same sweep and 2 seeds at 120 steps. The
# grids are centred on the LRs of the fixed-LR runs before the sweeps (LM 2e-3, vision 3e-3).
_LM = dict(base="tiny", lr=2e-3, warmup_steps=20, seq_len=128, batch_size=16)
_VISION = dict(base="vit-digits-tiny", lr=3e-3, batch_size=64)
PRESETS: dict[str, dict[str, AblationPreset]] = {
    "lm": {"quick": AblationPreset("quick", steps=120, eval_every=40, seeds=2, eval_batches=4,
                                   **_LM),
           "full": AblationPreset("full", steps=400, eval_every=50, seeds=5, **_LM)},
    "vision": {"quick": AblationPreset("quick", steps=120, eval_every=40, seeds=2, **_VISION),
               "full": AblationPreset("full", steps=400, eval_every=50, seeds=5, **_VISION)},
}


def get_preset(task: str, name: str, **overrides: Any) -> AblationPreset:
    check_task(task)
    if name not in PRESETS[task]:
        raise ConfigError(f"unknown ablate preset {name!r}; choose one of "
                          f"{', '.join(PRESETS[task])}")
    preset = dataclasses.replace(PRESETS[task][name], **overrides)
    preset.validate()
    return preset


def base_lr(task: str, preset: AblationPreset) -> float:
    """The preset's LR, else the task's default recipe's: the fixed LR, or the sweep's centre."""
    if preset.lr is not None:
        return preset.lr
    if task == "lm":
        return TrainConfig.lr
    return float(DIGITS_TRAIN["lr"])


def lr_grid(centre: float, points: int) -> list[float]:
    """``points`` LRs a factor 2 apart, centred (geometrically) on ``centre``: for 5 points
    centre × 1/4, 1/2, 1, 2, 4; for 4 points centre × 2^±0.5, 2^±1.5."""
    return [centre * 2.0 ** (k - (points - 1) / 2) for k in range(points)]


def tuning_seed(seeds: Sequence[int]) -> int:
    """The LR sweeps' seed: :data:`TUNING_SEED`, or the first seed after the reported ones when
    they reach it, so the LR is never chosen on a seed that is then reported."""
    return TUNING_SEED if TUNING_SEED not in seeds else max(seeds) + 1


def check_task(task: str) -> Task:
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return TASKS[task]


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; choose one of {', '.join(STUDIES)}")
    return STUDIES[name]


def select_variants(study: Study, variants: Sequence[str] | str | None) -> list[str]:
    """The variants to run, in the study's display order; names are checked."""
    if variants is None:
        return list(study.variants)
    if isinstance(variants, str):
        variants = [v.strip() for v in variants.split(",") if v.strip()]
    if not variants:
        raise ConfigError(f"--variants names no variant; choose from {', '.join(study.variants)}")
    unknown = [v for v in variants if v not in study.variants]
    if unknown:
        raise ConfigError(f"unknown {study.name} variant {unknown[0]!r} (study {study.name} "
                          f"varies {study.key}); choose from {', '.join(study.variants)}")
    if len(set(variants)) != len(variants):
        raise ConfigError(f"--variants names a variant twice: {', '.join(variants)}")
    return [v for v in study.variants if v in variants]


def paper_claims(study: Study) -> list[tuple[str, str, str]]:
    """The paper's pairwise statements as (a, b, "better" | "tie"): a above b by more than
    PAPER_TIE points, or within it of b."""
    out = []
    names = [v for v in study.variants if v in study.paper]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            gap = study.paper[a] - study.paper[b]
            if abs(gap) <= PAPER_TIE:
                out.append((a, b, "tie"))
            else:
                out.append((a, b, "better") if gap > 0 else (b, a, "better"))
    return out
