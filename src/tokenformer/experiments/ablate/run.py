"""Trains an ablation: each variant's LR sweep, then every variant over seeds, resumably.

Every variant trains with the same budget, initialisation seed and data order per seed (the
task's batches are a pure function of (seed, step)) through the task's own front end:
:func:`tokenformer.training.lm.train` for the LM (embedded corpus or a prepared directory,
validation bits per byte) and :func:`tokenformer.training.vision.train_vision` for the vision
model (digits, test top-1). The arms/seeds machinery is :mod:`..common.arms`'s.

Every variant gets its own tuned learning rate (the experiments' rule: no arm may lose only
because the shared LR suits another): before the reported seeds, each variant trains at every
LR of a factor-2 log grid centred on the preset's LR, with a tuning seed that is not one of the
reported seeds; the argmin of the validation metric is its LR, the grid growing past an edge
argmin (:func:`..common.sweep.sweep_lr`). The schedule family (warmup, cosine to lr/10) is the
same for every variant. ``lr=`` (``--lr``) pins one LR for all variants instead.

The results go to :mod:`.report` (summary, verdict, report.md, plots).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ... import __version__
from ...data.corpus import default_dataset
from ...data.datasets import TokenDataset
from ...errors import ConfigError, DivergedError
from ...io.metrics import read_metrics
from ...io.progress import inner_progress
from ...training.config import TrainConfig
from ...training.lm import train
from ...training.vision import train_vision
from ..common.arms import Arm, Curve, Point, run_arms
from ..common.machine import machine_summary
from ..common.sweep import LRSweep, sweep_lr
from .plan import (
    SCHEMA,
    TASKS,
    AblationPreset,
    Study,
    base_lr,
    check_task,
    get_preset,
    get_study,
    lr_grid,
    select_variants,
    tuning_seed,
)
from .report import summarize, write_outputs

PARTIAL = ".partial.json"  # finished final runs, for a rerun to resume
SWEEP_PARTIAL = ".partial-sweep.json"  # finished LR-sweep runs, likewise


def _points(records: list[dict[str, Any]], task: str) -> list[Point]:
    points = []
    for r in records:
        if r["type"] != "eval":
            continue
        if task == "lm":
            points.append(Point(r["step"], r["tokens"], r["flops"], r["train_time"],
                                r["val_loss"], r["val_bpb"]))
        else:
            points.append(Point(r["step"], r["tokens"], r["flops"], r["train_time"], r["loss"],
                                math.nan, metrics={"accuracy": r["accuracy"]}))
    return points


def train_variant(task: str, study: Study, variant: str, preset: AblationPreset, seed: int,
                  run_dir: str | Path, *, data: str | Path | None = None,
                  progress: bool | None = None) -> Curve:
    """Train one variant for one seed into ``run_dir``; its evaluation curve.

    A run whose loss becomes non-finite is recorded, not fatal: its curve ends with a point at the
    step it diverged, with the worst possible metric, and ``info["diverged"]`` holds that step.
    """
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a crashed attempt of this very arm
    overrides: dict[str, Any] = {**preset.model, study.key: variant}
    lr = base_lr(task, preset)
    # the schedule family is the same at every LR: warmup, then cosine down to lr / 10
    recipe: dict[str, Any] = {"steps": preset.steps, "batch_size": preset.batch_size,
                              "eval_interval": preset.eval_every, "seed": seed,
                              "pattention_impl": preset.pattention_impl, "lr": lr,
                              "min_lr": lr / 10}
    if preset.warmup_steps is not None:
        recipe["warmup_steps"] = preset.warmup_steps
    diverged = None
    try:
        if task == "lm":
            cfg = TrainConfig(model={"preset": preset.base, **overrides},
                              data=str(data) if data is not None else "default",
                              seq_len=preset.seq_len, eval_batches=preset.eval_batches,
                              samples=0, device="cpu", out=str(run_dir), **recipe)
            train(cfg, progress=progress, print_fn=lambda _: None)
        else:
            train_vision(preset.base, "digits", out=run_dir, progress=progress,
                         model_overrides=overrides, **recipe)
    except DivergedError:  # its last training record holds the step, tokens and FLOPs
        diverged = [r for r in read_metrics(run_dir) if r["type"] == "train"][-1]
    records = read_metrics(run_dir)
    points = _points(records, task)
    info: dict[str, Any] = {"run_dir": str(run_dir), "lr": lr}
    if diverged is not None:
        worst = math.inf if TASKS[task].lower_is_better else 0.0
        metrics = {} if task == "lm" else {"accuracy": worst}
        points.append(Point(diverged["step"], diverged["tokens"], diverged["flops"],
                            diverged["train_time"], math.inf, math.inf if task == "lm" else
                            math.nan, metrics=metrics))
        info["diverged"] = diverged["step"]
    return Curve(points, info=info)


def _final(curve: Curve, task: str) -> tuple[float, float]:
    """(the task's metric, the loss) at a curve's last evaluation."""
    last = curve.final
    metric = last.bpb if task == "lm" else last.metrics.get("accuracy", math.nan)
    return metric, last.loss


def _sweep_record(sweep: LRSweep, curves: dict[float, Curve], task: str) -> dict[str, Any]:
    points = []
    for lr in sweep.grid:
        metric, loss = _final(curves[lr], task)
        points.append({"lr": lr, "metric": metric, "loss": loss,
                       "diverged": "diverged" in curves[lr].info})
    return {"points": points, "chosen": sweep.chosen, "added": sweep.added,
            "status": sweep.status}


def run_ablation(study: str, task: str, preset: str | AblationPreset = "quick", *,
                 seeds: int | None = None, variants: Sequence[str] | str | None = None,
                 steps: int | None = None, lr: float | None = None,
                 data: str | Path | None = None,
                 out: str | Path | None = None, progress: bool | None = None,
                 command: str | None = None,
                 print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Tune each variant's LR, then train every variant of ``study`` on ``task`` for every seed
    at its LR; write ``report.md``, ``results.json``, ``final.png``, ``curves.png`` and
    ``sweep.png`` into ``out``; return the results.

    ``lr`` pins one LR for every variant and skips the sweeps. ``data`` (LM only): a prepared
    dataset directory instead of the embedded corpus. A run interrupted part-way (in the sweeps
    or the final runs) resumes from ``out/.partial-sweep.json`` and ``out/.partial.json`` when
    rerun with the same settings.
    """
    st, tk = get_study(study), check_task(task)
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {lr}")
    if data is not None and task != "lm":
        raise ConfigError("--data applies to --task lm only; the vision ablations run on digits")
    p = get_preset(task, preset) if isinstance(preset, str) else preset
    p = dataclasses.replace(p, **{k: v for k, v in (("seeds", seeds), ("steps", steps))
                                  if v is not None})
    if lr is not None:
        p = dataclasses.replace(p, lr=lr, tune=False)
    p.validate()
    p = dataclasses.replace(p, lr=base_lr(task, p))  # recorded: the task default made explicit
    names = select_variants(st, variants)
    out = Path(out if out is not None else f"runs/ablate-{study}-{task}-{p.name}")
    if task == "lm":
        # opened once here: a bad directory fails before anything trains, the corpus is cached
        dataset = TokenDataset.open(data) if data is not None else default_dataset(
            progress=progress is not False)
        data_info = (f"{data}" if data is not None else
                     "embedded corpus (King James Bible), bytes tokenizer") + (
            f", {int(dataset.meta['val_tokens']):,} validation tokens")
    else:
        data_info = "scikit-learn digits (8×8, 1437 train / 360 test)"
    seed_list = list(range(p.seeds))
    settings = {"study": study, "task": task, "preset": dataclasses.asdict(p), "data": data_info,
                "variants": names, "version": __version__}

    def trainer(variant: str, lr_: float, folder: str) -> Callable[[int, Any], Curve]:
        return lambda seed, _shared: train_variant(
            task, st, variant, dataclasses.replace(p, lr=lr_), seed,
            out / folder / f"{variant}-{'' if folder == 'runs' else f'lr{lr_:.4g}-'}seed{seed}",
            data=data, progress=inner_progress(progress))

    out.mkdir(parents=True, exist_ok=True)
    n_sweep = len(names) * p.sweep_points if p.tune else 0
    print_fn(f"ablate: study {study} ({st.key}: {', '.join(names)}), task {task}, preset "
             f"{p.name}, {n_sweep} LR-sweep runs + {len(names) * len(seed_list)} runs → {out}")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    tuning: dict[str, Any] | None = None
    sweeps: dict[str, dict[str, Any]] = {}
    if p.tune:
        grid = lr_grid(base_lr(task, p), p.sweep_points)
        seed = tuning_seed(seed_list)
        tuning = {"seed": seed, "metric": tk.metric, "steps": p.steps, "grid": grid,
                  "max_extensions": p.max_extensions}
        sweep_arms: list[Arm] = []
        for n in names:
            curves_n: dict[float, Curve] = {}

            def measure(lr_: float, n: str = n, curves_n: dict[float, Curve] = curves_n
                        ) -> float:
                # every sweep run so far is passed: run_arms restores the finished ones from
                # the partial file and saves them all again with the new one
                sweep_arms.append(Arm(f"{n}@{lr_!r}", trainer(n, lr_, "sweeps")))
                curve = run_arms(sweep_arms, [seed], partial=out / SWEEP_PARTIAL,
                                 settings={**settings, "tuning": tuning},
                                 progress=False)[sweep_arms[-1].name][seed]
                curves_n[lr_] = curve
                metric, _ = _final(curve, task)
                print_fn(f"ablate: LR sweep {n} lr {lr_:.3g} (seed {seed}): {tk.metric} "
                         f"{tk.fmt(metric)}")
                return metric if tk.lower_is_better else -metric

            sweep = sweep_lr(grid, measure, max_extensions=p.max_extensions)
            sweeps[n] = _sweep_record(sweep, curves_n, task)
            print_fn(f"ablate: {n}: lr {sweep.chosen:.3g} ({sweep.status})")
    lrs = {n: sweeps[n]["chosen"] if n in sweeps else base_lr(task, p) for n in names}
    arms = [Arm(n, trainer(n, lrs[n], "runs"), label=st.labels[n]) for n in names]
    curves = run_arms(arms, seed_list, partial=out / PARTIAL,
                      settings={**settings, "lrs": lrs}, progress=progress)
    results: dict[str, Any] = {
        "schema": SCHEMA, "command": command or f"run_ablation({study!r}, {task!r}, {p.name!r})",
        "study": study, "task": task, "key": st.key, "metric": tk.metric,
        "preset": dataclasses.asdict(p), "seeds": seed_list, "data": data_info,
        "pattention_impl": p.pattention_impl, "machine": machine_summary(),
        "load": [load0, os.getloadavg()[0]],
        "wall_clock": time.perf_counter() - t0,
        "tuning": tuning,
        "variants": {n: {"label": st.labels[n], "paper": st.paper.get(n), "lr": lrs[n],
                         "sweep": sweeps.get(n),
                         "runs": {str(s): c.to_dict() for s, c in sorted(curves[n].items())}}
                     for n in names},
    }
    results["summary"] = summarize(results)
    write_outputs(results, out)
    (out / PARTIAL).unlink(missing_ok=True)
    (out / SWEEP_PARTIAL).unlink(missing_ok=True)
    print_fn(f"ablate: done in {results['wall_clock']:.0f} s; report: {out / 'report.md'}")
    for line in results["summary"]["verdict"]:
        print_fn(f"- {line}")
    return results
