"""Training a parameter-token adapter (``tokenformer adapt``): load a base, add the adapter's
tokens at step 0 of their own run (the base frozen, :func:`tokenformer.ops.adapters.adapt`),
train them with :func:`~tokenformer.training.loop.fit` like any run; saving the adapter alone is
the checkpoint operation's (:func:`tokenformer.checkpoints.adapt_checkpoint`).

An adapter is added before ``fit`` builds the optimizer (over the adapter's tokens only), so it
needs no optimizer carried: it is the step-0 case of a growth event, not a mid-run one (adding
adapter tokens in the middle of a run has no use we know of; a run that grows mid-way uses
``--grow-at``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..data.corpora import code_dataset
from ..errors import ConfigError
from ..formats.loading import load_model
from ..ops import adapters as ad
from .evaluation import lm_evaluator
from .execution import resolve_device
from .lm import lm_batches, open_dataset
from .loop import fit


def open_data(cfg: Any, progress: bool = True) -> Any:
    """``cfg.data``: what the trainer opens (a prepared directory, ``default`` = the embedded
    KJV) or ``code`` (the embedded Jinja2 source corpus,
    :func:`tokenformer.data.corpora.code_dataset`)."""
    if cfg.data == "code":
        return code_dataset(progress=progress)
    return open_dataset(cfg, progress=progress)


def train_adapter(base: str, data_spec: str, tokens: dict[str, int], cfg: Any, name: str,
                  progress: bool | None) -> tuple[Any, dict[str, Any]]:
    """Load ``base``, attach the adapter ``name`` with ``tokens`` new tokens per Pattention,
    train it on ``data_spec`` with ``cfg`` (:func:`~tokenformer.training.loop.fit`): the adapted
    model and its summary (val loss before and after, trainable parameters, steps); nothing is
    saved (:func:`tokenformer.checkpoints.adapt_checkpoint` saves it)."""
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = load_model(base).to(device)  # a folder is checked against its manifest first
    dataset = open_data(cfg, progress=bool(progress))
    dataset.check_model(model.config.vocab_size, cfg.seq_len)
    if cfg.seq_len > model.config.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's context "
                          f"{model.config.max_seq_len}")
    torch.manual_seed(cfg.seed)
    ad.adapt(model, **tokens, name=name, generator=torch.Generator().manual_seed(cfg.seed))
    evaluate = lm_evaluator(dataset, cfg.seq_len, cfg.batch_size, cfg.eval_batches, device)
    batch_fn = lm_batches(dataset, cfg.batch_size, cfg.seq_len, cfg.seed, device)

    model.eval()
    with torch.no_grad(), ad.adapters_active(model, []):
        before = evaluate(model)
    model.train()
    result = fit(model, batch_fn, cfg, eval_fn=evaluate, progress=progress)
    after = result.final_eval or {}
    summary = {"base": str(base), "data": data_spec, "name": name, "tokens": tokens,
               "trainable_parameters": ad.trainable_parameters(model),
               "base_parameters": sum(p.numel() for n, p in model.named_parameters()
                                      if ".adapters." not in n),
               "steps": result.step, "train_time_s": result.train_time,
               "val_loss_base": before["val_loss"], "val_loss_adapted": after.get("val_loss"),
               "train_config": cfg.to_dict()}
    return model, summary
