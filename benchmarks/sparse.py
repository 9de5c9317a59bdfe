"""Parameter tokens as experts (issue 18, docs/sparse.md): what top-k Pattention and pruning cost.

    python benchmarks/sparse.py quality RUN/final          # Δ val loss vs k/n, natural sparsity
    python benchmarks/sparse.py prune RUN/final --finetune-steps 100   # val loss vs pruned %
    python benchmarks/sparse.py speed --preset tokenformer-150m        # decode / prefill tok/s
    python benchmarks/sparse.py product-speed --preset small           # train tok/s, equal FLOPs
    python benchmarks/sparse.py product-profile --preset small         # where that time goes

All with one thread (``--threads``, default 1). ``quality``/``prune`` evaluate on the held-out
split of the embedded corpus (the trainer's evaluator: fixed windows, ``--eval-batches`` × 16 ×
256 tokens). Prints a markdown section for benchmarks/RESULTS.md and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, interleaved, log, machine

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.loading import load_model
from tokenformer.model import KVCache
from tokenformer.pattention import Pattention, set_pattention_top_k, theta
from tokenformer.prune import prune

FRACTIONS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)
PRUNED = (0.0, 0.25, 0.5, 0.75)


def evaluator(model: torch.nn.Module, eval_batches: int, seq_len: int = 256):
    from tokenformer.data import default_dataset
    from tokenformer.train import lm_evaluator

    dataset = default_dataset("bytes", progress=False)
    seq = min(seq_len, model.config.max_seq_len)
    return lm_evaluator(dataset, seq, 16, eval_batches, torch.device("cpu")), dataset


@torch.no_grad()
def natural_sparsity(model: torch.nn.Module, ids: torch.Tensor, rel: float = 1e-3
                     ) -> dict[str, float]:
    """Per Pattention: the fraction of Θ entries with |Θ| < rel · (the row's max |Θ|)."""
    out: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Pattention):
            def hook(m, args, _o, name=name):
                x = args[0].float().reshape(-1, m.in_features)
                th = theta(x @ m.key_param_tokens.float().t(), m.norm, m.scale, m.eps).abs()
                out[name] = float((th < rel * th.amax(dim=-1, keepdim=True)).float().mean())
            hooks.append(m.register_forward_hook(hook))
    model(ids)
    for h in hooks:
        h.remove()
    return out


def quality(args: argparse.Namespace) -> dict:
    model = load_model(args.model).eval()
    evaluate, dataset = evaluator(model, args.eval_batches)
    with torch.no_grad():
        dense = evaluate(model)["val_loss"]
        rows = []
        for kinds in (("qkv",), ("proj",), ("ffn",), ("qkv", "proj", "ffn")):
            for f in FRACTIONS[1:]:
                set_pattention_top_k(model, **{k: f for k in kinds})
                loss = evaluate(model)["val_loss"]
                rows.append({"kinds": "+".join(kinds), "fraction": f, "val_loss": loss,
                             "delta": loss - dense})
                log(f"{'+'.join(kinds):>14} k/n={f:<7.4g} val {loss:.4f} Δ {loss - dense:+.4f}")
            set_pattention_top_k(model)
        ids = next(iter(dataset.eval_windows("val", 256, 16, max_batches=1)))
        sparsity = natural_sparsity(model, ids)
    c = model.config
    lines = [f"Model {args.model}: {c.num_layers} layers, d={c.hidden_size}, n = {c.qkv_tokens}/"
             f"{c.proj_tokens}/{c.ffn_tokens} (qkv/proj/ffn); dense val loss {dense:.4f} nats/token"
             f" ({args.eval_batches}×16×256 held-out tokens).", "",
             "| top-k applied to | " + " | ".join(f"k/n = 1/{round(1 / f)}" for f in FRACTIONS[1:])
             + " |", "|---|" + "---:|" * (len(FRACTIONS) - 1)]
    for kinds in ("qkv", "proj", "ffn", "qkv+proj+ffn"):
        cells = [f"{r['delta']:+.4f}" for r in rows if r["kinds"] == kinds]
        lines.append(f"| {kinds} | " + " | ".join(cells) + " |")
    lines += ["", "Δ val loss (nats/token) vs dense. Natural sparsity, fraction of |Θ| < 1e-3 × "
              "row max, per layer:", "", "| layer | q | k | v | proj | ffn |",
              "|---|---:|---:|---:|---:|---:|"]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        vals = [sparsity[p + s] for s in ("attention.query", "attention.key", "attention.value",
                                          "attention.proj", "mlp")]
        lines.append(f"| {i} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return {"markdown": "\n".join(lines), "dense": dense, "rows": rows, "sparsity": sparsity}


def finetune(model: torch.nn.Module, steps: int, lr: float, workdir: Path) -> torch.nn.Module:
    """``steps`` steps of the trainer (demo config, constant LR after 10 warmup steps) from
    ``model``, through the CLI's --init-from, as a user would."""
    src, out = workdir / "in", workdir / "out"
    model.save(src)
    cmd = [sys.executable, "-m", "tokenformer", "train", "--config", "demo", "--init-from",
           str(src), "--steps", str(steps), "--lr", str(lr), "--min-lr", str(lr), "--schedule",
           "constant", "--warmup-steps", "10", "--threads", "1", "--out", str(out),
           "--samples", "0", "--eval-interval", "0", "--eval-batches", "1",
           "--checkpoint-interval", "0", "--no-progress", "--arch",
           getattr(model.config, "arch", "tokenformer")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return load_model(out / "final").eval()


def prune_curve(args: argparse.Namespace) -> dict:
    model = load_model(args.model).eval()
    evaluate, dataset = evaluator(model, args.eval_batches)
    calib = next(iter(dataset.eval_windows("train", 256, 8, max_batches=1)))
    rows = []
    c = model.config
    for frac in PRUNED:
        sizes = {k: max(1, round(getattr(c, f"{k}_tokens") * (1 - frac)))
                 for k in ("qkv", "proj", "ffn")}
        for by in args.by:
            for scale in args.scales:
                small = prune(model, **sizes, by=by, calibration=calib, scale=scale).eval()
                with torch.no_grad():
                    loss = evaluate(small)["val_loss"]
                row = {"pruned": frac, "by": by, "scale": scale, "val_loss": loss,
                       "params": small.num_parameters(), "finetuned": None}
                if args.finetune_steps and scale == args.scales[0]:
                    with tempfile.TemporaryDirectory() as tmp:
                        tuned = finetune(small, args.finetune_steps, args.finetune_lr, Path(tmp))
                    with torch.no_grad():
                        row["finetuned"] = evaluate(tuned)["val_loss"]
                log(f"pruned {frac:.0%} by {by} scale {scale}: {loss:.4f} "
                    f"fine-tuned {row['finetuned']}")
                rows.append(row)
                if frac == 0.0:
                    break
            if frac == 0.0:
                break
    lines = [f"Model {args.model}: every Pattention (qkv/proj/ffn) pruned by the same fraction; "
             f"val loss nats/token ({args.eval_batches}×16×256 held-out tokens); calibration: 8"
             f"×256 training tokens; fine-tune: {args.finetune_steps} trainer steps at constant "
             f"lr {args.finetune_lr} (demo config, batch 16×256).", "",
             "| pruned | by | Θ factor | parameters | val loss | after fine-tune |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        ft = f"{r['finetuned']:.4f}" if r["finetuned"] is not None else "–"
        lines.append(f"| {r['pruned']:.0%} | {r['by']} | {r['scale']} | {r['params']:,} | "
                     f"{r['val_loss']:.4f} | {ft} |")
    return {"markdown": "\n".join(lines), "rows": rows}


@torch.no_grad()
def prune_mlp(model: torch.nn.Module, width: int) -> torch.nn.Module:
    """A Transformer baseline with every MLP cut to its ``width`` largest-magnitude neurons:
    neuron i scores ‖up_i‖·‖down_:,i‖ (× ‖gate_i‖ for SwiGLU), the usual magnitude criterion."""
    import dataclasses

    new = type(model)(dataclasses.replace(model.config, intermediate_size=width))
    state = model.state_dict()
    for i, block in enumerate(model.layers):
        mlp, p = block.mlp, f"layers.{i}.mlp."
        score = mlp.up.weight.norm(dim=1) * mlp.down.weight.norm(dim=0)
        if mlp.gate is not None:
            score = score * mlp.gate.weight.norm(dim=1)
        keep = score.topk(width).indices.sort().values
        for name in ("up", "gate"):
            for leaf in ("weight", "bias"):
                if f"{p}{name}.{leaf}" in state:
                    state[f"{p}{name}.{leaf}"] = state[f"{p}{name}.{leaf}"][keep]
        state[f"{p}down.weight"] = state[f"{p}down.weight"][:, keep]
    new.load_state_dict(state, strict=True)
    return new.eval()


def compare_mlp(args: argparse.Namespace) -> dict:
    """FFN-only pruning: TokenFormer FFN tokens (by contribution, Θ factor held) vs the
    Transformer++ MLP neurons (magnitude), same fractions, same fine-tune recipe."""
    tf, tpp = load_model(args.tokenformer).eval(), load_model(args.transformer).eval()
    evaluate, dataset = evaluator(tf, args.eval_batches)
    calib = next(iter(dataset.eval_windows("train", 256, 8, max_batches=1)))
    rows = []
    for frac in PRUNED:
        n = round(tf.config.ffn_tokens * (1 - frac))
        w = round(tpp.config.intermediate_size * (1 - frac))
        for arch, small in (("tokenformer", prune(tf, ffn=n, calibration=calib).eval()),
                            ("transformer++", prune_mlp(tpp, w))):
            with torch.no_grad():
                loss = evaluate(small)["val_loss"]
            tuned = None
            if args.finetune_steps:
                with tempfile.TemporaryDirectory() as tmp:
                    tuned_model = finetune(small, args.finetune_steps, args.finetune_lr,
                                           Path(tmp))
                with torch.no_grad():
                    tuned = evaluate(tuned_model)["val_loss"]
            rows.append({"pruned": frac, "arch": arch, "val_loss": loss, "finetuned": tuned,
                         "params": small.num_parameters()})
            log(f"{arch} ffn pruned {frac:.0%}: {loss:.4f} fine-tuned {tuned}")
    lines = [f"FFN-only pruning. TokenFormer {args.tokenformer} (FFN tokens, by contribution, Θ "
             f"factor held) vs Transformer++ {args.transformer} (MLP neurons by magnitude), both "
             f"trained with the same config; val loss nats/token ({args.eval_batches}×16×256 "
             f"held-out tokens); fine-tune {args.finetune_steps} steps at constant lr "
             f"{args.finetune_lr}.", "",
             "| FFN pruned | arch | parameters | val loss | after fine-tune |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        ft = f"{r['finetuned']:.4f}" if r["finetuned"] is not None else "–"
        lines.append(f"| {r['pruned']:.0%} | {r['arch']} | {r['params']:,} | "
                     f"{r['val_loss']:.4f} | {ft} |")
    return {"markdown": "\n".join(lines), "rows": rows}


@torch.no_grad()
def speed(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name(args.preset)
    model = TokenFormerLM(config).eval()
    T, pos = args.prefill, args.position
    prompt = torch.randint(0, config.vocab_size, (1, T))
    cache = KVCache(config.num_layers, config.max_seq_len)
    model(torch.randint(0, config.vocab_size, (1, pos)), past_key_values=cache, use_cache=True)
    token = torch.randint(0, config.vocab_size, (1, 1))
    arms = {"dense": None, **{f"k/n=1/{round(1 / f)}": f for f in args.fractions}}

    def decode(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(token, past_key_values=cache, use_cache=True)
            cache.lengths = [pos] * config.num_layers
        return run

    def prefill(f):
        def run():
            set_pattention_top_k(model, qkv=f, proj=f, ffn=f)
            model(prompt, logits_to_keep=1)
        return run

    dec = interleaved({a: decode(f) for a, f in arms.items()}, args.rounds)
    pre = interleaved({a: prefill(f) for a, f in arms.items()}, max(2, args.rounds // 4), 1)
    lines = [f"Preset {args.preset} (random weights, fp32), {torch.get_num_threads()} thread; "
             f"top-k applied to every Pattention. Decode: one cached step at position {pos}, "
             f"batch 1, {args.rounds} interleaved rounds; prefill: {T} tokens, batch 1. tokens/s "
             f"from the minimum (median in brackets).", "",
             "| arm | decode tok/s | vs dense | prefill tok/s | vs dense |",
             "|---|---:|---:|---:|---:|"]
    for a in arms:
        d, p = dec[a], pre[a]
        lines.append(f"| {a} | {1 / d['min']:.2f} ({1 / d['median']:.2f}) | "
                     f"{dec['dense']['min'] / d['min']:.2f}x | {T / p['min']:.1f} "
                     f"({T / p['median']:.1f}) | {pre['dense']['min'] / p['min']:.2f}x |")
    return {"markdown": "\n".join(lines), "decode": dec, "prefill": pre}


def matched_k(dense: TokenFormerConfig, ffn_tokens: int) -> int:
    """The product-key k whose FFN forward FLOPs/token (config.projection_flops) come closest to
    ``dense``'s dense FFN at ``ffn_tokens`` = s² product keys."""
    target = dense.projection_flops()[1]
    best = min(range(1, ffn_tokens + 1), key=lambda k: abs(TokenFormerConfig.from_dict(
        {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": ffn_tokens,
         "ffn_product_k": k}).projection_flops()[1] - target))
    return best


def product_speed(args: argparse.Namespace) -> dict:
    """Train step tokens/s (forward, backward, AdamW) of dense vs product-key FFN TokenFormers
    of equal FFN FLOPs/token, and of the FFN alone, interleaved."""
    dense = TokenFormerConfig.from_name(args.preset)
    arms = {"dense": dense}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} ({mult}x) k={k}"] = TokenFormerConfig.from_dict(
            {**dense.to_dict(), "ffn_keys": "product", "ffn_tokens": n, "ffn_product_k": k})
    B, T = args.batch, min(args.seq_len, dense.max_seq_len)
    ids = torch.randint(0, dense.vocab_size, (B, T))
    steps, ffn_steps, info = {}, {}, {}
    for name, config in arms.items():
        torch.manual_seed(0)
        model = TokenFormerLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(B, T, config.hidden_size, requires_grad=True)
        mlp = model.layers[0].mlp

        def step(model=model, opt=opt):
            loss = model(ids, labels=ids).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        def ffn(mlp=mlp, x=x):
            mlp(x).square().mean().backward()

        steps[name], ffn_steps[name] = step, ffn
        info[name] = (config.num_parameters(), 3 * config.projection_flops()[1])
    whole = interleaved(steps, args.rounds, 1)
    alone = interleaved(ffn_steps, args.rounds, 1)
    lines = [f"Preset {args.preset} (d={dense.hidden_size}, {dense.num_layers} layers, dense "
             f"ffn_tokens {dense.ffn_tokens}); fp32, {torch.get_num_threads()} thread, batch "
             f"{B}×{T}; k chosen so the FFN's forward FLOPs/token match dense "
             f"(config.projection_flops); {args.rounds} interleaved rounds, tokens/s from the "
             f"minimum.", "",
             "| arm | parameters | FFN train FLOPs/token | train step tok/s | vs dense | "
             "FFN fwd+bwd tok/s | vs dense |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name in arms:
        w, a = whole[name]["min"], alone[name]["min"]
        lines.append(f"| {name} | {info[name][0]:,} | {info[name][1]:,.0f} | {B * T / w:,.0f} | "
                     f"{whole['dense']['min'] / w:.2f}x | {B * T / a:,.0f} | "
                     f"{alone['dense']['min'] / a:.2f}x |")
    return {"markdown": "\n".join(lines), "whole": whole, "ffn": alone}


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


def product_profile(args: argparse.Namespace) -> dict:
    """Where a product-key FFN's forward+backward time goes (torch.profiler, self CPU time by
    op), for the FLOP-matched arms of ``product-speed``, next to the dense FFN."""
    from torch.profiler import ProfilerActivity, profile

    from tokenformer.product_keys import ProductKeyPattention

    dense = TokenFormerConfig.from_name(args.preset)
    d = dense.hidden_size
    x = torch.randn(args.rows, d, requires_grad=True)
    arms = {f"dense n={dense.ffn_tokens}": Pattention(d, d, dense.ffn_tokens)}
    for mult in args.multipliers:
        n = round((dense.ffn_tokens * mult) ** 0.5) ** 2
        k = matched_k(dense, n)
        arms[f"product n={n} k={k}"] = ProductKeyPattention(d, d, n, k)
    lines = [f"FFN alone (preset {args.preset}: d={d}), {args.rows} rows, forward + backward, "
             f"3 profiled calls after 2 warm-up calls, 1 thread; self CPU time by op (top 6).",
             ""]
    out = {}
    for name, m in arms.items():
        for _ in range(2):
            m(x).square().mean().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                m(x).square().mean().backward()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        top = [(e.key, e.self_cpu_time_total / total) for e in events[:6]]
        out[name] = {"total_ms": total / 1e3 / 3, "top": top}
        lines.append(f"- **{name}**: {total / 1e3 / 3:.1f} ms per call; "
                     + ", ".join(f"{k} {f:.0%}" for k, f in top))
    return {"markdown": "\n".join(lines), "arms": out}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the thread's CPU time (robust on a shared machine)")
    parser.add_argument("--json", default=None, help="also write the results here")
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("model")
    q.add_argument("--eval-batches", type=int, default=8)
    p = sub.add_parser("prune")
    p.add_argument("model")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--by", nargs="+", default=["contribution", "mass", "value"])
    p.add_argument("--scales", nargs="+", default=["hold", "renorm"])
    p.add_argument("--finetune-steps", type=int, default=0)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    s = sub.add_parser("speed")
    s.add_argument("--preset", default="tokenformer-150m")
    s.add_argument("--prefill", type=int, default=256)
    s.add_argument("--position", type=int, default=128)
    s.add_argument("--rounds", type=int, default=12)
    s.add_argument("--fractions", type=float, nargs="+", default=[1 / 4, 1 / 16])
    k = sub.add_parser("product-speed")
    k.add_argument("--preset", default="small")
    k.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--seq-len", type=int, default=256)
    k.add_argument("--rounds", type=int, default=6)
    f = sub.add_parser("product-profile")
    f.add_argument("--preset", default="small")
    f.add_argument("--multipliers", type=int, nargs="+", default=[16, 64])
    f.add_argument("--rows", type=int, default=2048)
    m = sub.add_parser("compare-mlp")
    m.add_argument("tokenformer")
    m.add_argument("transformer")
    m.add_argument("--eval-batches", type=int, default=8)
    m.add_argument("--finetune-steps", type=int, default=0)
    m.add_argument("--finetune-lr", type=float, default=1e-3)
    g = sub.add_parser("plot")
    g.add_argument("quality_json")
    g.add_argument("prune_json")
    g.add_argument("--out", default="docs/img/sparse")
    args = parser.parse_args(argv)
    if args.what == "plot":
        plot(args.quality_json, args.prune_json, args.out)
        return
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        import time

        import common

        common.CLOCK = time.thread_time
    result = {"quality": quality, "prune": prune_curve, "speed": speed,
              "product-speed": product_speed, "product-profile": product_profile,
              "compare-mlp": compare_mlp}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in result.items()
                                               if k != "markdown"}, indent=1) + "\n")
    print(f"### Sparse Pattention: {args.what}\n\nCommand: `{command_line()}`  \n"
          f"CPU: {machine()} (cores shared with other jobs)\n\n{result['markdown']}\n")


if __name__ == "__main__":
    main()
