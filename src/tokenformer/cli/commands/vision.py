"""``tokenformer vision info|train|eval``: the Vision TokenFormer on digits or an image folder.

Training goes through the trainer's task-agnostic loop (:func:`tokenformer.train.fit`): this
module only supplies the model, the batches (a pure function of the step), the evaluation and a
FLOP count per image.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ...errors import ConfigError
from ...models.vit import TokenFormerViTConfig, ViTConfig, build_vision_model, load_vision_model

# Digits defaults: the recipe benchmarks/vit_digits.py measures (docs/vision.md). One thread:
# matmuls this small gain nothing from a second one, and on a busy machine a second thread spins
# (measured: 600 steps took 812 s with two threads against ~110 s with one, at load average ~12).
DIGITS_TRAIN = dict(steps=600, batch_size=128, lr=3e-3, min_lr=3e-4, warmup_steps=30,
                    weight_decay=0.05, beta2=0.98, eval_interval=0, threads=1)
EVAL_BATCH = 256


# ------------------------------------------------------------------------------------ evaluation
@dataclass
class Evaluation:
    accuracy: float  # top-1, in [0, 1]
    loss: float  # mean cross-entropy
    confusion: np.ndarray  # [classes, classes]: rows = true class, columns = prediction

    def metrics(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "loss": self.loss}


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
             ) -> Evaluation:
    """Top-1 accuracy, loss and confusion matrix of ``model`` (in eval mode) over ``batches``."""
    k = model.config.num_classes
    was_training = model.training
    model.eval()
    counts = torch.zeros(k * k, dtype=torch.long)
    loss_sum, n = 0.0, 0
    for pixel_values, labels in batches:
        out = model(pixel_values, labels=labels)
        counts += torch.bincount(labels * k + out.logits.argmax(-1), minlength=k * k)
        loss_sum += float(out.loss) * len(labels)
        n += len(labels)
    model.train(was_training)
    confusion = counts.view(k, k).numpy()
    return Evaluation(float(np.trace(confusion)) / max(n, 1), loss_sum / max(n, 1), confusion)


def save_confusion_png(confusion: np.ndarray, classes: list[str], path: str | Path,
                       title: str = "") -> bool:
    """Draw the confusion matrix; returns False (writing nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from ...io.files import atomic_write

    k = len(classes)
    fig, ax = plt.subplots(figsize=(1.6 + 0.45 * k, 1.2 + 0.45 * k))
    ax.imshow(confusion, cmap="Blues")
    if k <= 30:  # beyond that the numbers would not be readable
        ax.set_xticks(range(k), classes, rotation=90 if k > 10 else 0)
        ax.set_yticks(range(k), classes)
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, str(confusion[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if confusion[i, j] > confusion.max() / 2 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------ data
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
    from ...data import images as vd

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


# -------------------------------------------------------------------------------------- training
@dataclass
class VisionRun:
    model: nn.Module
    evaluation: Evaluation
    classes: list[str]
    fit: Any  # tokenformer.train.FitResult
    confusion_png: Path | None


def train_vision(preset: str = "vit-digits-tiny", data: str = "digits", *,
                 arch: str = "tokenformer", out: str | Path | None = None,
                 max_shift: int = 1, progress: bool | None = None,
                 model_overrides: dict[str, Any] | None = None, workers: int = 0,
                 **train_overrides: Any) -> VisionRun:
    """Train a vision model with the trainer's loop; report top-1 and a confusion matrix.

    ``train_overrides`` are :class:`tokenformer.train.TrainConfig` fields (steps, batch_size, lr,
    seed, threads, ...); digits runs default to ``DIGITS_TRAIN``, folders to TrainConfig's.
    With ``out``, the run directory holds the trainer's ``metrics.jsonl`` and ``final/``
    checkpoint (loadable with ``load_vision_model``), ``confusion.png`` and ``results.json``.
    An image folder is decoded in ``workers`` DataLoader processes (same batches as 0).
    """
    from ...training.train import TrainConfig

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
    from ...io.outputs import check_run_folder, hold_run_folder

    inputs = [data if data != "digits" else None]
    check_run_folder(out, inputs, command="vision train")
    if (out / "metrics.jsonl").exists():
        raise ConfigError(f"{out} already holds a run; choose another --out")
    return hold_run_folder(out, command="vision train")


def _train_vision(cfg: Any, preset: str, data: str, arch: str, out: str | Path | None,
                  max_shift: int, progress: bool | None, model_overrides: dict[str, Any] | None,
                  workers: int = 0) -> VisionRun:
    from ...training.train import fit

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
        from ...io.files import atomic_write_text

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


# -------------------------------------------------------------------------------------- info
def vision_info(preset: str, arch: str = "tokenformer") -> str:
    """Sizes, exact parameter count (by part) and training FLOPs per image of a preset."""
    tf = TokenFormerViTConfig.from_name(preset)
    config = tf if arch == "tokenformer" else ViTConfig.matched_to(tf)
    c = config
    if isinstance(c, TokenFormerViTConfig):
        blocks = (f"tokens       qkv {c.qkv_tokens}   proj {c.proj_tokens}   ffn {c.ffn_tokens}"
                  f"   Θ {c.norm}")
    else:
        blocks = f"MLP          {c.intermediate_size} (standard ViT, matched to {preset})"
    return "\n".join([
        f"model        {c.name} ({arch})",
        f"image        {c.image_size}×{c.image_size}×{c.num_channels}, patches "
        f"{c.patch_size}×{c.patch_size} ({c.num_patches}), pool {c.pool}, "
        f"{c.num_classes} classes",
        f"layers       {c.num_layers}   hidden {c.hidden_size}   heads {c.num_heads}",
        blocks,
        f"parameters   {c.num_parameters():,} total = {c.num_layers} × "
        f"{c.block_parameters():,} (blocks) + {c.stem_parameters():,} (patch embedding, "
        f"positions{', class token' if c.pool == 'cls' else ''}, final norm, head)",
        f"FLOPs        {c.training_flops_per_image():.4g} per training image "
        f"({c.training_flops_per_image() / 3:.4g} forward)",
    ])


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _train_command(a: argparse.Namespace) -> None:
    overrides = {k: v for k, v in (("steps", a.steps), ("batch_size", a.batch_size),
                                    ("lr", a.lr), ("seed", a.seed), ("threads", a.threads))
                 if v is not None}
    if a.lr is not None:
        overrides["min_lr"] = a.lr / 10  # the default recipe's ratio
    model_overrides = _parse_overrides(a.model_set)
    if a.data != "digits":
        from ...data.images import ImageFolder

        model_overrides.setdefault("num_classes", len(ImageFolder(a.data, "train").classes))
    run = train_vision(a.preset, a.data, arch=a.arch, out=a.out, max_shift=a.max_shift,
                       model_overrides=model_overrides, workers=_workers(a),
                       progress=False if a.no_progress else None, **overrides)
    fitted = run.fit
    print(f"{run.model.config.name} ({a.arch}, {run.model.num_parameters():,} parameters): "
          f"top-1 {100 * run.evaluation.accuracy:.2f}% on {a.data} "
          f"after {fitted.step} steps, {fitted.elapsed:.1f} s")
    if a.out is not None:
        print(f"run directory {a.out} (final/ checkpoint, metrics.jsonl, results.json)")
        print(f"confusion matrix {run.confusion_png}" if run.confusion_png else
              "confusion matrix PNG skipped: matplotlib is not installed "
              "(pip install 'tokenformer[plot]')")


def _workers(a: argparse.Namespace) -> int:
    """--workers, default: every core but one (decoding is per image; digits ignore it)."""
    if a.workers is not None:
        if a.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {a.workers}")
        return a.workers
    return 0 if a.data == "digits" else min(8, max(0, (os.cpu_count() or 1) - 1))


def _eval_command(a: argparse.Namespace) -> None:
    if a.confusion_png:
        from ...io.outputs import check_output

        check_output(a.confusion_png, [a.model, a.data if a.data != "digits" else None],
                     command="vision eval", overwrite=a.overwrite, kind="file",
                     flag="--confusion-png")
    model = load_vision_model(a.model)
    vdata = open_vision_data(a.data, model.config, EVAL_BATCH, workers=_workers(a))
    evaluation = evaluate(model, vdata.eval_batches())
    print(f"top-1 {100 * evaluation.accuracy:.2f}%   loss {evaluation.loss:.4f}")
    if a.confusion_png and not save_confusion_png(evaluation.confusion, vdata.classes,
                                                  a.confusion_png, f"top-1 "
                                                  f"{100 * evaluation.accuracy:.2f}%"):
        print("confusion matrix PNG skipped: matplotlib is not installed")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vision", help="Vision TokenFormer: presets, training, evaluation")
    vsub = p.add_subparsers(dest="vision_command", metavar="ACTION", required=True,
                            parser_class=type(p))
    presets = ", ".join(TokenFormerViTConfig.PRESETS)

    q = vsub.add_parser("info", help="parameters and FLOPs of a vision preset")
    q.add_argument("preset", help=presets)
    q.add_argument("--arch", choices=("tokenformer", "vit"), default="tokenformer",
                   help="vit: the standard ViT parameter-matched to the preset")
    q.set_defaults(func=lambda a: print(vision_info(a.preset, a.arch)))

    q = vsub.add_parser("train", help="train on digits (embedded) or an image folder")
    q.add_argument("--preset", default="vit-digits-tiny", help=presets)
    q.add_argument("--data", default="digits",
                   help="'digits' or an ImageNet-layout folder (root/{train,val}/<class>/*)")
    q.add_argument("--arch", choices=("tokenformer", "vit"), default="tokenformer")
    q.add_argument("--steps", type=int)
    q.add_argument("--batch-size", type=int)
    q.add_argument("--lr", type=float)
    q.add_argument("--seed", type=int)
    q.add_argument("--threads", type=int, help="torch threads (default 1; 0: torch's choice)")
    q.add_argument("--max-shift", type=int, default=1, help="digits: random shift in pixels")
    q.add_argument("--set", dest="model_set", action="append", default=[], metavar="KEY=VALUE",
                   help="model config override, e.g. --set pool=mean --set image_size=64")
    q.add_argument("--out", default=None, help="run directory (checkpoint, metrics, PNG)")
    q.add_argument("--workers", type=int, default=None,
                   help="image folders: DataLoader processes decoding images ahead (default: "
                        "CPU cores - 1, at most 8; 0: decode in the training process)")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=_train_command)

    q = vsub.add_parser("eval", help="top-1 accuracy of a trained vision model")
    q.add_argument("model", help="a run's final/ directory (or any saved vision model)")
    q.add_argument("--data", default="digits")
    q.add_argument("--confusion-png", default=None)
    q.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    q.add_argument("--workers", type=int, default=None,
                   help="image folders: DataLoader processes decoding images (default: CPU "
                        "cores - 1, at most 8)")
    q.set_defaults(func=_eval_command)

