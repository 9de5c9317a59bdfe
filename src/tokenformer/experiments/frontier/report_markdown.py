"""``report.md``'s markdown: one small function per section, each a list of lines (empty when
the run has nothing for it), read off ``results.json`` and :func:`.report.summarize`'s summary;
:func:`report_markdown` puts them in reading order."""

from __future__ import annotations

import math
from typing import Any

from ..common.report import fmt, markdown_table
from ..common.stats import RULE_INTERVAL, describe, format_p, spread
from .analysis import FAMILY_LABEL, arms, as_loss, mean_of, wall_clock
from .arms import GROWING_ARMS
from .plan_text import CHAIN_RULE, LR_RULE
from .presets import PRODUCT_KEY_FAMILIES, THETA_FAMILIES
from .questions import question_lines

# the paired comparisons outside the questions: the same interval, but no decision word
DESCRIPTIVE_RULE = (RULE_INTERVAL + " These intervals are unadjusted for the many comparisons "
                    "made: the decision words belong to the pre-registered answers alone.")


def _p(p: float | None) -> str:
    """A p-value in a table cell: ``0.123``, ``< 0.001`` or — (no test)."""
    return format_p(p).removeprefix("p = ").removeprefix("p ")


def answer_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The answers table's rows: raw and Holm-adjusted p side by side, TOST where asked."""
    out = []
    for r in rows:
        q = r["question"]
        tost = r.get("tost")
        out.append([q["id"], q["family"],
                    (f"slope over {len(r['budgets_read'])} budgets" if r.get("budgets_read")
                     else "—") if r["budget"] is None else f"{r['budget']:.2g}",
                    "no data (an arm did not run)" if not r["diffs"] else
                    f"{r['mean']:+.4f}" + ("" if math.isnan(r["ci_low"]) else
                                           f" [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]"),
                    str(r["n"]), _p(r["p_value"]), _p(r["p_holm"]),
                    "—" if tost is None else
                    f"±{tost['margin']:g}: {_p(tost['p_value'])} (Holm {_p(r['tost_holm'])})",
                    f"**{r['decision']}**"])
    return out


def chain_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Each chain beside the envelope it followed: the measured best size per budget, the
    chain's size there, and whether its final size is the envelope's best at its final
    budget (the rule of :mod:`.chains`' module docstring)."""
    followed = results.get("chain_envelopes") or {}
    growing = [a for a, v in table.items() if v["kind"] in ("chain", "widen")]
    if not growing or not followed:
        return []
    budgets = results["budgets"]
    rows = []
    for arm in growing:
        v = table[arm]
        best = {int(j): z for j, z in followed.get(v["family"], {}).items()}
        final = max(v["sizes"])
        rows.append([arm, " → ".join(f"{st['size']}@{st['start']}" for st in v["stages"]),
                     *(f"{best.get(j, '—')} / {v['sizes'].get(j, '—')}"
                       for j in range(len(budgets))),
                     "yes" if best.get(final) == v["sizes"][final] else "**no**"])
    return ["## Chains follow the envelope", "",
            "Per budget: the family's measured best from-scratch size / the size the chain "
            "cooled down there (— : not read). The last column checks that the chain ends at "
            "the envelope's best size at its final budget.", "",
            markdown_table(["arm", "sizes@start step", *(f"{b:.2g}" for b in budgets),
                            "ends at the best"], rows, "l" * (len(budgets) + 3)), ""]


def lr_text(lr: float | list[float]) -> str:
    """A run's peak LR, or its per-stage LRs in stage order."""
    return " → ".join(f"{x:.3g}" for x in lr) if isinstance(lr, list) else f"{lr:.3g}"


def recipe_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """The growing arms: each one's recipe as the plan defines it, its LR policy and LRs."""
    growing = [a for a, v in table.items() if v["kind"] in ("chain", "widen")]
    if not growing:
        return []
    rows = []
    for arm in growing:
        growing = GROWING_ARMS.get(arm)
        run = next(r for r in results["runs"].values() if r["arm"] == arm)
        rows.append([arm, growing.label if growing else "—", run.get("lr_policy", "final-size"),
                     lr_text(table[arm]["lr"])])
    return ["## Growing arms", "",
            "Every arm that grows, by the recipe the plan defines for it (`GROWING_ARMS` in "
            "`experiments/frontier/arms.py`), its LR policy and its peak LR per stage.", "",
            markdown_table(["arm", "recipe", "LR policy", "peak LR per stage"], rows, "llll"),
            ""]


def report_markdown(results: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    """report.md: its sections in reading order, each a list of lines (empty when the run has
    nothing for it)."""
    table = arms(results)
    sections = [header_lines(results, summary), answer_lines(results, summary),
                descriptive_lines(summary, plots), envelope_lines(results, summary),
                reuse_reach_lines(summary),
                recipe_lines(results, table), chain_lines(results, table),
                every_arm_lines(results, table), tuning_lines(results),
                comparison_lines(summary),
                wall_clock_lines(results, table), sweep_lines(results),
                method_lines(results, table)]
    return "\n".join(line for section in sections for line in section)


def header_lines(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Title, command, machine, wall-clock, data and the pre-registered questions."""
    p = results["preset"]
    m = results["machine"]
    timing = results["timing"]
    return [f"# Loss-vs-compute frontier: preset `{p['name']}`", "",
            f"Command: `{results['command']}`  ",
            f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, torch "
            f"{m['torch']}; Pattention implementation: {results['pattention_impl']}; "
            f"{results['device']} {results['dtype']}.  ",
            f"Wall-clock: {timing['wall_clock']:.0f} s"
            + (" (this invocation resumed an earlier one; runs it loaded are not included)"
               if timing["resumed"] else "") + ".  ",
            f"Data: {results['data']['name']} ({results['data']['train_tokens']:,} training "
            f"tokens), seeds {summary['seeds']}.", "",
            "## Pre-registered questions", "",
            "Fixed in the preset before anything ran (`tokenformer scale --plan` prints "
            "them).", "", *question_lines(p.get("questions") or []), ""]


def answer_lines(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The answers to the pre-registered questions (raw and Holm p, TOST, decision)."""
    if not summary.get("answers"):
        return []
    return ["## Answers", "",
            "Δ = a − b in validation loss, paired by seed: mean [95 % t interval, "
            "unadjusted]; p: paired t-test; Holm: adjusted within the question's family; "
            "TOST: the paired equivalence test at the margin (its p Holm-adjusted over the "
            "family's equivalence questions).", "",
            markdown_table(["id", "family", "budget", "Δ = a − b", "seeds", "p", "Holm p",
                            "TOST", "decision"], answer_rows(summary["answers"]),
                           "llllrrrll"), ""]


def reuse_reach_lines(summary: dict[str, Any]) -> list[str]:
    """v5's incremental compute to reach (:func:`.analysis.reuse_reach`), per reuse cell."""
    rows = []
    for r in summary.get("reuse_reach") or []:
        seeds = ", ".join(f"{s}: {v if isinstance(v, str) else f'{v:.3g}'}"
                          for s, v in r["per_seed"].items())
        interval = (f"{r['ratio']:.3g} [{r['low']:.3g}, {r['high']:.3g}]" if "ratio" in r
                    else "no interval (a seed's rival curve does not reach it: a bound)")
        rows.append([r["question"], f"{r['x']:.3g}", interval, seeds])
    if not rows:
        return []
    return ["## Incremental compute to reach (reuse)", "",
            "The rival's incremental compute X' at which its loss (per seed, linear in log X "
            "between its points) reaches the grown arm's loss at X, as X' / X (> 1: the rival "
            "needs more compute): mean of log2 over seeds back-transformed, with its 95 % t "
            "interval; 'above' / 'below': that seed's rival curve never comes down to it within "
            "its points / is already lower at its smallest (bounds: nothing is imputed).", "",
            markdown_table(["question", "X", "X' / X [95 % interval]", "per seed"], rows,
                           "lrll"), ""]


def descriptive_lines(summary: dict[str, Any], plots: list[str]) -> list[str]:
    """The verdict's prose (unadjusted readings) and the plots."""
    return ["## Descriptive reading", "",
            "Each comparison on its own, without multiplicity correction: what the curves "
            "show, not a verdict (the answers above are).", "",
            *[f"- {line}" for line in summary["verdict"]], "", DESCRIPTIVE_RULE, "",
            *([f"![{name}]({name})" for name in plots] + [""] if plots else [])]


def envelope_lines(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Each family's best from-scratch size per budget and its tokens per parameter."""
    rows = []
    for family, env in summary["envelopes"].items():
        for j, e in sorted(env.items(), key=lambda kv: int(kv[0])):
            rows.append([FAMILY_LABEL[family], f"{results['budgets'][int(j)]:.3g}", e["size"],
                         f"{e['mean']:.4f}", f"{e['non_embedding_parameters']:,}",
                         f"{e['tokens']:,.0f}",
                         f"{e['tokens'] / e['non_embedding_parameters']:.1f}"])
    return ["## Envelopes: the best from-scratch size per budget", "",
            "Tokens per parameter of the envelope's size (training tokens / non-embedding "
            "parameters) is this setup's measured compute-optimal ratio at that budget.", "",
            markdown_table(["family", "budget (FLOPs)", "best size", "loss",
                            "non-emb. params", "tokens", "tokens/param"], rows, "llllrrr"), ""]


def every_arm_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Every arm's loss at every budget (mean ± sample std over seeds)."""
    header = ["arm", "LR", *(f"{b:.2g}" for b in results["budgets"])]
    rows = []
    for arm, v in table.items():
        cells = []
        for j in range(len(results["budgets"])):
            seeds = v["budgets"].get(j)
            if not seeds:
                cells.append("—")
                continue
            s = spread(x[0] for x in seeds.values())
            cells.append(str(s) if math.isfinite(s.mean) else f"{s.mean:.4f}")
        rows.append([arm, lr_text(v["lr"]), *cells])
    return ["## Every arm", "",
            "Validation loss at each budget (mean ± sample std over seeds; — : the size "
            "would train fewer than min_steps steps at that budget).", "",
            markdown_table(header, rows, "l" * len(header)), ""]


def comparison_lines(summary: dict[str, Any]) -> list[str]:
    """The paired comparisons outside the questions, each on its own."""
    if not summary["comparisons"]:
        return []
    rows = [[c["question"], f"{c['budget']:.2g}", c["a"], c["b"], describe(c), str(c["n"]),
             c["verdict"]] for c in summary["comparisons"]]
    return ["## Paired comparisons (unadjusted)", "", "Δ = a − b in validation loss: "
            "mean [95 % interval], p; each on its own (no multiplicity correction).", "",
            markdown_table(["comparison", "budget", "a", "b", "Δloss", "seeds", "unadjusted"],
                           rows, "lrlllrl"), ""]


def wall_clock_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Measured seconds per step of each from-scratch arm and its loss at the seconds of each
    budget (the machine's, not the FLOP count's)."""
    clock = wall_clock(results)
    if not clock:
        return []
    dense = {w["size"]: w["seconds_per_step"] for w in clock.values()
             if w["family"] == "tokenformer"}
    rows = []
    for arm, w in clock.items():
        sps = w["seconds_per_step"]
        cells = []
        for j in range(len(results["budgets"])):
            seeds = table[arm]["budgets"].get(j)
            cells.append("—" if not seeds else
                         f"{mean_of([x[0] for x in seeds.values()]):.4f} @ "
                         f"{w['seconds'][j]:.0f} s")
        rows.append([arm, f"{1000 * sps:.1f}",
                     f"{sps / dense[w['size']]:.2f}x" if w["size"] in dense else "—", *cells])
    return ["## Wall-clock", "",
            "Measured seconds per training step of each from-scratch arm (mean over its "
            "seeds' final runs, from the trainer's tokens/s; the machine and its load at "
            "the time, not the FLOP count) and, per budget, the mean loss at the training "
            "seconds of that budget's run (steps × s/step; evaluation excluded). Equal "
            "FLOPs per token do not mean equal time.", "",
            markdown_table(["arm", "ms/step", "vs dense TokenFormer",
                            *(f"{b:.2g} FLOPs" for b in results["budgets"])], rows,
                           "lrr" + "l" * len(results["budgets"])), ""]


def sweep_lines(results: dict[str, Any]) -> list[str]:
    """The LR sweeps: each grid's losses, the choice and its flags."""
    p = results["preset"]
    growth = bool(p.get("recipes") or p.get("chains") or p.get("widenings"))
    rows = []
    for key, s in results["sweeps"].items():
        rows.append([key, ", ".join(f"{q['lr']:.3g}: {fmt(as_loss(q['loss']))}"
                                    for q in s["points"]), f"{s['chosen']:.3g}",
                     "**at the edge**" if s["at_edge"] else ("extended: " + ", ".join(
                         f"{x:.3g}" for x in s["added"]) if s["added"] else "inside"),
                     {True: "yes", False: "**no**"}.get(s.get("unimodal"), "—"),
                     ", ".join(f"{x:.3g}" for x in s.get("seed_argmins", ())) or "—"])
    return ["## LR sweeps", "",
            LR_RULE.format(seeds=p.get("tuning_seeds", p.get("sweep_seeds", 1)),
                           steps=p["sweep_steps"])
            + f" At most {p['max_extensions']} extensions per side; a choice still at an "
              f"edge is flagged. Loss: the mean over the sweep seeds."
            + (" Growing arms: `per-stage` trains each stage at its own size's chosen LR "
               "(the peak moves at once at the growth step; a half-depth or half-width first "
               "stage takes the LR of the swept size nearest in non-embedding parameters), "
               "`final-size` the whole run at its final size's LR." if growth else ""), "",
            markdown_table(["family-size", "LR: loss", "chosen", "grid", "unimodal",
                            "each seed's argmin"], rows, "llllll"), ""]


def tuning_lines(results: dict[str, Any]) -> list[str]:
    """v4: what the tuning seeds chose (each envelope's (size, LR) per budget with the tuning
    values it rests on, each size's horizon LR, each growing arm's factor) and the growth
    diagnostics; nothing here is a held-out number."""
    tuning = results.get("tuning") or {}
    if "envelope" not in tuning:
        return []
    budgets = results["budgets"]
    rows = []
    for family, env in tuning["envelope"].items():
        for j, e in sorted(env.items(), key=lambda kv: int(kv[0])):
            rows.append([FAMILY_LABEL.get(family, family), f"{budgets[int(j)]:.2g}", e["size"],
                         f"{e['lr']:.3g}", f"{e['tuning_mean']:.4f}",
                         ", ".join(f"{z} {c['mean']:.4f} @ {c['lr']:.3g}"
                                   for z, c in e["candidates"].items()),
                         "**edge**" if e["at_grid_edge"] else "inside"])
    lr_rows = [[key, f"{h['lr0']:.3g}", *(
        ("—" if str(j) not in h["budgets"] else
         f"{h['budgets'][str(j)]['chosen']:.3g} (×{h['budgets'][str(j)]['factor']:g})"
         + (" **edge**" if h["budgets"][str(j)]["at_edge"] else ""))
        for j in range(len(budgets)))] for key, h in tuning["horizon"].items()]
    chain_rows = [[arm, " → ".join(f"{x:.3g}" for x in c["policy_lrs"]),
                   ", ".join(f"{_grid_point(q)}: {q['mean']:.4f}" for q in c["points"]),
                   _grid_point(c) + (" **edge**" if c["at_edge"] else "")]
                  for arm, c in (tuning.get("chains") or {}).items()]
    reuse_rows = [[arm, f"{cell['x']:.3g}", f"{r['lr0']:.3g} ({r['lr_from']})",
                   ", ".join(f"×{q['factor']:g}: " + ("—" if q["mean"] is None else
                                                       f"{q['mean']:.4f}")
                             for q in cell["points"]),
                   f"{cell['chosen']:.3g} (×{cell['factor']:g})"
                   + (" **edge**" if cell["at_edge"] else "")]
                  for arm, r in (tuning.get("reuse") or {}).items()
                  for cell in r["cells"].values()]
    return ["## Tuning seeds: what they chose", "",
            f"Tuning seeds {tuning['seeds']} chose every LR and every best size; held-out seeds "
            f"{tuning['held_out_seeds']} score them (every number above). Envelope per budget: "
            f"the (size, LR) with the lowest tuning mean; candidates: each size's tuning mean "
            f"at its chosen LR; edge: the pick is the smallest or largest size run there.", "",
            markdown_table(["family", "budget", "size", "LR", "tuning mean", "candidates",
                            "grid"], rows, "lllllll"), "",
            "Horizon LRs (tuning seeds, full length): per size, the short sweep's pick and the "
            "LR chosen at each budget (its factor; edge: an end of the factors).", "",
            markdown_table(["size", "sweep pick", *(f"{b:.2g}" for b in budgets)], lr_rows,
                           "l" * (len(budgets) + 2)), "",
            *(["Growing arms (tuning seeds, their final budget): the policy's LRs and each "
               "factor's tuning mean.", "",
               markdown_table(["arm", "policy LRs", "factor: tuning mean", "chosen"],
                              chain_rows, "llll"), ""] if chain_rows else []),
            *(["Reuse continuations (v5; tuning seeds, per X cell): each factor of its size's "
               "sweep pick and its tuning mean; the chosen LR is what its held-out runs use "
               "(— : one factor, not tuned).", "",
               markdown_table(["arm", "X", "sweep pick", "factor: tuning mean", "chosen"],
                              reuse_rows, "lllll"), ""] if reuse_rows else []),
            *diagnostic_lines(results)]


def _grid_point(c: dict[str, Any]) -> str:
    """A chain's tuning grid point: ``×2`` (v4), ``×2, small ×1, growth ×0.5`` (v5)."""
    small, growth = c.get("small"), c.get("growth", 1.0)
    if small is None and growth == 1.0:
        return f"×{c['factor']:g}"
    return f"×{c['factor']:g}, small ×{small if small is not None else c['factor']:g}, " \
           f"growth ×{growth:g}"


def diagnostic_lines(results: dict[str, Any]) -> list[str]:
    """After each growth of a token chain: old vs new tokens' mean row norm and mean |Δ| of the
    first step after it (mean over held-out seeds and layers), per Pattention kind."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in results["runs"].values()):
        runs = [r for r in results["runs"].values()
                if r["arm"] == arm and r.get("growth_diagnostics")]
        if not runs:
            continue
        for i, first in enumerate(runs[0]["growth_diagnostics"]):
            for name in first["tensors"]:
                vals = [r["growth_diagnostics"][i]["tensors"][name] for r in runs
                        if i < len(r["growth_diagnostics"])]
                rows.append([arm, f"{first['step']}", f"{first['from']} → {first['to']}", name,
                             *(f"{mean_of([v[k] for v in vals]):.3g}"
                               for k in ("old_norm", "new_norm", "old_update", "new_update"))])
    if not rows:
        return []
    return ["## Growth diagnostics", "",
            "After each growth: mean L2 norm of the old and the new parameter-token rows, and "
            "the mean |Δ| of one optimizer step (the first after the growth) on each; mean over "
            "held-out seeds and layers.", "",
            markdown_table(["arm", "step", "sizes", "tensor", "old norm", "new norm",
                            "old |Δ|", "new |Δ|"], rows, "llllrrrr"), ""]


def method_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Sizes, schedule, growth operators, FLOP count and pairing, from the preset."""
    p = results["preset"]
    pk = [f for f in p["families"] if f in PRODUCT_KEY_FAMILIES]
    growth = bool(p.get("recipes") or p.get("chains") or p.get("widenings"))
    first = p.get("first_size", 1)
    sizes = f"S{first}…S{first + p['num_sizes'] - 1}" if "num_sizes" in p else "S1…"
    pk_stages = [v["stages"][0] for v in table.values()
                 if v["kind"] == "scratch" and v["family"] in pk]
    # what ran, not a formula: v4 scales Transformer++ by width (MLP 8/3·d), v3 matched its MLP
    tpp = sorted({(v["stages"][0]["non_embedding_parameters"], v["stages"][0]["size"],
                   v["stages"][0]["config"].get("hidden_size"),
                   v["stages"][0]["config"].get("intermediate_size"))
                  for v in table.values()
                  if v["kind"] == "scratch" and v["family"] == "transformer++"})
    tpp_text = ("Transformer++ (SwiGLU, RMSNorm, rotary) by width, MLP = 8/3·d: "
                + ", ".join(f"{size} d {d} MLP {mlp} ({n:,} non-emb. parameters)"
                            for n, size, d, mlp in tpp)
                if p.get("tpp_widths") else
                "Transformer++ matched to each in non-embedding parameters (MLP width)")
    thetas = [f for f in p["families"] if f in THETA_FAMILIES]
    return ["## Method", "",
            f"- Sizes {sizes}: TokenFormer d = {p['hidden_size']}, {p['num_layers']} layers, "
            f"{p['num_heads']} heads, (qkv, proj, ffn) tokens {tuple(p['base_tokens'])} × "
            f"{p['factor']}^(k−1) for Sk; {tpp_text}. Batch {p['batch_size']} × "
            f"{p['seq_len']} tokens.",
            *[f"- {FAMILY_LABEL[f]}: TokenFormer's sizes with Θ = {THETA_FAMILIES[f]} (no "
              f"normalisation: every Pattention is a two-layer MLP with that activation, its "
              f"keys the first layer's weight and its values the second's)." for f in thetas],
            *([f"- Product-key families ({', '.join(pk)}): size Si is TokenFormer Si with "
               f"its FFN Pattention replaced by product keys (`ffn_keys=\"product\"`) over "
               f"n = s² ≈ R × Si's FFN tokens (s the integer nearest √(R·n)) and the top-k "
               f"whose analytic FFN FLOPs/token (sub-key scores 2·s·d, min(k, s)² candidate "
               f"sums, Θ over k, k value rows 2·k·d) are closest to the dense FFN's (within "
               f"1 %): equal FLOPs per token, many times the parameters. Sizes: "
               + "; ".join(f"{st['size']} n = {st['config']['ffn_tokens']:,}, k = "
                           f"{st['config']['ffn_product_k']}, "
                           f"{st['non_embedding_parameters']:,} non-emb. parameters"
                           for st in pk_stages) + "."] if pk else []),
            f"- One schedule family for every arm: WSD, {p['warmup_steps']} warmup steps, "
            f"stable at the peak LR, linear cooldown to {p['min_lr_ratio']} × peak over the "
            f"last {p['decay_fraction']:.0%} of a budget's steps, branched off the stable run "
            f"at each budget ({p['num_budgets']} budgets, ×{p['budget_ratio']:g} apart, up to "
            f"{p['max_budget']:.3g} FLOPs). AdamW β (0.9, 0.95), weight decay "
            f"{p['weight_decay']}, clipping {p['grad_clip']}.",
            *([f"- {CHAIN_RULE.format(share=p.get('min_stage_share', 0.4))} Growth happens "
               f"in the stable phase; AdamW moments carried, new rows' second moments "
               f"`{p['new_row_moments']}`; a branch cools down the size reached at its decay "
               f"start. `exact-anneal`: exact growth, then Θ's factor moves linearly from its "
               f"held value to √n of the new size over {p['anneal_steps']} steps. "
               f"`official-released`: a fresh AdamW and a linear warmup again over "
               f"{p['warmup_steps']} steps at each growth (the released run's restart; its "
               f"new decay is each budget's cooldown, as for every arm). `*-stack` (G_stack): "
               f"the final size at half depth, its blocks repeated in order at the growth "
               f"(moments copied). `widen-duplicate` (HyperCloning): the final Transformer++ "
               f"size at half hidden size and heads, every width axis duplicated with "
               f"zero-sum noise (function-preserving), moments tiled and rescaled. `widen-*` "
               f"by size: the Transformer++ chain grown by MLP widening (zero: new units' "
               f"outgoing weights zero; net2net: duplicated units, split outgoing weights), "
               f"moments carried (new units zero). `chain-gelu`: the plain-GELU control grown "
               f"with zero new keys (exactly function-preserving for that Θ)."]
              if growth else []),
            "- FLOPs: `flops_per_token(config, seq_len, training=True)` × tokens (matmuls "
            "2·m·n·k, token-token attention over the full context T, backward = 2× forward); "
            "evaluation not counted. Validation loss on "
            f"{p['eval_batches']} fixed batches of the held-out split at each branch's end.",
            "- Every run of a seed sees the same batches (a pure function of seed and step), "
            "so differences between arms are paired by seed.", ""]
