"""Vision training: the Vision TokenFormer (or a ViT) on digits or an image folder, through the
trainer's task-agnostic loop (``fit``): this module supplies the model, the batches (a pure
function of the step), the evaluation and a FLOP count per image.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data import images as vd
from ..errors import ConfigError
from ..eval.vision import Evaluation, evaluate, save_confusion_png
from ..io.files import atomic_write_text
from ..io.outputs import check_run_folder, hold_run_folder
from ..models.vit import TokenFormerViTConfig, ViTConfig, build_vision_model
from .config import TrainConfig
from .loop import fit

# Digits defaults: the recipe benchmarks/vit_digits.py measures (docs/vision.md). One thread:
# matmuls this small gain nothing from a second one, and on a busy machine a second thread spins
# (measured: 600 steps took 812 s with two threads against ~110 s with one, at load average ~12).
DIGITS_TRAIN = dict(steps=600, batch_size=128, lr=3e-3, min_lr=3e-4, warmup_steps=30,
                    weight_decay=0.05, beta2=0.98, eval_interval=0, threads=1)
EVAL_BATCH = 256


@dataclass
class VisionData:
    train_batch_fn: Callable[[int], dict[str, torch.Tensor]]
    eval_batches: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]
    classes: list[str]
    num_train: int



def open_vision_data(data: str, config: TokenFormerViTConfig | ViTConfig, batch_size: int,
                     seed: int = 0, max_shift: int = 1, workers: int = 0) -> VisionData:
    """``digits`` (embedded) or an ImageNet-layout folder, sized for ``config``; a folder's
    images are decoded in ``workers`` DataLoader processes (0: in this one)."""
    if data == "digits":
        train, test = vd.load_digits_split()
        if (config.image_size, config.num_channels, config.num_classes) != (8, 1, 10):
            raise ConfigError(f"digits are 8×8 grayscale in 10 classes; model {config.name} "
                              f"expects {config.image_size}×{config.image_size}×"
                              f"{config.num_channels} in {config.num_classes} classes")
        x_test = test.normalized()

        def digits_eval() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
            return zip(x_test.split(EVAL_BATCH), test.labels.split(EVAL_BATCH), strict=True)

        return VisionData(vd.batch_fn(train, batch_size, seed, max_shift), digits_eval,
                          train.classes, len(train))
    kwargs = dict(image_size=config.image_size, num_channels=config.num_channels)
    train_set = vd.ImageFolder(data, "train", **kwargs)
    val_set = vd.ImageFolder(data, "val", **kwargs)
    if len(train_set.classes) != config.num_classes:
        raise ConfigError(f"{data} has {len(train_set.classes)} classes but the model has "
                          f"{config.num_classes} outputs (pass --num-classes "
                          f"{len(train_set.classes)})")

    def folder_eval() -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        return torch.utils.data.DataLoader(val_set, batch_size=EVAL_BATCH, num_workers=workers)

    return VisionData(train_set.batch_fn(batch_size, seed, workers), folder_eval,
                      train_set.classes, len(train_set))



@dataclass
class VisionRun:
    model: nn.Module
    evaluation: Evaluation
    classes: list[str]
    fit: Any  # tokenformer.training.FitResult
    confusion_png: Path | None



def train_vision(preset: str = "vit-digits-tiny", data: str = "digits", *,
                 arch: str = "tokenformer", out: str | Path | None = None,
                 max_shift: int = 1, progress: bool | None = None,
                 model_overrides: dict[str, Any] | None = None, workers: int = 0,
                 **train_overrides: Any) -> VisionRun:
    """Train a vision model with the trainer's loop; report top-1 and a confusion matrix.

    ``train_overrides`` are :class:`tokenformer.training.TrainConfig` fields (steps, batch_size, lr,
    seed, threads, ...); digits runs default to ``DIGITS_TRAIN``, folders to TrainConfig's.
    With ``out``, the run directory holds the trainer's ``metrics.jsonl`` and ``final/``
    checkpoint (loadable with ``load_vision_model``), ``confusion.png`` and ``results.json``.
    An image folder is decoded in ``workers`` DataLoader processes (same batches as 0).
    """
    cfg = TrainConfig.from_dict({**(DIGITS_TRAIN if data == "digits" else {}),
                                 **train_overrides})
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        if out is None:
            return _train_vision(cfg, preset, data, arch, out, max_shift, progress,
                                 model_overrides, workers)
        with _run_folder(Path(out), data):
            return _train_vision(cfg, preset, data, arch, out, max_shift, progress,
                                 model_overrides, workers)
    finally:
        torch.set_num_threads(threads)



def _run_folder(out: Path, data: str) -> contextlib.AbstractContextManager[Path]:
    """A new (or empty) run folder, not inside the image folder, held for the run."""
    inputs = [data if data != "digits" else None]
    check_run_folder(out, inputs, command="vision train")
    if (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run; choose another --out")
    return hold_run_folder(out, command="vision train")



def _train_vision(cfg: Any, preset: str, data: str, arch: str, out: str | Path | None,
                  max_shift: int, progress: bool | None, model_overrides: dict[str, Any] | None,
                  workers: int = 0) -> VisionRun:
    torch.manual_seed(cfg.seed)
    config = TokenFormerViTConfig.from_name(preset, **(model_overrides or {}))
    model = build_vision_model(arch, config)
    vdata = open_vision_data(data, model.config, cfg.batch_size, cfg.seed, max_shift, workers)

    def eval_fn(m: nn.Module) -> dict[str, float]:
        return evaluate(m, vdata.eval_batches()).metrics()

    def flops_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> float:
        return m.config.training_flops_per_image() * len(batch["labels"])

    try:
        result = fit(model, vdata.train_batch_fn, cfg, eval_fn=eval_fn, flops_fn=flops_fn,
                     out_dir=out, progress=progress)
    finally:
        getattr(vdata.train_batch_fn, "close", lambda: None)()  # stop prefetching workers
    evaluation = evaluate(result.model, vdata.eval_batches())
    png = None
    if out is not None:
        out = Path(out)
        title = (f"{model.config.name} ({arch}) on {Path(data).name}: "
                 f"top-1 {100 * evaluation.accuracy:.2f}%")
        if save_confusion_png(evaluation.confusion, vdata.classes, out / "confusion.png", title):
            png = out / "confusion.png"
        atomic_write_text(out / "results.json", json.dumps({
            "preset": preset, "arch": arch, "data": data, "parameters":
            result.model.num_parameters(), "steps": result.step, "train_time_s": result.train_time,
            "elapsed_s": result.elapsed, "train_flops": result.flops, **evaluation.metrics(),
            "classes": vdata.classes, "confusion": evaluation.confusion.tolist()}, indent=2))
    return VisionRun(result.model, evaluation, vdata.classes, result, png)
