"""The plan in words: the chain, LR and horizon rules as stated in ``--plan`` and the report, the
seeds, and ``tokenformer scale --plan``'s text (:func:`describe`; nothing is trained)."""

from __future__ import annotations

from ..common.report import markdown_table
from .arms import GROWING_ARMS
from .chains import predicted_envelope
from .plan import held_out_seeds, stage_plans, tuning_seeds
from .presets import SCHEDULE_FAMILY, Preset
from .questions import question_lines
from .schedule import stage_lr_key

CHAIN_RULE = (
    "Chains follow the envelope: at budget j a chain should be at the smallest of the envelope's "
    "best sizes at budgets j, j+1, …; it starts there (at or below the smallest budget's best "
    "size), grows into each next target right after the previous budget's branch point, earlier "
    "where the new size would get less than {share:.0%} of the next budget's steps, and a budget "
    "is read only when the size cooled down there has trained {share:.0%} of that budget's "
    "steps. It ends at the envelope's best size at its final budget. A stack or clone chain "
    "grows once, at the same step, into the same final size from its half-depth or half-width "
    "copy. Each stage trains at its own size's tuned LR (per-stage), unless the arm is "
    "final-size (the whole chain at its final size's LR).")
LR_RULE = (
    "LR: per family and size, the argmin of the mean final validation loss over {seeds} tuning "
    "seed(s) of {steps}-step WSD runs on a factor-2 grid, picked inside the grid (extended "
    "beyond an edge argmin); non-monotone sweeps and seeds that disagree are flagged.")
HORIZON_RULE = (
    "Horizon (v4): every size then runs at full length (its stable run and every cooldown "
    "branch it reads) on the tuning seeds at ×{factors} of that pick; at each budget the LR "
    "with the lowest tuning mean is that size's LR there, and the (size, LR) with the lowest "
    "tuning mean is the family's envelope there. Held-out seeds run only those (size, LR) pairs "
    "(one stable run per pair, the branches of the budgets that chose it) and score them. Each "
    "growing arm runs at full length on the tuning seeds at ×{factors} of its policy's LRs "
    "(final-size: the final size's LR at its final budget; per-stage: each size's LR at the "
    "last budget it is cooled down at), the factor with the lowest tuning mean at its final "
    "budget is the one its held-out runs use.")


def seed_lines(preset: Preset) -> list[str]:
    """Which seeds choose and which seeds score (``--plan`` and the report)."""
    tuning, held = tuning_seeds(preset), held_out_seeds(preset)
    span = f"{held[0]}–{held[-1]}" if len(held) > 1 else str(held[0])
    if not preset.horizon_factors:
        return [f"Seeds: tuning seeds {', '.join(map(str, tuning))} choose the LRs (the short "
                f"sweeps); seeds {span} run every final run, and the envelope's size is chosen "
                f"on the same seeds it is scored on (the v3 protocol)."]
    return [f"Seeds: **tuning seeds** {', '.join(map(str, tuning))} choose every LR and every "
            f"best size (LR sweeps, horizon runs, chain tuning); **held-out seeds** {span} are "
            f"the only seeds any reported number rests on."]


def describe(preset: Preset, vocab_size: int) -> str:
    """The plan as text (``tokenformer scale --plan``): the pre-registered questions, the seeds
    and the stages (sweep, horizon, held-out) with their run counts and FLOPs, the chain and LR
    rules, every held-out arm's sizes, growth steps, budgets run and FLOPs (on the predicted
    envelope); nothing is trained."""
    stages = stage_plans(preset, vocab_size)
    runs = stages["held-out from scratch"] + stages["held-out chains"]
    rows = []
    for run in runs:
        if run.seed:
            continue
        seeds = sum(r.arm == run.arm and r.stages == run.stages for r in runs)
        rows.append([run.arm, str(seeds), " → ".join(f"{s.size}@{s.start}" for s in run.stages),
                     ", ".join(f"{b.budget:.2g}:{b.steps}" for b in run.branches),
                     f"{run.total_steps:,}", f"{run.total_flops():.3g}",
                     " → ".join(dict.fromkeys(stage_lr_key(run, s) for s in run.stages))])
    total = sum(r.total_flops() for r in runs)
    sweeps = stages["sweep"]
    sweep_flops = sum(r.total_flops() for r in sweeps)
    held = "held-out" if preset.horizon_factors else "final"
    stage_rows = [[name, "tuning" if name in ("sweep", "horizon", "chain tuning") else held,
                   str(len(rs)), f"{sum(r.total_steps for r in rs):,}",
                   f"{sum(r.total_flops() for r in rs):.3g}"]
                  for name, rs in stages.items() if rs]
    families = sorted({GROWING_ARMS[a].family for a in preset.recipes})
    envelope_families = preset.families if preset.horizon_factors else families
    predicted = [f"- {f}: " + ", ".join(f"{preset.budgets[j]:.2g} {z}" for j, z in
                                        predicted_envelope(preset, f, vocab_size).items())
                 for f in envelope_families]
    rules = [CHAIN_RULE.format(share=preset.min_stage_share),
             LR_RULE.format(seeds=preset.tuning_seeds, steps=preset.sweep_steps)]
    if preset.horizon_factors:
        rules.append(HORIZON_RULE.format(factors=", ×".join(
            f"{f:g}" for f in preset.horizon_factors)))
    if preset.size_window is not None:
        rules.append(f"A size runs a budget only when it is within {preset.size_window} "
                     f"size(s) of the predicted optimum there.")
    return "\n".join([
        f"preset {preset.name}: {len(sweeps)} LR-sweep runs ({sweep_flops:.3g} FLOPs), "
        f"{len(runs)} {held} runs ({total:.3g} FLOPs), schedule {SCHEDULE_FAMILY} for all", "",
        *seed_lines(preset), "",
        markdown_table(["stage", "seeds", "runs", "steps", "FLOPs"], stage_rows, "llrrr"), "",
        "Pre-registered questions (fixed before anything runs):", "",
        *question_lines(preset.questions), "",
        *rules, "",
        *([f"The envelope PREDICTED from {preset.tokens_per_parameter:g} tokens per "
           f"non-embedding parameter (budget: best size)"
           + ("; the run replaces it by the measured envelope before any chain or held-out run "
              "trains:" if preset.follow == "measured" else " (this preset keeps it):"),
           *predicted, ""] if predicted else []),
        f"{held.capitalize()} runs (chains and held-out sizes on the predicted envelope):", "",
        markdown_table(["arm", "seeds", "sizes@start step", "budget:steps", "steps/seed",
                        "FLOPs/seed", "LR from (per stage)"], rows, "lrllrrl"),
        "time: python benchmarks/frontier_steps.py --preset NAME --cpu-time (measures the step "
        "times here and estimates the whole preset)"])
