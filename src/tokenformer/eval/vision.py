"""Vision accuracy: top-1, loss and the confusion matrix of an image classifier, and its plot."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..io.files import atomic_write


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
    try:  # the caller's mode comes back even when a batch fails (as evaluate_text does)
        for pixel_values, labels in batches:
            out = model(pixel_values, labels=labels)
            counts += torch.bincount(labels * k + out.logits.argmax(-1), minlength=k * k)
            loss_sum += float(out.loss) * len(labels)
            n += len(labels)
    finally:
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
