"""What every GPU stage shares: the shapes of a full and a smoke run, the stage context (device,
shapes, flags, output folder, deadline, partial saves), the subprocess environment, the models
compared (GPT-NeoX from a config) and the copy-bandwidth ceiling."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from common import interleaved, synchronized

from tokenformer import TokenFormerConfig
from tokenformer.models.baselines import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded, ever

STAGES = ("tests", "train", "pattention", "decode", "concurrency", "frontier")
COMPILE_MODES = ("eager", "compiled")
TRAIN_MODELS = ("transformer++", "transformer++-fused", "tokenformer", "tokenformer-triton",
                "tokenformer-triton-qkv", "neox")  # the train stage's models (training.catalog)


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
    profile_tokens: int  # decode: kernels per token from a profile of this many new tokens
    tests_filter: str | None  # pytest -k of the tests stage (None: every test)
    compile_backend: str


FULL = Sizes(tokenformer=("tokenformer-150m", {}), matmul_n=8192, copy_bytes=1 << 30, batch=8,
             seq=2048, warmup=3, rounds=5, round_steps=3, mlp_multiple=128,
             pattention_shapes=((768, 3072), (1536, 6144)), pattention_tokens=8 * 2048,
             pattention_rounds=10, decode_batches=(1, 32), prompt=128, new_tokens=128,
             decode_rounds=3, profile_tokens=9, tests_filter=None, compile_backend="inductor")
SMOKE = Sizes(tokenformer=("tiny", {"vocab_size": 500, "max_seq_len": 64}), matmul_n=128,
              copy_bytes=1 << 20, batch=2, seq=32, warmup=1, rounds=1, round_steps=1,
              mlp_multiple=1, pattention_shapes=((32, 64),), pattention_tokens=64,
              pattention_rounds=2, decode_batches=(1, 2), prompt=4, new_tokens=4,
              decode_rounds=1, profile_tokens=3, tests_filter="l2_norm_gelu and fused and fp32",
              compile_backend="eager")


@dataclass
class StageContext:
    """What a stage function gets: where it runs and how big, the parsed flags, the output
    folder, the time by which it should have written its result (``time.monotonic()``; a lease
    gives each stage a limit) and ``save``, which writes a partial result of the stage at once
    (a stage stopped at its limit then still leaves what it had measured)."""

    device: torch.device
    sizes: Sizes
    args: argparse.Namespace
    out: Path
    deadline: float = math.inf
    save: Callable[[dict[str, Any]], None] = field(default=lambda r: None)

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.monotonic()

    @property
    def processes(self) -> bool:
        """Whether the candidates of a stage live in worker processes (``--workers``; auto: on
        CUDA, where they compile at once)."""
        workers = self.args.workers
        return workers == "processes" or (workers == "auto" and self.device.type == "cuda")

    def timeout(self, margin: float = 0.0) -> float | None:
        """A subprocess's timeout: the seconds left less ``margin`` (None without a deadline)."""
        return None if math.isinf(self.deadline) else max(1.0, self.left() - margin)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of the subprocesses: this checkout's library first on the path."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def output(command: list[str], timeout: float = 60) -> str | None:
    """A command's stdout, or None when it is absent or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def stop_at(proc: subprocess.Popen, timeout: float | None, grace: float,
            send: Callable[[int], None] | None = None, interrupted: bool = False) -> bool:
    """Wait for ``proc`` up to ``timeout`` seconds (and, with ``interrupted``, until this process
    gets SIGINT itself), then send it SIGINT, so that it writes what it has, and SIGKILL
    ``grace`` seconds later (``send``: how a signal reaches it and its children; default
    ``proc.send_signal``). True when it was stopped."""
    send = send or proc.send_signal
    stops = (subprocess.TimeoutExpired, KeyboardInterrupt) if interrupted else (
        subprocess.TimeoutExpired,)
    try:
        proc.wait(timeout=timeout)
        return False
    except stops:
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                send(signal.SIGKILL)
            proc.wait()
        return True


def run_logged(command: list[str], log_path: Path, timeout: float | None, grace: float, *,
               append: bool = False, interrupted: bool = False) -> tuple[int, bool]:
    """``command`` (a Python command line) from the checkout, its line and output written to
    ``log_path`` as it runs, stopped as :func:`stop_at` says: (exit code, whether stopped)."""
    with log_path.open("a" if append else "w") as f:
        f.write(f"$ {shlex.join(command[1:])}\n")
        f.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=f,
                                stderr=subprocess.STDOUT)
        stopped = stop_at(proc, timeout, grace, interrupted=interrupted)
        f.write("\n")
    return proc.returncode, stopped


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def failure(exc: BaseException) -> str:
    """An exception as one line of a stage's notes."""
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


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
