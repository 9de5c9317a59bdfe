"""Stage ``train``: training tokens/s and MFU (bf16 autocast, seq 2048, batch 8, the real loop
``tokenformer.train.fit``, AdamW and clipping) of the models of :func:`catalog`, eager and/or
compiled, interleaved in one run; MFU against the bf16 matmul rate measured on the same GPU; for
each compiled model the count of inductor's "assuming every input is mutated" warnings (a
Triton kernel whose accesses it could not analyse: every input is then copied); then a profile of
one step of each (top kernels by device time, and the time in GEMMs, attention, the Triton Θ and
the rest).

On CUDA each (model, mode) is a worker process (``workers``): all compile at once, then the
rounds are timed one process at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import log, synchronized
from train_throughput import Trainer, matmul_ceiling

from tokenformer import Pattention, TokenFormerLM, flops_per_token
from tokenformer.models.baselines import TransformerConfig, TransformerLM, matched_config
from tokenformer.nn.grouped import set_grouped_qkv
from tokenformer.nn.kernels.dispatch import select_impl
from tokenformer.nn.pattention import set_pattention_impl

from .base import (
    COMPILE_MODES,
    Sizes,
    StageContext,
    neox_flops_config,
    neox_model,
    non_embedding_parameters,
    tokenformer_config,
)
from .kernels import kernel_summary, profile_table, profiled
from .workers import Pool, WorkerError, interleave, until

MUTATED = "assuming every input is mutated"
TOKENFORMERS = ("tokenformer", "tokenformer-triton", "tokenformer-triton-qkv")


@dataclass(frozen=True)
class Entry:
    name: str
    build: Callable[[], torch.nn.Module]
    config: Any  # what flops_per_token counts
    missing: str | None = None  # why this checkout cannot build it


def catalog(sizes: Sizes, smoke: bool) -> dict[str, Entry]:
    """The models by id (``--train-models``): TokenFormer (impl ``auto``: on CUDA the fused
    PyTorch Function), with the Triton Θ, and with it and one GEMM for Q, K and V (issue 33);
    the Transformer++ of equal non-embedding parameters, its Q/K/V and gate/up projections
    separate and fused (one Linear each, where this checkout's TransformerConfig has
    ``fused_projections``); GPT-NeoX of Pythia-160M's shape (Hugging Face)."""
    tf = tokenformer_config(sizes, sizes.seq)
    tpp = matched_config(tf, "transformer++", multiple_of=sizes.mlp_multiple)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    fused = (matched_config(tf, "transformer++", multiple_of=sizes.mlp_multiple,
                            fused_projections=True) if "fused_projections" in fields else tpp)

    def tokenformer(impl: str | None = None, grouped: bool = False) -> torch.nn.Module:
        model = TokenFormerLM(tf)
        if impl:
            set_pattention_impl(model, impl)
        set_grouped_qkv(model, grouped)
        return model

    mlp = f"MLP {tpp.intermediate_size}"
    return {
        "transformer++": Entry(f"Transformer++ (matched, {mlp})", lambda: TransformerLM(tpp), tpp),
        "transformer++-fused": Entry(
            f"Transformer++ (matched, {mlp}), fused projections", lambda: TransformerLM(fused),
            fused, None if "fused_projections" in fields else
            "not available in this checkout (TransformerConfig has no fused_projections)"),
        "tokenformer": Entry(f"TokenFormer ({tf.name})", tokenformer, tf),
        "tokenformer-triton": Entry(f"TokenFormer ({tf.name}), impl=triton",
                                    lambda: tokenformer("triton"), tf),
        "tokenformer-triton-qkv": Entry(f"TokenFormer ({tf.name}), impl=triton, one Q/K/V GEMM",
                                        lambda: tokenformer("triton", grouped=True), tf),
        "neox": Entry("GPT-NeoX (HF, Pythia-160M shape)" if not smoke else "GPT-NeoX (HF)",
                      lambda: neox_model(tf), neox_flops_config(tf, sizes.seq)),
    }


class _Counter(logging.Handler):
    """Counts the log records that say inductor assumed every input of a kernel mutated
    (torch._higher_order_ops.triton_kernel_wrap warns on the ``torch._dynamo`` logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count, self._seen = 0, set()

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.name, record.created, record.lineno)  # propagated: one record, 2 loggers
        if MUTATED in record.getMessage() and key not in self._seen:
            self._seen.add(key)
            self.count += 1


_MUTATIONS = _Counter()
for _name in ("torch", "torch._dynamo", "torch._inductor"):
    logging.getLogger(_name).addHandler(_MUTATIONS)


class TrainCandidate:
    """One model in one mode, built and warmed up (compiled) in a worker: ``time`` runs and
    times a round, ``profile`` profiles one step."""

    def __init__(self, model_id: str, mode: str, sizes: Sizes, device: str, smoke: bool) -> None:
        self.device = torch.device(device)
        entry = catalog(sizes, smoke)[model_id]
        if entry.missing:
            raise RuntimeError(entry.missing)
        per_token = flops_per_token(entry.config, sizes.seq, training=True)["total"]

        def count(model: torch.nn.Module, batch: dict) -> float:
            return per_token * batch["input_ids"].numel()

        before, start = _MUTATIONS.count, time.perf_counter()
        torch.manual_seed(0)
        model = entry.build()
        params = (non_embedding_parameters(model) if hasattr(model, "get_input_embeddings")
                  else entry.config.num_parameters(non_embedding=True))
        self.trainer = Trainer(model, "bf16", sizes.batch, sizes.seq, sizes.warmup,
                               sizes.round_steps, device=self.device,
                               compile=mode == "compiled", flops_fn=count)
        self.mutated = _MUTATIONS.count - before
        self.info = {"model": entry.name, "mode": mode, "params": params,
                     "flops_per_token": per_token, "warmup_s": time.perf_counter() - start,
                     "theta_backend": theta_backend(model, self.device)}
        log(f"train: {entry.name} {mode}: {sizes.warmup} warm-up steps "
            f"{self.info['warmup_s']:.0f} s")

    def time(self) -> float:
        before, start = _MUTATIONS.count, time.perf_counter()
        synchronized(self.trainer, self.device)()
        seconds = time.perf_counter() - start
        self.mutated += _MUTATIONS.count - before
        return seconds

    def mutations(self) -> int:
        """The warnings counted so far (while compiling and training this model)."""
        return self.mutated

    def profile(self) -> dict[str, Any]:
        prof = profiled(lambda: self.trainer(steps=1), self.device)
        return {"table": profile_table(prof, self.device),
                "per_step": kernel_summary(prof, self.device)}


def theta_backend(model: torch.nn.Module, device: torch.device) -> str | None:
    """The backend a training step's Pattentions run (None: the model has none)."""
    layer = next((m for m in model.modules() if isinstance(m, Pattention)), None)
    dtype = torch.bfloat16
    return None if layer is None else select_impl(layer.impl, device, dtype, layer.norm,
                                                  training=True).name


def train_stage(ctx: StageContext) -> dict[str, Any]:
    sizes, args, device = ctx.sizes, ctx.args, ctx.device
    peak = matmul_ceiling(torch.bfloat16, sizes.matmul_n, device=device)
    entries = catalog(sizes, args.smoke)
    unknown = sorted(set(args.train_models or ()) - set(entries))
    if unknown:
        raise ValueError(f"--train-models: unknown {', '.join(unknown)}; use {', '.join(entries)}")
    chosen = [i for i in entries if not args.train_models or i in args.train_models]
    modes = [m for m in COMPILE_MODES if m in args.modes]
    notes = intro(peak, sizes)
    notes += [f"{entries[i].name}: {entries[i].missing}" for i in chosen if entries[i].missing]
    specs = {(i, mode): (TrainCandidate, {"model_id": i, "mode": mode, "sizes": sizes,
                                          "device": str(device), "smoke": args.smoke})
             for i in chosen if not entries[i].missing for mode in modes}
    r = result(peak, [], notes)
    with Pool(specs, processes=ctx.processes, backend=sizes.compile_backend) as pool:
        pool.start(deadline=ctx.deadline - 30, label="train")  # 30 s kept for timing and writing
        notes += [f"{entries[i].name} {mode}: not timed: {e}"
                  for (i, mode), e in pool.errors().items()]
        ctx.save(r)
        times, errors = interleave(pool, {k: (k, "time", ()) for k in pool.ready()},
                                   sizes.rounds, warmup=1, deadline=ctx.deadline - 20)
        notes += [f"{entries[i].name} {mode}: failed while timed: {e}"
                  for (i, mode), e in errors.items()]
        r["rows"] = rows(pool, times, sizes, peak)
        r["notes"] = notes + ratios(r["rows"], {i: entries[i].name for i in chosen}, modes)
        for key, row in zip(times, r["rows"], strict=True):
            try:
                row["mutated"] = pool.call(key, "mutations")
            except WorkerError as exc:
                r["notes"].append(f"{row['model']} {row['mode']}: {exc}")
        ctx.save(r)
        for key in times if args.profile else ():
            if ctx.left() < 10:
                r["notes"].append("profiles: stopped at the stage's deadline")
                break
            try:
                p = pool.call(key, "profile", timeout=until(ctx.deadline))
            except WorkerError as exc:
                r["notes"].append(f"profile of {key}: {exc}")
                continue
            row = r["rows"][list(times).index(key)]
            r["profiles"][f"{row['model']}, {row['mode']}"] = p["table"]
            row.update({f"profile_{k}": v for k, v in p["per_step"].items()})
            ctx.save(r)
    r["notes"] += theta_notes(r["rows"])
    return r


def rows(pool: Pool, times: dict, sizes: Sizes, peak: float) -> list[dict[str, Any]]:
    tokens = sizes.round_steps * sizes.batch * sizes.seq
    out = []
    for key, t in times.items():
        info = pool.workers[key].info
        rate = tokens / t["min"]
        out.append({"model": info["model"], "mode": info["mode"], "params": info["params"],
                    "flops_per_token": info["flops_per_token"],
                    "step_ms": 1e3 * t["min"] / sizes.round_steps, "tokens_per_s": rate,
                    "tflops": rate * info["flops_per_token"] / 1e12,
                    "mfu": rate * info["flops_per_token"] / peak, "warmup_s": info["warmup_s"],
                    "theta_backend": info["theta_backend"]})
    return out


def ratios(rows_: list[dict[str, Any]], names: dict[str, str], modes: list[str]) -> list[str]:
    """MFU of each TokenFormer over each Transformer++ (goal, compiled: ≥ 1.0 over the fused
    one) and over GPT-NeoX; the fastest TokenFormer of each mode."""
    mfu = {(r["model"], r["mode"]): r["mfu"] for r in rows_}
    notes = []
    for mode in modes:
        for i in TOKENFORMERS:
            for base in ("transformer++-fused", "transformer++", "neox"):
                a, b = (names.get(i), mode), (names.get(base), mode)
                if a in mfu and b in mfu:
                    goal = (f" ({'met' if mfu[a] / mfu[b] >= 1.0 else 'not met'}: goal >= 1.0)"
                            if base == "transformer++-fused" and mode == "compiled" else "")
                    notes.append(f"{mode}: MFU {a[0]} / {b[0]} = {mfu[a] / mfu[b]:.3f}{goal}")
        ours = [r for r in rows_ if r["mode"] == mode and r["model"] in
                {names.get(i) for i in TOKENFORMERS}]
        if ours:
            best = min(ours, key=lambda r: r["step_ms"])
            notes.append(f"{mode}: the fastest TokenFormer step is {best['model']} "
                         f"({best['step_ms']:.1f} ms; Θ backend {best['theta_backend']})")
    return notes


def theta_notes(rows_: list[dict[str, Any]]) -> list[str]:
    notes = [f"{r['model']} {r['mode']}: {r['mutated']} \"{MUTATED}\" warning(s) while compiling"
             f" and training" for r in rows_ if r.get("mutated") and r["mode"] == "compiled"]
    notes += [f"{r['model']} {r['mode']}: {r['profile_theta_ms']:.2f} ms a step in the Triton "
              f"Θ kernels (≥ 1.5 ms: the next kernel design is due)"
              for r in rows_ if r.get("profile_theta_ms", 0) >= 1.5]
    return notes


def intro(peak: float, sizes: Sizes) -> list[str]:
    return [
        f"bf16 autocast, batch {sizes.batch} × seq {sizes.seq}, AdamW, grad clipping: "
        f"`tokenformer.train.fit`; {sizes.rounds} interleaved rounds of {sizes.round_steps} steps "
        f"after {sizes.warmup} warm-up steps (incl. compiling: warm-up s), best round. MFU = "
        f"achieved FLOP/s ÷ the measured bf16 rate of this device ({peak / 1e12:.3g} TFLOP/s, a "
        f"{sizes.matmul_n}³ matmul); FLOPs/token from `flops_per_token(..., training=True)`.",
        "Profile of one step per model (after the timed rounds): device ms split by kernel name "
        "into GEMM, attention, the Triton Θ (its `fwd`/`bwd` kernels) and other (elementwise, "
        "reductions, inductor's fused kernels: a compiled PyTorch Θ lands here); mutated: "
        f"\"{MUTATED}\" log records (inductor then copies the inputs of a Triton kernel)."]


def result(peak: float, rows_: list[dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    return {"title": "training speed", "peak_tflops": peak / 1e12, "rows": rows_, "notes": notes,
            "profiles": {},
            "columns": [("model", "model", "{}"), ("mode", "mode", "{}"),
                        ("params", "non-emb params", "{:,}"),
                        ("flops_per_token", "train FLOPs/token", "{:.4g}"),
                        ("step_ms", "step ms", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                        ("tflops", "TFLOP/s", "{:.3g}"), ("mfu", "MFU", "{:.1%}"),
                        ("warmup_s", "warm-up s", "{:.0f}"), ("mutated", "mutated", "{}"),
                        ("profile_device_ms", "profiled ms", "{:.1f}"),
                        ("profile_gemm_ms", "GEMM ms", "{:.1f}"),
                        ("profile_attention_ms", "attention ms", "{:.1f}"),
                        ("profile_theta_ms", "Θ ms", "{:.2f}"),
                        ("profile_other_ms", "other ms", "{:.1f}"),
                        ("profile_kernels", "kernels", "{:.0f}")]}

