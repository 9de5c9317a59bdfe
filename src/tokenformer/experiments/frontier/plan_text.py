"""The plan in words: the chain, LR and horizon rules as stated in ``--plan`` and the report, the
seeds, and ``tokenformer scale --plan``'s text (:func:`describe`; nothing is trained)."""

from __future__ import annotations

from typing import Any

from ...models.config import flops_per_token
from ..common.report import markdown_table
from ..common.stats import ALPHA, paired_power, tost_power
from . import reuse as reuse_
from .arms import CONTINUING_ARMS, GROWING_ARMS
from .chains import predicted_envelope
from .configs import model_configs
from .plan import held_out_seeds, stage_plans, tuning_seeds
from .presets import MAX_EPOCHS, SCHEDULE_FAMILY, Preset, is_tuning_seed, size_key
from .questions import TREND_READINGS, k_label, question_lines
from .schedule import stage_lr_key

# the paired sd of v4's G1 over its 8 held-out seeds (docs/results/frontier-v4): v5's margins and
# power rest on it (docs/frontier-v5.md)
V4_PAIRED_SD = 0.0148

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
    stage_rows = [[name, "tuning" if all(is_tuning_seed(r.seed) for r in rs) else held,
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
    if preset.horizon_extensions or preset.window_extensions:
        rules.append(f"v5: a size whose horizon pick at some budget is an end factor runs one "
                     f"factor beyond it (up to {preset.horizon_extensions} per side); a budget "
                     f"whose tuning optimum is the smallest or largest size run there runs the "
                     f"next size beyond it (up to {preset.window_extensions} per side).")
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
                        "FLOPs/seed", "LR from (per stage)"], rows, "lrllrrl"), "",
        *v5_lines(preset, vocab_size, stages),
        *([f"time (predicted, docs): {preset.expected_hours}"] if preset.expected_hours else []),
        "time: python benchmarks/frontier_steps.py --preset NAME --cpu-time (measures the step "
        "times here and estimates the whole preset)"])


def pattention_share(config: Any, seq_len: int) -> float:
    """The share of a model's training FLOPs per token spent in its Pattention (or, for a
    Transformer, its linear) layers: the attention projections and the FFN of every block over
    the total (the head and the token–token attention are the rest)."""
    f = flops_per_token(config, seq_len, training=True)
    return config.num_layers * (f["attention_pattentions"] + f["ffn"]) / f["total"]


def shape_lines(preset: Preset, vocab_size: int) -> list[str]:
    """Every size of every family the plan trains: non-embedding parameters, training FLOPs per
    token and its Pattention share (issue 46, point 4: a base whose FLOPs are mostly elsewhere
    says little about growing Pattention)."""
    families = list(dict.fromkeys([*preset.families, *reuse_.other_bases(preset)]))
    rows = []
    for family in families:
        for size, config in model_configs(preset, family, vocab_size).items():
            f = flops_per_token(config, preset.seq_len, training=True)
            rows.append([size_key(family, size),
                         f"{config.num_parameters(non_embedding=True):,}",
                         f"{f['total']:,.0f}",
                         f"{pattention_share(config, preset.seq_len):.0%}"])
    return [f"Shapes (context {preset.seq_len}, batch {preset.batch_size}): each size's share "
            f"of training FLOPs in Pattention (attention projections + FFN; Transformer++: its "
            f"linear layers):", "",
            markdown_table(["size", "non-emb. parameters", "training FLOPs/token",
                            "Pattention share"], rows, "lrrr"), ""]


def v5_lines(preset: Preset, vocab_size: int, stages: dict[str, list[Any]]) -> list[str]:
    """v5's additions to the plan (issue 46): the shapes' Pattention shares, the held-out
    documents, the reuse family (its base's training at each k, the X cells, the arms and their
    runs) and each question family's power at its margin."""
    out = shape_lines(preset, vocab_size)
    v = preset.validation
    if v is not None:
        read = ("all of it" if v.tuning_batches is None else
                f"a fixed subset of {v.tuning_batches} batches spread over it")
        out += [f"Validation: >= {v.tokens:,} tokens of whole random documents (seed {v.seed}), "
                f"the first {v.tuning_share:.0%} drawn the tuning window (every run on a tuning "
                f"seed is evaluated on {read}), the rest the scoring window (every held-out "
                f"run, all of it); training reads every other document.", ""]
    if preset.reuse is not None:
        out += reuse_lines(preset, vocab_size, stages)
    out += power_lines(preset, vocab_size)
    return out


def reuse_lines(preset: Preset, vocab_size: int, stages: dict[str, list[Any]]) -> list[str]:
    """The reuse family: the base finished at each k (compute, steps, tokens, its LR rule), the
    X cells of each k with every continuing arm's steps there, and the arms."""
    r = preset.reuse
    assert r is not None
    levels = reuse_.levels(preset, vocab_size)
    cells = reuse_.cells(preset, vocab_size)
    base = reuse_.base_stage(preset, reuse_.TF, vocab_size)
    rows = []
    for j, k in levels.items():
        steps = reuse_.base_steps(preset, reuse_.TF, j, vocab_size)
        xs = ", ".join(f"X {preset.budgets[i] / preset.budgets[j]:.3g} ({preset.budgets[i]:.3g})"
                       for i in cells[j]) or "none (every cell under min_steps)"
        rows.append([f"{k:g}", f"{preset.budgets[j]:.3g}", f"{steps:,}",
                     f"{steps * preset.tokens_per_step:,}", xs])
    arm_rows = []
    for arm in r.arms:
        spec = CONTINUING_ARMS[arm]
        stage = reuse_.continuation_stage(preset, arm, vocab_size)
        runs = [x for x in stages.get("reuse held-out", []) if x.arm.startswith(f"{arm}@")]
        arm_rows.append([arm, spec.family, stage.size,
                         f"{stage.config.num_parameters(non_embedding=True):,}",
                         str(len(runs)), f"{sum(x.total_steps for x in runs):,}", spec.label])
    return [
        f"Reuse family (v5, primary): the base {base.size} "
        f"({base.config.num_parameters(non_embedding=True):,} "
        f"non-embedding parameters) trained from scratch and cooled at k = "
        f"{', '.join(f'{k:g}' for k in levels.values())} tokens per parameter: one stable run "
        f"per (LR, seed), a cooldown branch at each k whose weights are the finished base. Its "
        f"LR at each k: the horizon stage's pick at that budget (×"
        f"{', ×'.join(f'{f:g}' for f in preset.horizon_factors)} of its sweep's pick, "
        f"extended past an edge, on the tuning seeds). Each continuing arm starts a fresh "
        f"AdamW at the base's last batch, warmup {preset.warmup_steps} steps, WSD with a "
        f"cooldown branch at each X cell; its LR is tuned per X cell the same way (×"
        f"{', ×'.join(f'{f:g}' for f in preset.horizon_factors)} of its size's sweep pick). "
        f"Rivals from scratch: {r.final} (R1) and the envelope (R2) at X · C(k). A cell runs "
        f"when every arm trains >= {preset.min_steps} steps there.", "",
        markdown_table(["k", "C(k) FLOPs", "base steps", "base tokens", "X cells (budget)"],
                       rows, "rrrrl"), "",
        markdown_table(["arm", "family", "trains at", "non-emb. parameters", "held-out runs",
                        "steps", "what"], arm_rows, "lllrrrl"), "",
        f"No run reads the training split more than {MAX_EPOCHS:g} times (refused at plan "
        f"time).", ""]


def question_tests(preset: Preset, q: Any, vocab_size: int) -> int:
    """How many tests a question makes: one for "final"; for "all", one per X cell of its k
    (a reuse question, whose a-side is a continuing arm at k) or per budget."""
    if q.budgets == "final":
        return 1
    if preset.reuse is not None:
        cells = reuse_.cells(preset, vocab_size)
        for j, k in reuse_.levels(preset, vocab_size).items():
            if q.a.endswith(f"@{k_label(k)}"):
                return len(cells[j])
    return len(preset.budgets)


def power_lines(preset: Preset, vocab_size: int) -> list[str]:
    """Each question family's power with the held-out seeds at its margin, at v4's paired sd:
    to resolve a true difference of one margin (two-sided) and to show equivalence at a true
    difference of 0 (TOST), at α / m (Holm's first step, so lower bounds for the family)."""
    families: dict[str, list[tuple[Any, int]]] = {}
    for q in preset.questions:
        if q.budgets not in TREND_READINGS and q.margin is not None:
            families.setdefault(q.family, []).append((q, question_tests(preset, q, vocab_size)))
    if not families:
        return []
    n = preset.seeds
    if n < 2:
        return [f"Power: {n} held-out seed, so no question has an interval or a test: the run "
                f"shows the shape of each answer and resolves nothing.", ""]
    rows = []
    for family, qs in families.items():
        m = sum(t for _, t in qs)
        margin = qs[0][0].margin
        rows.append([family, str(m), f"±{margin:g}",
                     f"{paired_power(margin, V4_PAIRED_SD, n, ALPHA / m):.2f}",
                     f"{tost_power(margin, V4_PAIRED_SD, n, alpha=ALPHA / m):.2f}"])
    return [f"Power with {n} held-out seeds at v4's paired sd {V4_PAIRED_SD} (paired t, "
            f"{n - 1} df; at α/m, Holm's first step: lower bounds for a family of m tests):", "",
            markdown_table(["family", "tests m", "margin", "resolve a true ±margin",
                            "show a true 0 equivalent"], rows, "lrrrr"), ""]
