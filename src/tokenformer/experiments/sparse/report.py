"""Sparse study rows → intervals over seeds, paired tests, markdown sections and plots.

Each part's function takes its plan and the rows :mod:`.run` measured and returns what the
command line prints and saves: ``{"markdown": ..., <the JSON's keys>}``. Several models (one
per seed) give means with t-based 95 % intervals, and comparisons follow the experiments' one
rule (:mod:`..common.stats`). The plots read the saved JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...io.files import atomic_write_text
from ..common.machine import machine_summary
from ..common.stats import RULE, describe, paired, t_interval
from .plan import (
    FRACTIONS,
    KINDS,
    PRUNED,
    SPARSITY_COLUMNS,
    CompareMLP,
    PruneCurve,
    PruneSeeds,
    Quality,
    TrainArms,
)


# --------------------------------------------------------------------------- numbers, files
def cell(values: list[float], digits: int = 4, sign: bool = True) -> str:
    """One value as is; several (one per seed) as mean [t-based 95 % interval]."""
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    if len(values) == 1:
        return f.format(values[0])
    ci = t_interval(values)
    return f"{f.format(ci.mean)} [{f.format(ci.low)}, {f.format(ci.high)}]"


def interval(values: list[float]) -> dict:
    """Mean, t-based 95 % interval and p-value (vs 0) of per-seed values, for the JSON."""
    ci = t_interval(values)
    return {"mean": ci.mean, "low": ci.low, "high": ci.high, "p": ci.p_value, "values": values}


def _loss(value: float | None) -> str:
    """A loss cell; ``–`` where there is none (e.g. not fine-tuned)."""
    return f"{value:.4f}" if value is not None else "–"


def section(what: str, command: str, result: dict[str, Any]) -> str:
    """The part's result as a benchmarks/RESULTS.md section: title, command, machine, text."""
    m = machine_summary()
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    machine = (f"{m['cpu']}, {m['cpus']} logical cores, torch {m['torch']} "
               f"({m['torch_threads']} threads); load average {load}")
    return (f"### Sparse Pattention: {what}\n\nCommand: `{command}`  \n"
            f"CPU: {machine} (cores shared with other jobs)\n\n{result['markdown']}\n")


def save_json(result: dict[str, Any], path: str | Path) -> None:
    """The result without its markdown, as JSON (written atomically)."""
    atomic_write_text(path, json.dumps({k: v for k, v in result.items() if k != "markdown"},
                                       indent=1) + "\n")


# ---------------------------------------------------------------------------------- parts
def _table(intro: str, header: str, rule: str, line: str, rows: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """A part's result whose text is an intro and one table, and its rows. ``line`` formats a
    row (``str.format`` over its keys, plus ``tuned`` and ``frontier``: its fine-tuned and its
    frontier loss, ``–`` where it has none)."""
    lines = [line.format(**r, tuned=_loss(r.get("finetuned")),
                         frontier=_loss(r.get("frontier_loss"))) for r in rows]
    return {"markdown": "\n".join([intro, "", header, rule, *lines]), "rows": rows}


def train_arms(plan: TrainArms, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return _table(f"Frontier arm {plan.size} at its largest budget, retrained by "
                  f"`tokenformer.training` with the recipe of {plan.results} (WSD, chosen LR per "
                  f"family).",
                  "| family | seed | LR | steps | val loss | frontier's val loss |",
                  "|---|---:|---:|---:|---:|---:|",
                  "| {family} | {seed} | {lr:g} | {steps} | {val_loss:.4f} | {frontier} |", rows)


def quality(plan: Quality, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Δ val loss vs k/n per projection type and Θ's natural sparsity per layer, for each model
    (one per seed); with several, the mean and its t-based 95 % interval over them."""
    c, n = runs[0]["config"], len(runs)
    rows = [{"kinds": "+".join(k), "fraction": f,
             **interval([r["deltas"]["+".join(k), f] for r in runs])}
            for k in KINDS for f in FRACTIONS[1:]]
    for r in rows:
        r["delta"] = r["mean"]
    sparsity = {name: interval([r["sparsity"][name] for r in runs]) for name in runs[0]["sparsity"]}
    dense = [r["dense"] for r in runs]
    what = (f"{n} models (seeds), mean [t-based 95 % interval]" if n > 1 else "one model")
    lines = [f"Model{'s' if n > 1 else ''} {', '.join(plan.models)}: {c.num_layers} layers, "
             f"d={c.hidden_size}, n = {c.qkv_tokens}/{c.proj_tokens}/{c.ffn_tokens} "
             f"(qkv/proj/ffn); dense val loss {cell(dense, sign=False)} nats/token "
             f"({plan.eval_batches}×16×{min(256, c.max_seq_len)} held-out tokens); {what}.", "",
             "| top-k applied to | " + " | ".join(f"k/n = 1/{round(1 / f)}" for f in FRACTIONS[1:])
             + " |", "|---|" + "---:|" * (len(FRACTIONS) - 1)]
    for k in KINDS:
        cells = [cell(r["values"]) for r in rows if r["kinds"] == "+".join(k)]
        lines.append(f"| {'+'.join(k)} | " + " | ".join(cells) + " |")
    lines += ["", "Δ val loss (nats/token) vs dense. Natural sparsity, fraction of |Θ| < 1e-3 × "
              "row max, per layer:", "", "| layer | q | k | v | proj | ffn |",
              "|---|---:|---:|---:|---:|---:|"]
    for i in range(c.num_layers):
        vals = [sparsity[f"layers.{i}.{s}"]["values"] for s in SPARSITY_COLUMNS]
        lines.append(f"| {i} | " + " | ".join(cell(v, 3, sign=False) for v in vals) + " |")
    return {"markdown": "\n".join(lines), "dense": dense[0] if n == 1 else interval(dense),
            "rows": rows, "sparsity": sparsity, "models": list(plan.models)}


def prune_curve(plan: PruneCurve, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return _table(f"Model {plan.model}: every Pattention (qkv/proj/ffn) pruned by the same "
                  f"fraction; val loss nats/token ({plan.eval_batches}×16×256 held-out tokens); "
                  f"calibration: 8×256 training tokens; fine-tune: {plan.finetune_steps} trainer "
                  f"steps at constant lr {plan.finetune_lr} (demo config, batch 16×256).",
                  "| pruned | by | Θ factor | parameters | val loss | after fine-tune |",
                  "|---:|---|---|---:|---:|---:|",
                  "| {pruned:.0%} | {by} | {scale} | {params:,} | {val_loss:.4f} | {tuned} |", rows)


def compare_mlp(plan: CompareMLP, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return _table(f"FFN-only pruning. TokenFormer {plan.tokenformer} (FFN tokens, by "
                  f"contribution, Θ factor held) vs Transformer++ {plan.transformer} (MLP "
                  f"neurons by magnitude), both trained with the same config; val loss "
                  f"nats/token ({plan.eval_batches}×16×256 held-out tokens); fine-tune "
                  f"{plan.finetune_steps} steps at constant lr {plan.finetune_lr}.",
                  "| FFN pruned | arch | parameters | val loss | after fine-tune |",
                  "|---:|---|---:|---:|---:|",
                  "| {pruned:.0%} | {arch} | {params:,} | {val_loss:.4f} | {tuned} |", rows)


def load_prune_seeds(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows and sweeps of an earlier ``prune-seeds`` JSON, to re-render its report."""
    saved = json.loads(Path(path).read_text())
    sweeps, rows = saved["sweeps"], saved["rows"]
    for sweep in sweeps.values():
        sweep["losses"] = {float(f): v for f, v in sweep["losses"].items()}
    return rows, sweeps


def prune_seeds(plan: PruneSeeds, rows: list[dict[str, Any]], sweeps: dict[str, Any]
                ) -> dict[str, Any]:
    """Pruning with seeds: TokenFormer parameter tokens (FFN only and every kind, each
    criterion) vs the matched Transformer++'s MLP neurons, on trained runs paired by seed; Δ vs
    each model's own unpruned loss, with and without a fine-tune, mean and t-based 95 % interval
    over seeds, and the paired tests of the plan's questions."""
    families = plan.families()

    def values(family: str, arm: str, frac: float, key: str, ref_key: str | None = None
               ) -> dict[int, float]:
        """Per seed: ``key`` of the arm minus ``ref_key`` (default ``key``) of the unpruned."""
        ref = {r["seed"]: r[ref_key or key] for r in rows
               if r["family"] == family and r["pruned"] == 0}
        return {r["seed"]: r[key] - ref[r["seed"]] for r in rows
                if r["family"] == family and r["arm"] == arm and r["pruned"] == frac}

    keys = ["val_loss"] + (["finetuned"] if plan.finetune_steps else [])
    summary = []
    for family, (_paths, arms) in families.items():
        for frac in PRUNED[1:]:
            for arm in arms:
                entry = {"family": family, "arm": arm, "pruned": frac,
                         "params": next(r["params"] for r in rows if r["family"] == family
                                        and r["arm"] == arm and r["pruned"] == frac)}
                for key in keys:
                    entry[key] = interval([r[key] for r in rows if r["family"] == family
                                           and r["arm"] == arm and r["pruned"] == frac])
                    entry[f"delta_{key}"] = interval(list(values(family, arm, frac,
                                                                 key).values()))
                if "finetuned" in keys:  # the tuned model vs the original unpruned one
                    entry["delta_finetuned_vs_original"] = interval(list(values(
                        family, arm, frac, "finetuned", "val_loss").values()))
                summary.append(entry)
    tests = []
    for frac in PRUNED[1:]:
        for key in keys:
            for fa, a, fb, b in plan.questions():
                c = paired(f"{fa} {a}", f"{fb} {b}", values(fa, a, frac, key),
                           values(fb, b, frac, key)).to_dict()
                tests.append({**c, "pruned": frac, "key": key})
    base = paired("tokenformer", "transformer++",
                  {r["seed"]: r["val_loss"] for r in rows
                   if r["family"] == "tokenformer" and r["pruned"] == 0},
                  {r["seed"]: r["val_loss"] for r in rows
                   if r["family"] == "transformer++" and r["pruned"] == 0}).to_dict()
    n = len(plan.tokenformer)
    unpruned = {f: [r["val_loss"] for r in rows if r["family"] == f and r["pruned"] == 0]
                for f in families}
    lines = [f"{n} seeds per family: TokenFormer runs {', '.join(plan.tokenformer)}; "
             f"Transformer++ runs {', '.join(plan.transformer)} (paired by seed: same batches). "
             f"Val loss nats/token ({plan.eval_batches}×16×128 held-out tokens); calibration 8 "
             f"training sequences. TokenFormer: parameter tokens by `prune(by=...)`, Θ factor "
             f"held, of the FFN only or of every Pattention (all); Transformer++: MLP neurons. "
             f"Fine-tune: {plan.finetune_steps} steps of the trainer, WSD (10 warmup steps, "
             f"last 20 % decaying to 0.1×), fresh AdamW, peak LR = factor × the family's tuned "
             f"LR, same batch and weight decay as training, the batches after the run's last.",
             "", f"Unpruned: TokenFormer {cell(unpruned['tokenformer'], sign=False)}, "
             f"Transformer++ {cell(unpruned['transformer++'], sign=False)}; TokenFormer − "
             f"Transformer++ {describe(base)} ({base['verdict']}).", ""]
    for family, sweep in sweeps.items():
        lines.append(f"Fine-tune LR sweep, {family} ({sweep['arm']} at "
                     f"{plan.sweep_fraction:.0%}, seed of {families[family][0][0]}): "
                     + ", ".join(f"×{f:g}: {v:.4f}" for f, v in sweep["losses"].items())
                     + f"; chosen ×{sweep['chosen']:g}"
                     + (" (at the grid's edge)" if sweep["at_edge"] else "") + ".")
    lines += ["", "Δ val loss vs the model's own unpruned loss (fine-tuned rows: vs the unpruned "
              "model fine-tuned the same way), mean [95 % interval] over seeds:", "",
              "| pruned | arm | parameters | Δ no fine-tune | Δ after fine-tune | "
              "fine-tuned − unpruned original |", "|---:|---|---:|---:|---:|---:|"]
    for e in summary:
        ft = (f"{cell(e['delta_finetuned']['values'])} | "
              f"{cell(e['delta_finetuned_vs_original']['values'])}" if "finetuned" in e
              else "– | –")
        lines.append(f"| {e['pruned']:.0%} | {e['family']} {e['arm']} | {e['params']:,} | "
                     f"{cell(e['delta_val_loss']['values'])} | {ft} |")
    lines += ["", "Paired by seed: difference of the Δs (a − b; across families each Δ is vs its "
              "own unpruned model):", "",
              "| pruned | fine-tuned | a | b | Δ(a) − Δ(b) | verdict |",
              "|---:|---|---|---|---:|---|"]
    for t in tests:
        lines.append(f"| {t['pruned']:.0%} | {'yes' if t['key'] == 'finetuned' else 'no'} | "
                     f"{t['a']} | {t['b']} | {describe(t)} | {t['verdict']} |")
    lines += ["", RULE]
    return {"markdown": "\n".join(lines), "rows": rows, "summary": summary, "tests": tests,
            "sweeps": sweeps, "unpruned_difference": base}


# ---------------------------------------------------------------------------------- plots
def plot(quality_json: str, prune_json: str, out_dir: str) -> None:
    """docs/img/sparse/{topk,prune}.png from the JSON the quality and prune runs wrote."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q = json.loads(Path(quality_json).read_text())
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kinds in ("qkv", "proj", "ffn", "qkv+proj+ffn"):
        rows = [r for r in q["rows"] if r["kinds"] == kinds]
        ax.plot([1.0] + [r["fraction"] for r in rows], [0.0] + [r["delta"] for r in rows],
                marker="o", label=f"top-k on {kinds}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k / n (tokens read per row)")
    ax.set_ylabel("Δ val loss vs dense (nats/token)")
    ax.set_title(f"Top-k Pattention, trained demo model (dense {q['dense']:.3f})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "topk.png", dpi=110)
    r = json.loads(Path(prune_json).read_text())["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for by in dict.fromkeys(x["by"] for x in r if x["pruned"] > 0):
        for scale in dict.fromkeys(x["scale"] for x in r if x["pruned"] > 0):
            rows = [r[0]] + [x for x in r if x["by"] == by and x["scale"] == scale]
            ax.plot([x["pruned"] for x in rows], [x["val_loss"] for x in rows], marker="o",
                    label=f"{by}, {scale}")
        tuned = [r[0]] + [x for x in r if x["by"] == by and x["finetuned"] is not None
                          and x["pruned"] > 0]
        if len(tuned) > 1:
            ax.plot([x["pruned"] for x in tuned], [x["finetuned"] for x in tuned], marker="s",
                    linestyle="--", label=f"{by} + fine-tune")
    ax.set_xlabel("fraction of parameter tokens removed (every Pattention)")
    ax.set_ylabel("val loss (nats/token)")
    ax.set_title("Pruning parameter tokens, trained demo model")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "prune.png", dpi=110)


def plot_seeds(quality_json: str, prune_json: str, out_dir: str, name: str) -> None:
    """OUT/topk_NAME.png (Δ val loss vs k/n) and OUT/prune_NAME.png (Δ val loss vs the
    fraction removed, without and with the fine-tune), means over seeds with their t-based 95 %
    interval as a band, from the JSON of ``quality`` and ``prune-seeds`` on several seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def line(ax, xs, entries, **kw):
        ax.plot(xs, [e["mean"] for e in entries], marker="o", **kw)
        ax.fill_between(xs, [e["low"] for e in entries], [e["high"] for e in entries],
                        alpha=0.12, color=ax.lines[-1].get_color())

    q = json.loads(Path(quality_json).read_text())
    zero = {"mean": 0.0, "low": 0.0, "high": 0.0}
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kinds in ("qkv", "proj", "ffn", "qkv+proj+ffn"):
        rows = [r for r in q["rows"] if r["kinds"] == kinds]
        line(ax, [1.0] + [r["fraction"] for r in rows], [zero, *rows], label=f"top-k on {kinds}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k / n (tokens read per row)")
    ax.set_ylabel("Δ val loss vs dense (nats/token)")
    ax.set_title(f"Top-k Pattention, {name} model, {len(q['models'])} seeds (band: 95 % CI)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"topk_{name}.png", dpi=110)

    summary = json.loads(Path(prune_json).read_text())["summary"]
    keys = [k for k in ("val_loss", "finetuned") if f"delta_{k}" in summary[0]]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4.0), sharey=False,
                             squeeze=False)
    styles = {"ffn": "-", "all": ":", "mlp": "--"}
    colors = {"contribution": "C0", "mass": "C1", "value": "C2", "newest": "C3",
              "magnitude": "black", "activation": "C4"}
    for ax, key in zip(axes[0], keys, strict=True):
        for family, arm in dict.fromkeys((e["family"], e["arm"]) for e in summary):
            rows = [e[f"delta_{key}"] for e in summary if e["family"] == family
                    and e["arm"] == arm]
            xs = [0.0] + [e["pruned"] for e in summary if e["family"] == family
                          and e["arm"] == arm]
            line(ax, xs, [zero, *rows], linestyle=styles[arm.split("/")[0]],
                 color=colors[arm.split("/")[1]],
                 label=f"{'TF' if family == 'tokenformer' else 'T++'} {arm}")
        ax.set_xlabel("fraction removed")
        ax.set_ylabel("Δ val loss vs unpruned (nats/token)")
        ax.set_title("no fine-tune" if key == "val_loss" else "after the fine-tune")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"prune_{name}.png", dpi=110)
