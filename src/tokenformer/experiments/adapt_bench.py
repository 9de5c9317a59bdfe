"""``tokenformer adapt-bench``: token adapters vs LoRA vs full fine-tuning on a new domain.

A TokenFormer (and a Transformer++ of matched size, same data, steps and schedule) is pretrained
on the embedded King James Bible; each arm then adapts it to a second embedded corpus, the Python
source of the pinned ``Jinja2`` package (:func:`code_text`), for the same number of steps:

==============  ===================================================================================
``tok-ffn``     parameter-token adapter on the FFN Pattentions (:func:`tokenformer.adapt`)
``tok-all``     the same on every Pattention (Q, K, V, output projection, FFN)
``lora-ffn``    LoRA from ``peft`` on the same FFN Pattention parameters (``target_parameters``)
``lora-tpp``    LoRA from ``peft`` on every linear of the Transformer++ base
``full``        full fine-tuning of the TokenFormer (every parameter; one budget: 100 %)
==============  ===================================================================================

Adapter arms are sized to trainable-parameter *budgets* (fractions of the TokenFormer base's
parameters): each picks the token count / rank whose count is nearest. The LR of each arm is
picked per budget on a grid, on a tuning seed not used for the reported runs (an LR tuned at one
budget handicaps LoRA at another: its update grows with the rank). Reported:
new-domain (code) validation loss, old-domain (KJV) validation loss with the adapter on
(forgetting) and, for token adapters, off (must equal the base's exactly), trainable parameters,
step time and the adapter file's size; paired t-tests over seeds with t-based 95 % intervals.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, DataError, TokenFormerError
from . import stats
from .common import damaged, is_mapping_of, markdown_table, read_saved_json, to_json

SCHEMA = "tokenformer-adapt-bench-v1"
CODE_PACKAGE, CODE_VERSION = "Jinja2", "3.1.6"
CODE_SOURCE = f"{CODE_PACKAGE}=={CODE_VERSION}:jinja2/*.py"
ARMS = ("tok-ffn", "tok-all", "lora-ffn", "lora-tpp", "full")
# What every run of .partial.json holds (run_one's row and its budget): a rerun reads them all.
RUN_KEYS = frozenset({"arm", "size", "lr", "seed", "trainable", "base_parameters", "step_ms",
                      "new_loss", "old_loss", "file_bytes", "budget"})
LABELS = {"tok-ffn": "token adapter, FFN", "tok-all": "token adapter, all Pattentions",
          "lora-ffn": "LoRA (peft), TokenFormer FFN tokens", "lora-tpp": "LoRA (peft), "
          "Transformer++ linears", "full": "full fine-tuning"}


# --------------------------------------------------------------------------- the code corpus
@functools.lru_cache(maxsize=1)
def code_text() -> str:
    """The Python source of the pinned Jinja2 package (a dependency of torch, so present
    wherever torch is), files in sorted order, each headed by ``# file: jinja2/NAME``."""
    import importlib.metadata

    try:
        import jinja2
    except ImportError:
        raise DataError(f"the code corpus needs {CODE_PACKAGE}=={CODE_VERSION} "
                        f"(pip install 'tokenformer[adapt]')") from None
    version = importlib.metadata.version(CODE_PACKAGE)
    if version != CODE_VERSION:
        raise DataError(f"the code corpus is pinned to {CODE_PACKAGE}=={CODE_VERSION}, found "
                        f"{version}: pip install {CODE_PACKAGE}=={CODE_VERSION}")
    root = Path(jinja2.__file__).parent
    parts = [f"# file: jinja2/{p.relative_to(root).as_posix()}\n{p.read_text('utf-8')}"
             for p in sorted(root.rglob("*.py"))]
    return "\n".join(parts)


def code_dataset(cache_dir: str | Path | None = None, progress: bool | None = True) -> Any:
    """The code corpus byte-tokenized (the KJV base's tokenizer), last 10 % held out, cached
    beside the embedded corpus."""
    from .. import data

    root = Path(cache_dir) if cache_dir is not None else data.default_cache_dir()
    path = root / f"code-{CODE_PACKAGE.lower()}-{CODE_VERSION}-bytes"
    root.mkdir(parents=True, exist_ok=True)
    with data._file_lock(root / ".code.lock"):
        if (path / data.META_FILE).is_file():
            with contextlib.suppress(DataError):
                dataset = data.TokenDataset.open(path)
                if dataset.meta.get("sources") == [CODE_SOURCE]:
                    return dataset
        text = code_text()
        doc = data.Document(CODE_SOURCE, len(text.encode("utf-8")), lambda: text)
        return data.prepare_documents([doc], "bytes", path, val_fraction=0.1, progress=progress,
                                      overwrite=True, sources=[CODE_SOURCE])


def tuning_key(arm: str, budget: float | None) -> str:
    """``tok-ffn@0.04``; full fine-tuning has one budget: ``full``."""
    return arm if budget is None else f"{arm}@{budget:g}"


def tune_lr(grid: list[float], max_extensions: int, loss_of: Any) -> dict[str, Any]:
    """The argmin of ``loss_of(lr)`` over ``grid``, extended past an edge pick by the shared
    rule (:func:`..common.sweep_lr`, as the frontier and the ablations); one value: no tuning."""
    from .common import sweep_lr

    if len(grid) < 2:
        return {"lr": grid[0], "grid": grid, "losses": {}, "added": [], "edge": False}
    sweep = sweep_lr(grid, loss_of, max_extensions=max_extensions)
    return {"lr": sweep.chosen, "grid": sweep.grid, "losses": sweep.values,
            "added": sweep.added, "edge": sweep.at_edge}


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


# ------------------------------------------------------------------------------------- arms
def _train_cfg(preset: BenchPreset, lr: float, steps: int, seed: int) -> Any:
    from ..train import TrainConfig

    return TrainConfig(seq_len=preset.seq_len, batch_size=preset.batch_size, steps=steps,
                       lr=lr, min_lr=lr / 10, warmup_steps=min(preset.warmup, steps // 4),
                       weight_decay=0.0, eval_interval=0, seed=seed, samples=0)


def _fit(model: nn.Module, dataset: Any, cfg: Any, progress: bool | None) -> Any:
    from ..train import fit, lm_batches

    return fit(model, lm_batches(dataset, cfg.batch_size, cfg.seq_len, cfg.seed), cfg,
               progress=progress)


@torch.no_grad()
def _val_loss(model: nn.Module, dataset: Any, preset: BenchPreset) -> float:
    from ..train import lm_evaluator

    was = model.training
    model.eval()
    loss = lm_evaluator(dataset, preset.seq_len, preset.batch_size, preset.eval_batches,
                        torch.device("cpu"))(model)["val_loss"]
    model.train(was)
    return loss


def _bases(preset: BenchPreset, kjv: Any, progress: bool | None, cache: Path,
           times: dict[str, float]) -> dict[str, nn.Module]:
    """TokenFormer and matched Transformer++ pretrained on KJV: same data, steps, schedule, LR
    (``times`` receives each one's training seconds). Kept in ``cache`` (a directory per
    pretraining setting) so that a rerun, e.g. with more seeds, reuses them."""
    from ..baselines import TransformerLM, matched_config
    from ..config import TokenFormerConfig
    from ..io import atomic_write_text
    from ..model import TokenFormerLM
    from .common import fingerprint

    config = TokenFormerConfig.from_name(preset.model, max_seq_len=preset.seq_len)
    setting = {k: getattr(preset, k) for k in ("model", "seq_len", "batch_size", "base_steps",
                                               "base_lr", "warmup")}
    cache = cache / fingerprint(setting)
    bases = {}
    for name, cls, build in (
            ("tokenformer", TokenFormerLM, lambda: TokenFormerLM(config)),
            ("transformer++", TransformerLM,
             lambda: TransformerLM(matched_config(config, "transformer++")))):
        stored = cache / name
        if (stored / "train_time.json").is_file():
            redo = f"delete {stored} to pretrain that base again"
            try:
                bases[name] = cls.load(stored).eval()
            except TokenFormerError as exc:
                raise damaged(stored, str(exc), redo) from None
            times[name] = read_saved_json(stored / "train_time.json", lambda d: isinstance(
                d, dict) and isinstance(d.get("seconds"), (int, float)), redo)["seconds"]
            continue
        torch.manual_seed(0)
        model = build()
        cfg = _train_cfg(preset, preset.base_lr, preset.base_steps, 0)
        cfg.weight_decay = 0.1
        times[name] = _fit(model, kjv, cfg, progress).train_time
        model.save(stored)
        atomic_write_text(stored / "train_time.json", json.dumps({"seconds": times[name]}))
        bases[name] = model.eval()
    return bases


def _lora_targets(arm: str) -> dict[str, Any]:
    if arm == "lora-ffn":  # the FFN Pattention's key and value tokens, as tok-ffn adapts
        return {"target_modules": [], "target_parameters": ["mlp.key_param_tokens",
                                                            "mlp.value_param_tokens"]}
    return {"target_modules": ["query", "key", "value", "proj", "up", "gate", "down"]}


def _lora(model: nn.Module, arm: str, rank: int) -> nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    for p in model.parameters():
        p.requires_grad_(False)
    # lora_alpha = r: scaling 1 at every rank (the budget changes r, not the step size)
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, **_lora_targets(arm))
    return inject_adapter_in_model(config, model)


def _per_unit(arm: str, bases: dict[str, nn.Module]) -> int:
    """Trainable parameters per token (token arms) or per rank (LoRA arms)."""
    tf = bases["tokenformer"].config
    d, L = tf.hidden_size, tf.num_layers
    if arm == "tok-ffn":
        return 2 * d * L
    if arm == "tok-all":
        return 5 * 2 * d * L
    if arm == "lora-ffn":
        return 2 * L * (tf.ffn_tokens + d)
    linears = [m for m in bases["transformer++"].modules() if isinstance(m, nn.Linear)]
    return sum(m.in_features + m.out_features for m in linears)


def knob(arm: str, budget: float, bases: dict[str, nn.Module]) -> int:
    """Tokens per Pattention or LoRA rank nearest to ``budget`` × the TokenFormer's size."""
    target = budget * bases["tokenformer"].num_parameters()
    return max(1, round(target / _per_unit(arm, bases)))


def _file_size(tensors: dict[str, torch.Tensor]) -> int:
    from ..io import save_safetensors

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_safetensors({k: v.detach().contiguous() for k, v in tensors.items()}, path)
        return path.stat().st_size


def run_one(arm: str, size: int, lr: float, seed: int, preset: BenchPreset,
            bases: dict[str, nn.Module], data: dict[str, Any], base_kjv: dict[str, float],
            progress: bool | None = None) -> dict[str, Any]:
    """Adapt a copy of the base with ``arm`` (``size`` tokens / rank; ignored by ``full``) and
    measure it."""
    from .. import adapters as ad

    base = bases[_base_of(arm)]
    model = copy.deepcopy(base).train()
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if arm == "tok-ffn":
        ad.adapt(model, ffn=size, name="code", generator=generator)
    elif arm == "tok-all":
        ad.adapt(model, qkv=size, proj=size, ffn=size, name="code", generator=generator)
    elif arm.startswith("lora"):
        model = _lora(model, arm, size)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    result = _fit(model, data["code"], _train_cfg(preset, lr, preset.steps, seed), progress)
    row = {"arm": arm, "size": size, "lr": lr, "seed": seed,
           "trainable": sum(p.numel() for p in trainable.values()),
           "base_parameters": base.num_parameters(),
           "step_ms": 1000 * result.train_time / max(preset.steps, 1),
           "new_loss": _val_loss(model, data["code"], preset),
           "old_loss": _val_loss(model, data["kjv"], preset),
           "file_bytes": _file_size(trainable)}
    if arm.startswith("tok"):
        with ad.adapters_active(model, []):
            row["old_loss_off"] = _val_loss(model, data["kjv"], preset)
        row["off_equals_base"] = row["old_loss_off"] == base_kjv["tokenformer"]
        frozen = all(torch.equal(p, q) for (n, p), q in zip(
            ((n, p) for n, p in model.named_parameters() if ".adapters." not in n),
            base.parameters(), strict=True))
        row["base_unchanged"] = frozen
    return row


# ------------------------------------------------------------------------------- statistics
def t_interval(values: Sequence[float]) -> dict[str, float]:
    """Mean, t-based 95 % half-width and p-value against 0, in this report's ``results.json``
    shape (:func:`.stats.t_interval`: the experiments' one rule)."""
    return _as_dict(stats.t_interval(values))


def _as_dict(ci: stats.Interval) -> dict[str, float]:
    return {"mean": ci.mean, "half": ci.mean - ci.low, "p": ci.p_value, "n": ci.n}


def _runs(results: dict[str, Any], arm: str, budget: float | None) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["arm"] == arm and r.get("budget") == budget]


def _base_of(arm: str) -> str:
    return "transformer++" if arm == "lora-tpp" else "tokenformer"


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per (arm, budget): interval of each metric; per budget: paired comparisons.

    ``forgetting`` is the old-domain loss after adapting minus the arm's own base's (the
    Transformer++ base starts from another KJV loss than the TokenFormer's)."""
    for r in results["runs"]:
        r["forgetting"] = r["old_loss"] - results["base_loss"][_base_of(r["arm"])]["kjv"]
    cells = []
    for arm in results["preset"]["arms"]:
        for budget in ([None] if arm == "full" else results["preset"]["budgets"]):
            runs = _runs(results, arm, budget)
            if not runs:
                continue
            cell = {"arm": arm, "budget": budget, "size": runs[0]["size"], "lr": runs[0]["lr"],
                    "trainable": runs[0]["trainable"], "share": runs[0]["trainable"]
                    / results["base_parameters"]["tokenformer"], "seeds": len(runs)}
            for key in ("new_loss", "old_loss", "forgetting", "old_loss_off", "step_ms",
                        "file_bytes"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    cell[key] = t_interval(vals)
            if arm.startswith("tok"):
                cell["off_exact"] = all(r["off_equals_base"] for r in runs)
                cell["base_unchanged"] = all(r["base_unchanged"] for r in runs)
            cells.append(cell)
    comparisons = []
    pairs = [("tok-ffn", "lora-ffn"), ("tok-all", "lora-ffn"), ("tok-ffn", "lora-tpp"),
             ("tok-all", "lora-tpp"), ("tok-ffn", "tok-all"), ("lora-ffn", "lora-tpp")]
    for budget in results["preset"]["budgets"]:
        for a, b in pairs:
            ra = {r["seed"]: r for r in _runs(results, a, budget)}
            rb = {r["seed"]: r for r in _runs(results, b, budget)}
            seeds = sorted(set(ra) & set(rb))
            if not seeds:
                continue
            for metric in ("new_loss", "forgetting"):
                ci = stats.t_interval([ra[s][metric] - rb[s][metric] for s in seeds])
                comparisons.append({"a": a, "b": b, "budget": budget, "metric": metric,
                                    **_as_dict(ci), "resolved": ci.excludes_zero})
    return {"cells": cells, "comparisons": comparisons}


# ----------------------------------------------------------------------------------- report
def _pm(entry: dict[str, float] | None, digits: int = 4) -> str:
    if not entry:
        return "—"
    if math.isnan(entry["half"]):
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {entry['half']:.{digits}f}"


def verdict(results: dict[str, Any]) -> list[str]:
    lines = []
    seeds = results["preset"]["seeds"]
    for c in results["summary"]["comparisons"]:
        what = (f"{c['a']} − {c['b']} at budget {c['budget']:.1%}: "
                f"{c['metric'].replace('_', '-').replace('new-loss', 'new-domain loss')} "
                f"{c['mean']:+.4f}")
        if c["n"] < 2:
            lines.append(f"{what} (one seed: not resolved)")
            continue
        better = c["a"] if c["mean"] < 0 else c["b"]
        status = f"{better} better" if c["resolved"] else "not resolved"
        lines.append(f"{what} ± {c['half']:.4f} (95 % CI, {c['n']} seeds, p = {c['p']:.3g}): "
                     f"{status}")
    exact = [c for c in results["summary"]["cells"] if "off_exact" in c]
    if exact:
        ok = all(c["off_exact"] and c["base_unchanged"] for c in exact)
        lines.append("token adapters switched off: old-domain loss equal to the base's "
                     + ("exactly, and the base tensors bitwise unchanged, in every run" if ok
                        else "NOT in every run (see the table)"))
    if seeds < 3:
        lines.append(f"{seeds} seed(s): a smoke run, not evidence (the full preset runs 3)")
    return lines


def report_markdown(results: dict[str, Any], plots: Sequence[str]) -> str:
    s, p = results["summary"], results["preset"]
    header = ["arm", "budget", "size", "trainable (% base)", "LR", "new-domain loss",
              "old-domain loss (on)", "forgetting", "old (off)", "off = base", "step ms",
              "file KB"]
    rows = []
    for c in s["cells"]:
        rows.append([LABELS[c["arm"]], "—" if c["budget"] is None else f"{c['budget']:.1%}",
                     c["size"] if c["arm"] != "full" else "all",
                     f"{c['trainable']:,} ({c['share']:.2%})", f"{c['lr']:g}",
                     _pm(c.get("new_loss")), _pm(c.get("old_loss")), _pm(c.get("forgetting")),
                     _pm(c.get("old_loss_off")),
                     {True: "exact", False: "NO"}.get(c.get("off_exact"), "—"),
                     f"{c['step_ms']['mean']:.0f}", f"{c['file_bytes']['mean'] / 1024:.1f}"])
    base = results["base_loss"]
    lines = [
        f"# adapt-bench ({results['preset_name']})", "",
        f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
        f"Wall-clock of this invocation: {results['elapsed_s'] / 60:.1f} min (runs and bases "
        f"reused from an earlier invocation in the same directory are not re-timed)", "",
        f"Bases pretrained on KJV ({p['base_steps']} steps × {p['batch_size']} × "
        f"{p['seq_len']} bytes): TokenFormer `{p['model']}` "
        f"({results['base_parameters']['tokenformer']:,} parameters) KJV val loss "
        f"{base['tokenformer']['kjv']:.4f}, code val loss {base['tokenformer']['code']:.4f}; "
        f"Transformer++ ({results['base_parameters']['transformer++']:,}) KJV "
        f"{base['transformer++']['kjv']:.4f}, code {base['transformer++']['code']:.4f}. "
        + (f"Pretraining took {results['base_train_s']['tokenformer']:.0f} s / "
           f"{results['base_train_s']['transformer++']:.0f} s. " if results.get("base_train_s")
           else "")
        + f"Adaptation: {p['steps']} steps on the code corpus ({CODE_SOURCE}), {p['seeds']} "
        f"seed(s); losses in nats/byte, ± = t-based 95 % interval over seeds.", "",
        markdown_table(header, rows), "",
        "LR picks (per arm and budget, tuning seed "
        f"{p['tune_seed']}): " + "; ".join(
            (f"{a}: {v['lr']:g} of {v['grid']}"
             + (f" (grid extended by {', '.join(f'{x:g}' for x in v['added'])})"
                if v.get("added") else "")
             + (" (**still at the grid's edge**)" if v["edge"] else "")
             if len(v["grid"]) > 1 else f"{a}: {v['lr']:g} (fixed, not tuned)")
            for a, v in results["tuning"].items()), "",
        "## Verdict", "", *[f"- {v}" for v in results["verdict_lines"]], "",
        *[f"![{name}]({name})" for name in plots], ""]
    return "\n".join(lines)


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    from .common import have_matplotlib

    if not have_matplotlib():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in results["preset"]["arms"]:
        cells = [c for c in results["summary"]["cells"] if c["arm"] == arm]
        if not cells:
            continue
        xs = [c["trainable"] for c in cells]
        for ax, key in zip(axes, ("new_loss", "forgetting"), strict=True):
            ys = [c[key]["mean"] for c in cells]
            err = [0 if math.isnan(c[key]["half"]) else c[key]["half"] for c in cells]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=LABELS[arm])
    from matplotlib.ticker import NullFormatter

    axes[0].set_title("new domain (code): val loss vs trainable parameters")
    axes[1].set_title("forgetting: KJV val loss after adapting − own base's")
    axes[1].axhline(0.0, color="grey", ls="--", lw=1, label="base (token adapters off)")
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("trainable parameters")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss (nats/byte)")
    axes[1].set_ylabel("Δ val loss (nats/byte)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    name = "pareto.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return [name]


# ----------------------------------------------------------------------------------- runner
def run_adapt_bench(preset: str | BenchPreset = "quick", *, out: str | Path,
                    seeds: int | None = None, budgets: Sequence[float] | None = None,
                    progress: bool | None = None, threads: int = 0,
                    command: str | None = None,
                    print_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the experiment; write ``report.md``, ``results.json``, ``pareto.png`` into ``out``.

    Finished runs are kept in ``out/.partial.json`` and reused by a rerun of the same settings.
    """
    from ..io import atomic_write_text
    from .common import fingerprint, machine_summary

    name = preset if isinstance(preset, str) else "custom"
    p = get_preset(preset)
    if seeds is not None or budgets is not None:
        p = replace(p, seeds=p.seeds if seeds is None else seeds,
                    budgets=p.budgets if budgets is None else tuple(budgets))
        p.validate()
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Every run is keyed by (arm, budget, LR, seed): those lists are not part of the setting,
    # so a rerun with more seeds, budgets, LRs or arms reuses the runs already done
    # (read before the bases are pretrained: a damaged file fails at once).
    settings = {"schema": SCHEMA, "preset": {k: v for k, v in asdict(p).items()
                                             if k not in ("seeds", "budgets", "lrs", "arms")}}
    partial_file = out / ".partial.json"
    done: dict[str, dict[str, Any]] = {}
    if partial_file.is_file():
        saved = read_saved_json(partial_file, lambda d: is_mapping_of(d, "runs") and all(
            RUN_KEYS <= r.keys() for r in d["runs"].values()))
        if saved.get("fingerprint") == fingerprint(settings):
            done = saved["runs"]
    start = time.perf_counter()
    data = {"kjv": _default_kjv(progress), "code": code_dataset(progress=progress)}
    base_train_s: dict[str, float] = {}
    bases = _bases(p, data["kjv"], progress, out / ".bases", base_train_s)
    base_loss = {k: {d: _val_loss(m, data[d], p) for d in ("kjv", "code")}
                 for k, m in bases.items()}
    base_kjv = {k: v["kjv"] for k, v in base_loss.items()}

    def run(arm: str, budget: float | None, lr: float, seed: int) -> dict[str, Any]:
        key = f"{arm}|{budget}|{lr}|{seed}"
        if key not in done:
            size = 0 if budget is None else knob(arm, budget, bases)
            done[key] = {**run_one(arm, size, lr, seed, p, bases, data, base_kjv, progress),
                         "budget": budget}
            atomic_write_text(partial_file, json.dumps({"fingerprint": fingerprint(settings),
                                                        "runs": done}))
            if print_fn:
                r = done[key]
                print_fn(f"{arm} budget {budget} lr {lr:g} seed {seed}: new {r['new_loss']:.4f} "
                         f"old {r['old_loss']:.4f} ({r['trainable']:,} trainable)")
        return done[key]

    tuning = {}
    for arm in p.arms:
        for budget in ([None] if arm == "full" else p.budgets):
            tuning[tuning_key(arm, budget)] = tune_lr(
                sorted(p.lrs[arm]), p.max_extensions,
                lambda lr, arm=arm, budget=budget: run(arm, budget, lr, p.tune_seed)["new_loss"])
    runs = []
    for seed in range(p.seeds):
        for arm in p.arms:
            for budget in ([None] if arm == "full" else p.budgets):
                runs.append(run(arm, budget, tuning[tuning_key(arm, budget)]["lr"], seed))
    results = {"schema": SCHEMA, "preset_name": name, "preset": asdict(p), "runs": runs,
               "tuning": tuning, "base_loss": base_loss, "base_train_s": base_train_s,
               "base_parameters": {k: m.num_parameters() for k, m in bases.items()},
               "machine": machine_summary()["summary"], "elapsed_s": time.perf_counter() - start,
               "command": command or " ".join(
                   ["tokenformer adapt-bench --preset", name]
                   + ([f"--seeds {seeds}"] if seeds is not None else [])
                   + ([f"--budgets {','.join(f'{b:g}' for b in budgets)}"] if budgets else [])
                   + ([f"--threads {threads}"] if threads else []) + [f"--out {out}"]),
               "code_corpus": CODE_SOURCE}
    results["summary"] = summarize(results)
    results["verdict_lines"] = verdict(results)
    atomic_write_text(out / "results.json", to_json(results))
    plots = make_plots(results, out)
    atomic_write_text(out / "report.md", report_markdown(results, plots))
    return results


def _default_kjv(progress: bool | None) -> Any:
    from ..data import default_dataset

    return default_dataset("bytes", progress=progress)
