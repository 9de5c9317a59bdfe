"""Evaluation: perplexity and bits per byte on text, and lm-evaluation-harness tasks.

**Windows.** A text longer than the window is scored in windows of ``seq_len`` tokens (default:
the model's context). The first window scores its positions 1..seq_len-1 (token ``i`` seeing
``i`` tokens of context); each later window is shifted by ``stride`` tokens and scores only the
``stride`` tokens no earlier window reached, its last ones. So every token except the very first
is scored exactly once, and every token after the first window sees at least
``seq_len - stride`` tokens of context. ``stride`` is at most ``seq_len - 1``, the default: windows
then overlap by a single token (like lm-eval's rolling loglikelihood) and the cost is one forward
pass per ``seq_len - 1`` tokens; a smaller stride buys more context for proportionally more
compute (``stride = 1``: every token sees ``seq_len - 1`` tokens, or all before it).

**Numbers.** ``loss`` is the mean next-token negative log-likelihood in nats over the scored
tokens, computed over the model's full (padded) vocabulary like the training loss;
``perplexity = exp(loss)``; ``bits_per_byte = loss / ln 2 / bytes_per_token`` with
``bytes_per_token`` the UTF-8 bytes of the text divided by its token count (exact for the byte
tokenizer, the usual whole-text average otherwise).

This module does not import transformers; :func:`run_tasks` imports lm-eval and
:mod:`tokenformer.hf` when called.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data.datasets import TokenDataset
from ..data.tokenizer import Tokenizer, resolve_tokenizer
from ..errors import ConfigError, DataError
from ..formats.loading import load_model
from ..io.paths import regular_file
from ..models.config import TokenFormerConfig
from ..models.lm import TokenFormerLM
from .tasks import kjv

TASKS_DIR = Path(__file__).parent / "tasks"
OFFLINE_TASKS = ("kjv_lastword", "kjv_choice")


# ------------------------------------------------------------------------------------- windows
def sliding_windows(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, n_scored)`` for each window over ``n_tokens`` tokens: the window holds
    tokens ``[begin, end)`` and scores its last ``n_scored`` positions (see the module doc)."""
    if seq_len < 2:
        raise ConfigError(f"seq_len must be >= 2 to score anything, got {seq_len}")
    if not 1 <= stride < seq_len:
        raise ConfigError(f"stride must be in [1, seq_len - 1 = {seq_len - 1}], got {stride}")
    if n_tokens < 2:
        raise DataError(f"need at least 2 tokens to score, got {n_tokens}")
    end = min(seq_len, n_tokens)
    windows = [(0, end, end - 1)]  # token 0 has no context: it is never scored
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        windows.append((new_end - seq_len, new_end, new_end - end))
        end = new_end
    return windows


@torch.no_grad()
def evaluate_text(
    model: TokenFormerLM,
    tokens: Any,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    *,
    bytes_per_token: float | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Loss, perplexity and bits per byte of ``model`` on ``tokens``: a 1-D sequence of ids, or
    a prepared :class:`~tokenformer.data.datasets.TokenDataset` (or its folder), whose ``val``
    split is scored. For a text file see :func:`evaluate_data`.

    Returns ``{"loss", "perplexity", "bits_per_byte", "tokens", "seq_len", "stride"}``
    (``tokens`` = tokens scored; ``bits_per_byte`` is NaN when ``bytes_per_token`` is unknown).
    """
    tokens, bytes_per_token = _as_tokens(tokens, model.config, bytes_per_token)
    seq_len = seq_len or model.config.max_seq_len
    stride = stride or seq_len - 1
    if seq_len > model.config.max_seq_len:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's context of "
                          f"{model.config.max_seq_len} tokens")
    if batch_size <= 0:
        raise ConfigError(f"batch size must be > 0, got {batch_size}")
    n = len(tokens)
    if n and int(tokens.max()) >= model.config.padded_vocab_size:
        raise DataError(f"token id {int(tokens.max())} is outside the model's vocabulary of "
                        f"{model.config.padded_vocab_size} rows (wrong tokenizer?)")
    windows = sliding_windows(n, seq_len, stride)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_scored = 0.0, 0
    # Windows of one length are batched together (all are full but a lone first one).
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in windows:
        groups.setdefault(w[1] - w[0], []).append(w)
    bar = tqdm(total=len(windows), desc="eval", unit="win", dynamic_ncols=True,
               disable=None if progress else True)
    try:
        for length, group in groups.items():
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                rows = np.stack([tokens[b:e] for b, e, _ in chunk]).astype(np.int64)
                ids = torch.from_numpy(rows).to(device)
                labels = ids.clone()
                for row, (_, _, n_scored) in enumerate(chunk):
                    labels[row, : length - n_scored] = -100
                logits = model(ids).logits[:, :-1].float()
                total_nll += F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum").item()
                total_scored += sum(s for _, _, s in chunk)
                bar.update(len(chunk))
    finally:
        bar.close()
        model.train(was_training)
    loss = total_nll / total_scored
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": loss / math.log(2) / bytes_per_token if bytes_per_token
            else float("nan"),
            "tokens": total_scored, "seq_len": seq_len, "stride": stride}


def _as_tokens(data: Any, config: TokenFormerConfig, bytes_per_token: float | None
               ) -> tuple[np.ndarray, float | None]:
    """A 1-D int array of token ids (and bytes/token) from any of the accepted inputs."""
    if isinstance(data, (str, Path)):
        data = TokenDataset.open(data)
    if hasattr(data, "val") and hasattr(data, "bytes_per_token"):  # a prepared TokenDataset
        data.check_vocab(config.vocab_size, "val")
        return np.asarray(data.val), bytes_per_token or data.bytes_per_token("val")
    if isinstance(data, torch.Tensor):
        data = data.cpu().numpy()
    array = np.asarray(data)
    if array.ndim != 1:
        raise DataError(f"expected a 1-D sequence of token ids, got shape {array.shape}")
    return array, bytes_per_token


def read_text_tokens(path: str | Path, tokenizer: Tokenizer) -> tuple[np.ndarray, float]:
    """Token ids of a UTF-8 text file and its bytes per token."""
    path = regular_file(path, "data file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if len(ids) < 2:
        raise DataError(f"{path} holds {len(ids)} token(s); at least 2 are needed to score")
    return ids, len(raw) / len(ids)


def evaluate_data(model_spec: str | Path, data: str | Path, *, tokenizer: str | Path | None = None,
                  seq_len: int | None = None, stride: int | None = None, batch_size: int = 8,
                  device: str = "cpu", progress: bool = True) -> dict[str, Any]:
    """``tokenformer eval MODEL --data DATA``: a text file (tokenized with the model's tokenizer)
    or a prepared folder (its validation split)."""
    data = Path(data)
    if not data.exists():
        raise DataError(f"data not found: {data}")
    if not data.is_dir():
        regular_file(data, "data file")  # a FIFO or a device: refused before the model loads
    model = load_model(model_spec).to(device)
    if data.is_dir():
        tokens: Any = data
        if tokenizer is not None:
            raise ConfigError("--tokenizer applies to text files; a prepared folder carries its "
                              "own tokenizer")
        bpt = None
    else:
        tok = resolve_tokenizer(model_spec, model.config, tokenizer)
        tokens, bpt = read_text_tokens(data, tok)
    return evaluate_text(model, tokens, seq_len, stride, batch_size, bytes_per_token=bpt,
                         progress=progress)


def format_result(result: dict[str, Any]) -> str:
    return (f"loss {result['loss']:.4f}   perplexity {result['perplexity']:.3f}   "
            f"bits/byte {result['bits_per_byte']:.4f}   tokens {result['tokens']:,} "
            f"(windows of {result['seq_len']}, stride {result['stride']})")


# ------------------------------------------------------------------------------------- lm-eval
def run_tasks(model_spec: str | Path, tasks: Sequence[str], *, limit: int | None = None,
              batch_size: int = 8, device: str = "cpu", tokenizer: str | Path | None = None,
              bootstrap_iters: int = 1000, num_fewshot: int | None = None,
              output_path: str | Path | None = None, log_samples: bool = False
              ) -> dict[str, Any]:
    """Run lm-evaluation-harness tasks through its Hugging Face wrapper (``HFLM``).

    The offline tasks shipped in :mod:`tokenformer.eval.tasks` (``kjv_lastword``,
    ``kjv_choice``) are always available; any stock lm-eval task name works too, but stock
    tasks download their data (see docs/huggingface.md). Returns lm-eval's ``results`` mapping
    ``{task: {metric: value}}``, plus ``samples``: the number of documents scored. With
    ``output_path``, lm-eval's own tracker writes the results JSON there (and, with
    ``log_samples``, one JSONL of per-document inputs and outputs per task), as ``lm_eval
    --output_path --log_samples`` does.
    """
    try:
        import lm_eval
        from lm_eval.loggers import EvaluationTracker
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("--tasks needs lm-evaluation-harness: pip install "
                          "'tokenformer[eval]'") from None
    from ..formats.convert import load_for_transformers  # transformers: the eval extra

    tasks = [t.strip() for t in tasks if t.strip()]
    if not tasks:
        raise ConfigError("no task names given")
    if limit is not None and limit <= 0:
        raise ConfigError(f"--limit must be > 0, got {limit}")
    if log_samples and output_path is None:
        raise ConfigError("--log-samples needs --output-path (where the samples are written)")
    # Indexing lm-eval's thousands of stock task files takes tens of seconds: skip it when only
    # the shipped offline tasks are asked for.
    stock = any(t not in OFFLINE_TASKS for t in tasks)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=stock)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown lm-eval task {unknown[0]!r}; offline tasks shipped: "
                          f"{', '.join(OFFLINE_TASKS)}")
    model, tok = load_for_transformers(model_spec, tokenizer)
    check_task_context([t for t in tasks if t in OFFLINE_TASKS],
                       lambda text: tok.encode(text, add_special_tokens=False, verbose=False),
                       model.config.max_seq_len)
    lm = HFLM(pretrained=model.to(device), tokenizer=tok, backend="causal",
              batch_size=batch_size, max_length=model.config.max_seq_len, device=device)
    tracker = EvaluationTracker(output_path=str(output_path)) if output_path else None
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                      bootstrap_iters=bootstrap_iters, num_fewshot=num_fewshot,
                                      log_samples=log_samples, evaluation_tracker=tracker)
    except AssertionError as exc:  # lm-eval checks its requests with bare asserts
        why = str(exc) or "a bare assertion, e.g. an answer longer than the context"
        raise ConfigError(f"lm-eval rejected a request of {', '.join(tasks)} for this model "
                          f"(context {model.config.max_seq_len} tokens): {why}") from None
    if tracker is not None:
        samples = out.pop("samples", None) if log_samples else None
        tracker.save_results_aggregated(results=out, samples=samples)
        for task in out["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
    counts = out.get("n-samples", {})
    return {task: {**{k: v for k, v in metrics.items() if k != "alias"},
                   "samples": counts.get(task, {}).get("effective", metrics.get("samples"))}
            for task, metrics in out["results"].items()}


def check_task_context(tasks: Sequence[str], encode: Any, context: int) -> None:
    """Refuse, saying what is needed, a model whose context cannot hold a shipped task's longest
    answer: lm-eval would stop on a bare ``AssertionError``. (A question + answer longer than the
    context is scored with the question cut from the left, as lm-eval does; it warns.)"""
    for task in tasks:
        pairs = kjv.requests(task)
        answer = max(len(encode(a)) for _, a in pairs)
        whole = max(len(encode(q + a)) for q, a in pairs)
        if context < answer:
            raise ConfigError(f"{task} needs a model context of at least {answer} tokens (its "
                              f"longest answer; {whole} to score every question uncut), this "
                              f"model's is {context}: train with --seq-len {whole} or more "
                              f"(the demo config's 256 is enough)")


def format_tasks(results: dict[str, Any]) -> str:
    """One line per (task, metric): value ± stderr, as lm-eval names them (``acc,none``)."""
    lines = [f"{'task':<20}{'metric':<16}{'value':>12}"]
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            if not comma or "stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            extra = f" ± {stderr:.4g}" if isinstance(stderr, (int, float)) else ""
            lines.append(f"{task:<20}{metric:<16}{value:>12.4g}{extra}")
    return "\n".join(lines)
