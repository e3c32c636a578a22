"""Small real data sets that ship with a package (no downloads), for examples and benchmarks."""
from __future__ import annotations

from typing import Tuple

import torch

Split = Tuple[torch.Tensor, torch.Tensor]


def load_digits_split(seed: int) -> Tuple[Split, Split]:
    """scikit-learn's bundled digits (1797 8x8 images): 80% train, 20% test, shuffled by `seed`.

    Returns ((x_train, y_train), (x_test, y_test)); pixels scaled to [0, 1].
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])
