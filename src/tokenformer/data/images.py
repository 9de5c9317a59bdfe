"""Image data for the vision models: scikit-learn's digits (embedded, offline) and image folders.

Both produce float32 ``[N or B, C, H, W]`` tensors normalised per channel, with integer labels.
Batches are a pure function of (seed, step), like the LM data, so training is reproducible and
resumable. Needs the ``vision`` extra (scikit-learn for digits, Pillow for folders).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError, DataError
from ..io.paths import regular_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm")
DIGITS_TEST_SIZE = 360  # 20 % of 1797
DIGITS_SPLIT_SEED = 0


@dataclass
class ImageSplit:
    """Images in [0, 1] (``[N, C, H, W]`` float32), labels, and the normalisation to apply."""

    images: torch.Tensor
    labels: torch.Tensor
    mean: torch.Tensor  # [C]
    std: torch.Tensor  # [C]
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def normalized(self, images: torch.Tensor | None = None) -> torch.Tensor:
        images = self.images if images is None else images
        return (images - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)


def _require(module: str, extra: str = "vision"):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{module} is not installed; install the extra: "
                          f"pip install 'tokenformer[{extra}]'") from None


# ------------------------------------------------------------------------------------------ digits
def load_digits_split() -> tuple[ImageSplit, ImageSplit]:
    """scikit-learn's 8×8 handwritten digits (1797 images, 10 classes), split once for all.

    The split is fixed: a permutation of the 1797 indices by ``numpy.random.default_rng(0)``
    (whose stream NumPy keeps stable); its last 360 images are the test set, the first 1437 the
    training set. Pixels (0..16) are scaled to [0, 1]; normalisation uses the training set's
    mean and standard deviation.
    """
    datasets = _require("sklearn.datasets")
    digits = datasets.load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels)))
    train_idx, test_idx = order[:-DIGITS_TEST_SIZE], order[-DIGITS_TEST_SIZE:]
    mean, std = images[train_idx].mean().view(1), images[train_idx].std().view(1)
    classes = [str(i) for i in range(10)]
    return (ImageSplit(images[train_idx], labels[train_idx], mean, std, classes),
            ImageSplit(images[test_idx], labels[test_idx], mean, std, classes))


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels in x and y, filling with zeros
    (the digits' background): the light augmentation used for digits."""
    if max_shift <= 0:
        return images
    B, _, H, W = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, B, 1), generator=generator)
    rows = (torch.arange(H) + dy)[:, :, None]  # [B, H, 1]
    cols = (torch.arange(W) + dx)[:, None, :]  # [B, 1, W]
    batch = torch.arange(B)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


def batch_fn(split: ImageSplit, batch_size: int, seed: int = 0, max_shift: int = 1
             ) -> Callable[[int], dict[str, torch.Tensor]]:
    """``step → {"pixel_values", "labels"}``: a random batch (with replacement across steps,
    without within one) and random shifts, both a pure function of (seed, step)."""
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size}")
    n = len(split)

    def make(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randperm(n, generator=g)[: min(batch_size, n)]
        images = random_shift(split.images[idx], max_shift, g)
        return {"pixel_values": split.normalized(images), "labels": split.labels[idx]}

    return make


# ------------------------------------------------------------------------------------ image folder
class ImageFolder(torch.utils.data.Dataset):
    """ImageNet layout: ``root/<split>/<class>/<image>``, decoded lazily with Pillow and NumPy.

    Classes are the sorted sub-folder names of ``root/train`` (so train and val agree on label
    numbers); a val class missing from train is an error. Every image is converted to the
    dataset's mode — ``num_channels=3``: RGB (grayscale is replicated into three channels,
    palette images are expanded, an alpha channel is dropped); ``num_channels=1``: grayscale
    (luma) — so folders that mix grayscale and colour images load without surprises. Training
    images get a random crop (35–100 % of the area) resized to ``image_size`` and a random
    horizontal flip (a pure function of (seed, step) in :meth:`batch_fn`); evaluation images
    are resized so the shorter side is ``image_size / 0.875`` and centre-cropped. Pixels are
    normalised with the ImageNet mean/std (0.5/0.5 for grayscale).
    """

    def __init__(self, root: str | Path, split: str = "train", image_size: int = 224,
                 num_channels: int = 3, train: bool | None = None) -> None:
        self.root = Path(root)
        self.split = split
        self.image_size = image_size
        self.num_channels = num_channels
        self.train = split == "train" if train is None else train
        if num_channels not in (1, 3):
            raise ConfigError(f"num_channels must be 1 or 3, got {num_channels}")
        self.classes = _class_folders(self.root, "train")
        split_classes = self.classes if split == "train" else _class_folders(self.root, split)
        unknown = sorted(set(split_classes) - set(self.classes))
        if unknown:
            raise DataError(f"{self.root / split / unknown[0]}: class {unknown[0]!r} has no folder "
                            f"in {self.root / 'train'}")
        self.samples: list[tuple[Path, int]] = []
        for name in split_classes:
            folder = self.root / split / name
            with os.scandir(folder) as it:
                entries = [e for e in it if Path(e.name).suffix.lower() in IMAGE_SUFFIXES]
            for entry in entries:  # checked now, not at its first batch, which a FIFO would hang
                if not entry.is_file(follow_symlinks=False):  # the listing's type: no stat
                    regular_file(entry.path, "image")  # links are followed: a user's folder
            files = sorted(Path(e.path) for e in entries)
            if not files:
                raise DataError(f"{folder} holds no images (expected files ending in "
                                f"{', '.join(IMAGE_SUFFIXES)})")
            self.samples += [(p, self.classes.index(name)) for p in files]
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if num_channels == 3 else ((0.5,), (0.5,))
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """One image and its label; training crops are freshly random on every call (as in
        torchvision) — :meth:`batch_fn` gives reproducible ones."""
        path, label = self.samples[index]
        return self.load(path, np.random.default_rng() if self.train else None), label

    def load(self, path: Path, rng: np.random.Generator | None = None) -> torch.Tensor:
        """Decode, convert, crop/resize and normalise one image to ``[C, size, size]``."""
        Image = _require("PIL.Image")
        try:
            with Image.open(path) as img:
                img = img.convert("RGB" if self.num_channels == 3 else "L")
                img = self._crop_resize(img, rng, Image)
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise DataError(f"{path}: cannot decode image ({exc})".splitlines()[0]) from None
        pixels = np.asarray(img, dtype=np.float32) / 255.0
        tensor = torch.from_numpy(pixels.reshape(self.image_size, self.image_size, -1))
        tensor = tensor.permute(2, 0, 1)
        return (tensor - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)

    def _crop_resize(self, img, rng: np.random.Generator | None, Image):
        size, (w, h) = self.image_size, img.size
        if rng is None:  # evaluation: resize the shorter side, centre crop
            short = round(size / 0.875)
            scale = short / min(w, h)
            img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))),
                             Image.BICUBIC)
            w, h = img.size
            left, top = (w - size) // 2, (h - size) // 2
            return img.crop((left, top, left + size, top + size))
        area = w * h * rng.uniform(0.35, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = min(w, max(1, round(np.sqrt(area * aspect))))
        ch = min(h, max(1, round(np.sqrt(area / aspect))))
        left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        img = img.resize((size, size), Image.BICUBIC, box=(left, top, left + cw, top + ch))
        return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else img

    def batch(self, batch_size: int, seed: int, step: int) -> dict[str, torch.Tensor]:
        """Training batch ``step``: a pure function of (seed, step), whoever computes it."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(self), (batch_size,), generator=g).tolist()
        images = [self.load(self.samples[i][0], np.random.default_rng((seed, step, j))
                            if self.train else None) for j, i in enumerate(idx)]
        return {"pixel_values": torch.stack(images),
                "labels": torch.tensor([self.samples[i][1] for i in idx])}

    def batch_fn(self, batch_size: int, seed: int = 0, workers: int = 0, prefetch: int = 2
                 ) -> Callable[[int], dict[str, torch.Tensor]]:
        """``step → {"pixel_values", "labels"}``, a pure function of (seed, step). With
        ``workers > 0`` the batches are decoded ahead, in that many DataLoader processes
        (``prefetch`` batches each), so training is not bound by Pillow; the batches are the
        same as with ``workers=0``."""
        if workers <= 0:
            return functools.partial(self.batch, batch_size, seed)
        return PrefetchedBatches(self, batch_size, seed, workers, prefetch)


class _StepDataset(torch.utils.data.Dataset):
    """Index = training step, item = that step's whole batch (picklable for worker processes)."""

    def __init__(self, folder: ImageFolder, batch_size: int, seed: int) -> None:
        self.folder, self.batch_size, self.seed = folder, batch_size, seed

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        return self.folder.batch(self.batch_size, self.seed, step)


class PrefetchedBatches:
    """``step → batch`` like :meth:`ImageFolder.batch`, computed ahead by a ``DataLoader``.

    The loader walks the steps from the first one asked for; asking for any other step than
    the next (a resumed run, a rerun) restarts it there, so the result never depends on the
    order of calls. Worker processes end with :meth:`close` or when this object is collected.
    """

    def __init__(self, folder: ImageFolder, batch_size: int, seed: int, workers: int,
                 prefetch: int = 2) -> None:
        self.dataset = _StepDataset(folder, batch_size, seed)
        self.workers, self.prefetch = workers, prefetch
        self._iter: Any = None
        self._next = -1

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        if self._iter is None or step != self._next:
            self.close()
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=None, sampler=itertools.count(step),
                num_workers=self.workers, prefetch_factor=self.prefetch)
            self._iter = iter(loader)
        self._next = step + 1
        return next(self._iter)

    def close(self) -> None:
        self._iter = None  # the last reference: the iterator's finaliser stops its workers


def _class_folders(root: Path, split: str) -> list[str]:
    folder = root / split
    if not root.is_dir():
        raise DataError(f"image folder not found: {root}")
    if not folder.is_dir():
        raise DataError(f"{root} is not in ImageNet layout: {folder} is missing "
                        f"(expected {root}/{split}/<class>/<image>)")
    stray = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if stray:
        raise DataError(f"{stray[0]}: images must sit in one sub-folder per class "
                        f"({folder}/<class>/<image>), not directly in {folder}")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} has no class sub-folders (expected {folder}/<class>/<image>)")
    return classes
