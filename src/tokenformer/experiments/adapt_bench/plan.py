"""What adapt-bench runs: the arms, their labels and bases, budgets, LR grids and presets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...errors import ConfigError

SCHEMA = "tokenformer-adapt-bench-v1"
ARMS = ("tok-ffn", "tok-all", "lora-ffn", "lora-tpp", "full")
LABELS = {"tok-ffn": "token adapter, FFN", "tok-all": "token adapter, all Pattentions",
          "lora-ffn": "LoRA (peft), TokenFormer FFN tokens", "lora-tpp": "LoRA (peft), "
          "Transformer++ linears", "full": "full fine-tuning"}


def tuning_key(arm: str, budget: float | None) -> str:
    """``tok-ffn@0.04``; full fine-tuning has one budget: ``full``."""
    return arm if budget is None else f"{arm}@{budget:g}"


def base_of(arm: str) -> str:
    """The base model an arm adapts: the Transformer++ for ``lora-tpp``, else the TokenFormer."""
    return "transformer++" if arm == "lora-tpp" else "tokenformer"


# ---------------------------------------------------------------------------------- presets
@dataclass
class BenchPreset:
    model: str = "small"
    seq_len: int = 128
    batch_size: int = 16
    base_steps: int = 1000
    base_lr: float = 3e-3
    steps: int = 250
    warmup: int = 20
    seeds: int = 3
    tune_seed: int = 100
    budgets: tuple[float, ...] = (0.01, 0.04, 0.16)
    # LR grid per arm; one value = no tuning. The pick is made per budget (tuning seed).
    lrs: dict[str, tuple[float, ...]] = field(default_factory=lambda: {
        "tok-ffn": (3e-3, 1e-2, 3e-2, 9e-2), "tok-all": (3e-3, 1e-2, 3e-2, 9e-2),
        "lora-ffn": (3e-3, 1e-2, 3e-2, 9e-2), "lora-tpp": (3e-3, 1e-2, 3e-2, 9e-2),
        "full": (3e-4, 1e-3, 3e-3, 9e-3)})
    arms: tuple[str, ...] = ARMS
    eval_batches: int = 8
    max_extensions: int = 2  # LR grid points added past an edge pick, per side

    def validate(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ConfigError(f"unknown adapt-bench arm {unknown[0]!r}; arms: {', '.join(ARMS)}")
        if self.seeds < 1 or not self.budgets or any(not 0 < b < 1 for b in self.budgets):
            raise ConfigError("adapt-bench needs >= 1 seed and budgets in (0, 1)")


PRESETS: dict[str, BenchPreset] = {
    # 2 bases × 1000 steps, 52+ tuning (4 LRs per arm and budget, grown past an edge pick) and
    # 39 measured adaptation runs × 250 steps.
    "full": BenchPreset(),
    # A few minutes: one seed, one budget, no tuning (LRs fixed mid-grid of the full preset).
    "quick": BenchPreset(base_steps=300, steps=80, seeds=1, budgets=(0.04,),
                         lrs={"tok-ffn": (1e-2,), "tok-all": (1e-2,), "lora-ffn": (1e-2,),
                              "lora-tpp": (1e-2,), "full": (1e-3,)}),
    # Seconds: the test suite's end-to-end run.
    "test": BenchPreset(model="tiny", seq_len=32, batch_size=4, base_steps=6, steps=3, seeds=2,
                        budgets=(0.05,), eval_batches=1, max_extensions=0,
                        lrs={"tok-ffn": (1e-2, 3e-2), "tok-all": (1e-2,), "lora-ffn": (1e-2,),
                             "lora-tpp": (1e-2,), "full": (1e-3,)}),
}


def get_preset(name: str | BenchPreset) -> BenchPreset:
    if isinstance(name, BenchPreset):
        preset = name
    elif name in PRESETS:
        preset = replace(PRESETS[name])
    else:
        raise ConfigError(f"unknown adapt-bench preset {name!r}; presets: {', '.join(PRESETS)}")
    preset.validate()
    return preset


def bench_preset(preset: str | BenchPreset, seeds: int | None = None,
                 budgets: Sequence[float] | None = None, threads: int = 0) -> BenchPreset:
    """The preset with ``seeds`` / ``budgets`` applied, checked (and ``threads``, 0 = torch's
    default): the CLI calls it before it creates the output folder."""
    p = get_preset(preset)
    if seeds is not None or budgets is not None:
        p = replace(p, seeds=p.seeds if seeds is None else seeds,
                    budgets=p.budgets if budgets is None else tuple(budgets))
        p.validate()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"threads must be an integer >= 0 (0: torch's default), got {threads}")
    return p
