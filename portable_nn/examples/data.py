"""The demo's data: scikit-learn's bundled handwritten digits and a fixed held-out split.

``sklearn.datasets.load_digits`` ships with scikit-learn (1,797 8x8 grey images of the digits
0-9, pixel values 0-16, no download).  Importing scikit-learn takes seconds (it imports
``scipy.stats``), several times the ``--quick`` run's training, so :func:`read_digits` reads the
file ``load_digits`` reads, ``sklearn/datasets/data/digits.csv.gz``, the same way, without
importing the package, and falls back to ``load_digits`` if the file is not where it is expected
(a test checks that both give the same arrays).

The held-out split is stratified (the same fraction of every class) and drawn from a generator
with a fixed seed, :data:`SPLIT_SEED`, so every ``--seed`` trains on the same images and is scored
on the same held-out ones: seeds then differ only in initialisation and batch order, and their
accuracies are comparable.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["HELD_OUT_FRACTION", "SPLIT_SEED", "Digits", "batches", "load", "read_digits", "stratified_split"]

SPLIT_SEED = 20_240_607
HELD_OUT_FRACTION = 0.25
N_CLASSES = 10


@dataclass(frozen=True)
class Digits:
    """The digits, split and scaled, as NumPy arrays.

    Attributes:
        x_train, x_test: ``(N, 1, 8, 8)`` images, standardised with the training pixels' mean and
            standard deviation (one scalar each, so the held-out images leak nothing).
        y_train, y_test: ``(N,)`` int64 class labels.
        sklearn_version: the scikit-learn that supplied the data.
        n_total: images in the whole data set (before any ``--quick`` subset).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    sklearn_version: str
    n_total: int

    def astype(self, dtype: np.dtype | type) -> Digits:
        """The same data with the images in ``dtype`` (labels stay int64)."""
        return Digits(self.x_train.astype(dtype), self.y_train, self.x_test.astype(dtype), self.y_test,
                      self.sklearn_version, self.n_total)

    def subset(self, n_train: int) -> Digits:
        """The first ``n_train`` training images (already in random order), for ``--quick``."""
        return Digits(self.x_train[:n_train], self.y_train[:n_train], self.x_test, self.y_test,
                      self.sklearn_version, self.n_total)


def stratified_split(labels: np.ndarray, fraction: float, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, held_out)`` with ``round(fraction · n_c)`` held out of each class c.

    The draw uses only ``seed`` (never the training seed).  Both index arrays come back in a
    shuffled order, so a prefix of the training indices is itself a mix of all classes.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    train, held_out = [], []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        k = round(fraction * members.size)
        held_out.append(members[:k])
        train.append(members[k:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(held_out))


def _bundled_file() -> Path | None:
    """``digits.csv.gz`` inside the installed scikit-learn, found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def read_digits() -> tuple[np.ndarray, np.ndarray, str]:
    """``(images (1797, 8, 8) float64, labels (1797,) int64, scikit-learn version)``.

    Raises:
        ImportError: scikit-learn is missing (``pip install -e ".[examples]"``).
    """
    path = _bundled_file()
    if path is None:
        raise ImportError('the demo needs scikit-learn for its data set: pip install -e ".[examples]"')
    version = importlib.metadata.version("scikit-learn")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    if table.ndim == 2 and table.shape[1] == 65:  # 64 pixels, then the label, one image a row
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64), version
    from sklearn.datasets import load_digits  # the file changed format: ask scikit-learn itself

    bunch = load_digits()
    return np.asarray(bunch.images, np.float64), np.asarray(bunch.target, np.int64), version


def load(dtype: np.dtype | type = np.float32) -> Digits:
    """scikit-learn's digits, split by :func:`stratified_split` and standardised.

    Raises:
        ImportError: scikit-learn is missing (``pip install -e ".[examples]"``).
    """
    images, labels, version = read_digits()
    train, held_out = stratified_split(labels, HELD_OUT_FRACTION)
    mean = images[train].mean()
    std = images[train].std()
    scaled = ((images - mean) / std)[:, None, :, :].astype(dtype)
    return Digits(scaled[train], labels[train], scaled[held_out], labels[held_out], version, int(labels.size))


def batches(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A shuffled epoch: index arrays of ``batch_size``, the last one possibly shorter.

    A last batch of a single image is merged into the one before it: batch normalisation needs
    more than one value per channel in training.
    """
    order = rng.permutation(n)
    cuts = list(range(batch_size, n, batch_size))
    if cuts and n - cuts[-1] < 2:
        cuts.pop()
    return np.split(order, cuts)
