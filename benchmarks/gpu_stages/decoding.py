"""Stage ``decode``: greedy decoding of TokenFormer-150M vs HF GPT-NeoX (Pythia-160M shape),
bf16 weights, batch 1 and 32, a 128-token prompt, each model eager (dynamic KV cache) and with a
static cache + compiled step (ours: ``generate(cache_implementation="static", compile=True)``, a
CUDA graph per token; HF: ``generate(cache_implementation="static")``, which compiles the
forward with mode="reduce-overhead" on CUDA).

Per path and batch: tokens/s and ms per step, from (t(128 new) − t(1 new)) / 127 (the prompt's
cost cancels); the share of the bandwidth bound (the measured copy rate over the weight bytes plus
the KV cache each step reads); and kernels per token from a profile of ``profile_tokens`` new
tokens less one (see ``kernels``: device kernels as CUPTI records them, graph replays included,
and the host's launch calls). Each (model, path, batch) is a worker: the four compiles run at
once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from common import synchronized

from tokenformer import TokenFormerLM
from tokenformer.models.generation import static_capacity

from .base import Sizes, StageContext, copy_bandwidth, neox_model, tokenformer_config
from .kernels import kernel_summary, profiled
from .workers import Pool, WorkerError, interleave, until

OURS, HF = "TokenFormer", "GPT-NeoX (HF)"
STATIC = "static + compiled"
DECODE_PATHS = ((OURS, "eager"), (OURS, STATIC), (HF, "eager"), (HF, STATIC))


def decode_bytes(model: torch.nn.Module, embedding: torch.Tensor, head: torch.Tensor) -> int:
    """Weight bytes one decoding step reads: every parameter but an input embedding that is not
    also the output head (a lookup reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (embedding.numel() * embedding.element_size() if embedding is not head else 0)


class DecodeCandidate:
    """One model, path and batch size in a worker; the compiled paths compiled and captured by
    a first untimed generation (``first_call_s``)."""

    def __init__(self, name: str, path: str, batch: int, sizes: Sizes, device: str) -> None:
        self.device = torch.device(device)
        config = tokenformer_config(sizes)
        torch.manual_seed(0)
        if name == OURS:
            model = TokenFormerLM(config).to(self.device, torch.bfloat16).eval()
            weights = decode_bytes(model, model.word_embeddings.weight,
                                   model.word_embeddings.weight)
        else:
            model = neox_model(config).to(self.device, torch.bfloat16).eval()
            weights = decode_bytes(model, model.get_input_embeddings().weight,
                                   model.get_output_embeddings().weight)
        self.model, self.name, self.static = model, name, path != "eager"
        # the compiled paths are profiled at the timed length: ours would replay its graph for
        # any length in the same capacity bucket (generation.static_capacity), but HF's static
        # cache holds exactly prompt + new tokens and would compile again
        self.profile_tokens = sizes.new_tokens if self.static else sizes.profile_tokens
        self.prompt = torch.randint(0, config.vocab_size, (batch, sizes.prompt),
                                    generator=torch.Generator().manual_seed(batch)).to(self.device)
        start = time.perf_counter()
        self.generate(sizes.new_tokens)()  # compiles and captures on the static paths
        self.info = {"weight_bytes": weights, "first_call_s":
                     time.perf_counter() - start if self.static else None}

    def generate(self, new: int) -> Callable[[], object]:
        model, prompt = self.model, self.prompt
        if self.name == OURS:
            kwargs = {"cache_implementation": "static", "compile": True} if self.static else {}
            fn = lambda: model.generate(prompt, new, **kwargs)  # noqa: E731
        else:
            mask = torch.ones_like(prompt)
            kwargs = {"cache_implementation": "static"} if self.static else {}
            fn = lambda: model.generate(  # noqa: E731
                input_ids=prompt, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=0, **kwargs)
        return synchronized(torch.no_grad()(fn), self.device)

    def time(self, new: int) -> float:
        fn = self.generate(new)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def kernels(self) -> dict[str, float]:
        """Kernels, launches and device ms per token: a profile of ``profile_tokens`` new tokens
        less one of 1, over ``profile_tokens - 1`` (on CUDA without the host's operators, which
        would only slow the profiler down)."""
        new = self.profile_tokens
        many, one = (kernel_summary(profiled(self.generate(k), self.device, cpu_ops=False),
                                    self.device) for k in (new, 1))
        return {k: (many[k] - one[k]) / (new - 1) for k in many}


def decode_stage(ctx: StageContext) -> dict[str, Any]:
    sizes, device = ctx.sizes, ctx.device
    bandwidth = copy_bandwidth(device, sizes.copy_bytes)
    config = tokenformer_config(sizes)
    # K and V of every layer at every position read, bf16, at each step: the dynamic caches read
    # the positions filled so far (their mean); HF's static cache all prompt + new of them, ours
    # its whole capacity bucket (masked slots included)
    kv_per_position = 2 * config.num_layers * config.hidden_size * 2
    n_new = sizes.new_tokens
    filled = sizes.prompt + n_new
    positions = {(OURS, "eager"): sizes.prompt + n_new / 2, (HF, "eager"): sizes.prompt + n_new / 2,
                 (OURS, STATIC): static_capacity(filled, config.max_seq_len), (HF, STATIC): filled}
    specs = {(name, path, batch): (DecodeCandidate, {"name": name, "path": path, "batch": batch,
                                                     "sizes": sizes, "device": str(device)})
             for batch in sizes.decode_batches for name, path in DECODE_PATHS}
    r = result(bandwidth, notes(sizes, bandwidth, positions))
    with Pool(specs, processes=ctx.processes, backend=sizes.compile_backend) as pool:
        pool.start(deadline=ctx.deadline - 20, label="decode")
        r["notes"] += [f"{' '.join(map(str, key))}: {e}" for key, e in pool.errors().items()]
        for batch in sizes.decode_batches:  # one batch size at a time, saved as it ends
            calls = {(key, new): (key, "time", (new,)) for key in pool.ready()
                     if key[2] == batch for new in (1, n_new)}
            times, errors = interleave(pool, calls, sizes.decode_rounds, warmup=1,
                                       deadline=ctx.deadline - 10)
            r["notes"] += [f"{' '.join(map(str, k))}: {e}" for (k, _), e in errors.items()]
            for key in dict.fromkeys(k for k, _ in times):
                if (key, 1) not in times or (key, n_new) not in times:
                    continue
                step = max(times[key, n_new]["min"] - times[key, 1]["min"], 1e-9) / (n_new - 1)
                nbytes = pool.workers[key].info["weight_bytes"] + batch * kv_per_position \
                    * positions[key[0], key[1]]
                bound = bandwidth / nbytes * batch
                r["rows"].append({"model": key[0], "path": key[1], "batch": batch,
                                  "weight_mb": pool.workers[key].info["weight_bytes"] / 1e6,
                                  "step_ms": 1e3 * step, "tokens_per_s": batch / step,
                                  "bandwidth_bound_tokens_per_s": bound,
                                  "of_bound": batch / step / bound,
                                  "first_call_s": pool.workers[key].info["first_call_s"]})
            ctx.save(r)
        for row in r["rows"]:  # kernels per token, once every path is timed
            if ctx.left() < 5:
                r["notes"].append("kernels per token: stopped at the stage's deadline")
                break
            try:
                counts = pool.call((row["model"], row["path"], row["batch"]), "kernels",
                                   timeout=until(ctx.deadline))
            except WorkerError as exc:
                r["notes"].append(f"kernels of {row['model']} {row['path']}: {exc}")
                continue
            row.update(kernels_per_token=counts["kernels"],
                       launches_per_token=counts["launches"] + counts["graph_launches"])
            ctx.save(r)
    weights = {row["model"]: row["weight_mb"] for row in r["rows"]}
    r["expected_ratio_weights"] = (weights[OURS] / weights[HF] if {OURS, HF} <= set(weights)
                                   else None)
    r["notes"] += comparisons(r["rows"], sizes.decode_batches, r["expected_ratio_weights"])
    return r


def comparisons(rows: list[dict[str, Any]], batches: tuple[int, ...], by_weights: float | None
                ) -> list[str]:
    """Ours vs HF per path (beside what the weight bytes per step predict), static + compiled
    vs eager, and the goals (issue 34)."""
    rate = {(r["model"], r["path"], r["batch"]): r["tokens_per_s"] for r in rows}
    notes = []
    predicted = f" (weight bytes per step predict {1 / by_weights:.2f}x)" if by_weights else ""
    for batch in batches:
        for path in ("eager", STATIC):
            if (OURS, path, batch) in rate and (HF, path, batch) in rate:
                notes.append(f"batch {batch}, {path}: TokenFormer / GPT-NeoX tokens/s "
                             f"{rate[OURS, path, batch] / rate[HF, path, batch]:.2f}x"
                             f"{predicted}")
        if (OURS, STATIC, batch) in rate and (OURS, "eager", batch) in rate:
            notes.append(f"batch {batch}: TokenFormer static + compiled / eager "
                         f"{rate[OURS, STATIC, batch] / rate[OURS, 'eager', batch]:.2f}x")
    best = {b: max((v for (m, _, bb), v in rate.items() if m == OURS and bb == b), default=None)
            for b in (1, 32)}
    if best[1] is not None:
        hf = rate.get((HF, STATIC, 1))
        met = best[1] >= 1000 and (hf is None or best[1] >= 0.8 * hf)
        notes.append(f"goal batch 1: ≥ 1,000 tokens/s and ≥ 0.8× HF static + compiled: "
                     f"{best[1]:,.0f} tokens/s" + (f", {best[1] / hf:.2f}× HF" if hf else "")
                     + f" ({'met' if met else 'not met'})")
    if best[32] is not None:
        notes.append(f"goal batch 32: ≥ 20,000 tokens/s: {best[32]:,.0f} "
                     f"({'met' if best[32] >= 20000 else 'not met'})")
    return notes


def notes(sizes: Sizes, bandwidth: float, positions: dict[tuple[str, str], float]
          ) -> list[str]:
    n_new = sizes.new_tokens
    return [
        f"Greedy `generate`, bf16 weights, {sizes.prompt}-token random prompt; one step = "
        f"(t({n_new} new tokens) − t(1)) / {n_new - 1}, best of {sizes.decode_rounds} "
        f"interleaved runs per batch size. eager: the dynamic KV cache. TokenFormer static + "
        f"compiled: `generate(cache_implementation=\"static\", compile=True)` (on CUDA "
        f"mode=\"reduce-overhead\": a CUDA graph replayed at every token). HF static + compiled: "
        f"`generate(cache_implementation=\"static\")`, which compiles the forward on CUDA "
        f"(transformers' CompileConfig defaults; on a CPU it stays eager). first call s: the "
        f"untimed first run of a compiled path (compile + capture + {n_new} tokens).",
        f"Bandwidth bound: the measured copy rate ({bandwidth / 1e9:.3g} GB/s) over the weight "
        f"bytes plus the KV cache each step reads (dynamic: at the mean position "
        f"{positions[OURS, 'eager']:.0f}; HF static: all {positions[HF, STATIC]:.0f} positions; "
        f"ours static: its capacity bucket's {positions[OURS, STATIC]:.0f}, masked or not); "
        f"of bound = tokens/s ÷ that bound.",
        f"kernels/token: device kernels (CUPTI; those a replayed CUDA graph runs included; on a "
        f"CPU the aten operators) of a profiled generation of {sizes.profile_tokens} new tokens "
        f"less one of 1, ÷ {sizes.profile_tokens - 1}; launches/token: the host's kernel-launch "
        f"and graph-launch calls, likewise."]


def result(bandwidth: float, notes_: list[str]) -> dict[str, Any]:
    return {"title": "decoding", "bandwidth_gbps": bandwidth / 1e9, "rows": [], "notes": notes_,
            "columns": [("model", "model", "{}"), ("path", "path", "{}"),
                        ("batch", "batch", "{}"), ("weight_mb", "weight MB/step", "{:.4g}"),
                        ("step_ms", "step ms", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                        ("bandwidth_bound_tokens_per_s", "bandwidth bound tokens/s",
                         "{:,.0f}"), ("of_bound", "of bound", "{:.1%}"),
                        ("kernels_per_token", "kernels/token", "{:.0f}"),
                        ("launches_per_token", "launches/token", "{:.0f}"),
                        ("first_call_s", "first call s", "{:.1f}")]}
