"""Runs adapt-bench: pretrains the two bases, tunes each arm's LR per budget, adapts and measures.

Every (arm, budget, LR, seed) run is kept in ``out/.partial.json`` and the bases in
``out/.bases``, so a rerun (e.g. with more seeds) trains only what is new. The results go to
:mod:`.report`.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...data.corpora import CODE_SOURCE, code_dataset
from ...errors import TokenFormerError
from ...io.files import atomic_write_text, save_safetensors
from ...models.baselines import TransformerLM, matched_config
from ...models.config import TokenFormerConfig
from ...models.lm import TokenFormerLM
from ...ops import adapters as ad
from ...training.config import TrainConfig
from ...training.evaluation import lm_evaluator
from ...training.lm import lm_batches
from ...training.loop import fit
from ..common.arms import fingerprint
from ..common.machine import machine_summary
from ..common.saved import damaged, is_mapping_of, read_saved_json
from ..common.sweep import sweep_lr
from . import report
from .corpus import kjv_dataset
from .plan import SCHEMA, BenchPreset, base_of, bench_preset, tuning_key

# What every run of .partial.json holds (run_one's row and its budget): a rerun reads them all.
RUN_KEYS = frozenset({"arm", "size", "lr", "seed", "trainable", "base_parameters", "step_ms",
                      "new_loss", "old_loss", "file_bytes", "budget"})


def tune_lr(grid: list[float], max_extensions: int, loss_of: Any) -> dict[str, Any]:
    """The argmin of ``loss_of(lr)`` over ``grid``, extended past an edge pick by the shared
    rule (:func:`..common.sweep.sweep_lr`, as the frontier and the ablations); one value: no
    tuning."""
    if len(grid) < 2:
        return {"lr": grid[0], "grid": grid, "losses": {}, "added": [], "edge": False}
    sweep = sweep_lr(grid, loss_of, max_extensions=max_extensions)
    return {"lr": sweep.chosen, "grid": sweep.grid, "losses": sweep.values,
            "added": sweep.added, "edge": sweep.at_edge}


# ------------------------------------------------------------------------------------- arms
def _train_cfg(preset: BenchPreset, lr: float, steps: int, seed: int) -> Any:
    return TrainConfig(seq_len=preset.seq_len, batch_size=preset.batch_size, steps=steps,
                       lr=lr, min_lr=lr / 10, warmup_steps=min(preset.warmup, steps // 4),
                       weight_decay=0.0, eval_interval=0, seed=seed, samples=0)


def _fit(model: nn.Module, dataset: Any, cfg: Any, progress: bool | None) -> Any:
    return fit(model, lm_batches(dataset, cfg.batch_size, cfg.seq_len, cfg.seed), cfg,
               progress=progress)


@torch.no_grad()
def _val_loss(model: nn.Module, dataset: Any, preset: BenchPreset) -> float:
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
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_safetensors({k: v.detach().contiguous() for k, v in tensors.items()}, path)
        return path.stat().st_size


def run_one(arm: str, size: int, lr: float, seed: int, preset: BenchPreset,
            bases: dict[str, nn.Module], data: dict[str, Any], base_kjv: dict[str, float],
            progress: bool | None = None) -> dict[str, Any]:
    """Adapt a copy of the base with ``arm`` (``size`` tokens / rank; ignored by ``full``) and
    measure it."""
    base = bases[base_of(arm)]
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


# ----------------------------------------------------------------------------------- runner
def run_adapt_bench(preset: str | BenchPreset = "quick", *, out: str | Path,
                    seeds: int | None = None, budgets: Sequence[float] | None = None,
                    progress: bool | None = None, threads: int = 0,
                    command: str | None = None,
                    print_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the experiment; write ``report.md``, ``results.json``, ``pareto.png`` into ``out``.

    Finished runs are kept in ``out/.partial.json`` and reused by a rerun of the same settings.
    """
    name = preset if isinstance(preset, str) else "custom"
    p = bench_preset(preset, seeds, budgets, threads)
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
    data = {"kjv": kjv_dataset(progress), "code": code_dataset(progress=progress)}
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
    return report.write(results, out)
