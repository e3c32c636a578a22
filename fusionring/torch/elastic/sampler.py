"""``horovod.torch.elastic.sampler``'s ``ElasticSampler``: partitions the samples not yet
processed this epoch across the ranks."""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterable, Iterator, List, Set, Tuple

import torch

from ...exceptions import NotInitializedError
from ..functions import allgather_object, is_initialized, rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions the samples not yet processed this epoch across the ranks.

    Like ``DistributedSampler``: the epoch's order (shuffled with ``seed + epoch`` when
    `shuffle`, the same on every rank) is padded by repeating its first indices until it
    divides evenly, and rank r takes every size()-th index starting at r, so every rank
    has ``len(sampler)`` samples. ``record_batch`` marks a batch as processed on every
    rank; ``reset()`` re-partitions what is left. Keep it in a ``TorchState`` so commits
    save its progress, and call ``set_epoch`` at the end of each epoch.

    Args:
        dataset: the dataset to sample (of constant size).
        shuffle: shuffle the indices each epoch (default True).
        seed: shuffling seed, the same on every rank (default 0).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        # Indices from record_indices() that other ranks have not seen yet.
        self._unshared: Set[int] = set()
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._padded: List[int] = []
        self._recorded = 0
        self._order_key: Tuple[int, bool, int, int] = (-1, False, 0, 0)
        self._order: List[int] = []
        self.reset()

    def _epoch_order(self) -> List[int]:
        """The epoch's order of the dataset's indices (kept: state_dict() needs it at every
        commit, and a shuffle of a large dataset is not free). Not to be modified."""
        key = (len(self.dataset), self.shuffle, self.seed, self.epoch)
        if key != self._order_key:
            order = list(range(key[0]))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order_key, self._order = key, order
        return self._order

    @property
    def processed_num(self) -> int:
        """How many samples of this epoch are processed (Horovod's count; as sample
        indices are counted once, it stops at the dataset's size)."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, value: int) -> None:
        # Horovod's meaning: the first `value` indices of the epoch's order are processed.
        self.processed_indices = set(self._epoch_order()[:int(value)])
        self._unshared = set()

    def _processed_is_prefix(self) -> bool:
        """Whether the processed indices are the first ones of the epoch's order (always so
        with record_batch; record_indices may mark others)."""
        processed = self.processed_indices
        return all(i in processed for i in self._epoch_order()[:len(processed)])

    def reset(self) -> None:
        """Re-partition the indices not processed yet this epoch across the ranks."""
        if is_initialized():
            self.num_replicas, self.rank = size(), rank()
        elif self.num_replicas == 0:
            raise NotInitializedError("creating an ElasticSampler")
        self.remaining_indices = [i for i in self._epoch_order()
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:  # fewer samples than ranks: repeat
            padded += self.remaining_indices[:self.total_size - len(padded)]
        self._padded = padded
        self._recorded = 0   # how much of the partition record_batch has marked
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: a new order (seed + epoch) and no processed indices."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self._unshared = set()
        self.reset()

    def _batch_bounds(self, batch_idx: int, batch_size: int) -> Tuple[int, int]:
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"batch_idx must be >= 0 and batch_size >= 1, got {batch_idx} "
                             f"and {batch_size}")
        start = min(batch_idx * batch_size, self.num_samples)
        return start, min(start + batch_size, self.num_samples)

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """This rank's dataset indices of batch `batch_idx` of the current partition."""
        start, stop = self._batch_bounds(batch_idx, batch_size)
        return self.indices[start:stop]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark the next batch as processed: `batch_size` samples on every rank.

        As in Horovod, `batch_idx` is not used (a data loader's count starts again after
        ``reset()``, a partition's does not): each call marks the next ``batch_size *
        size()`` indices of the partition, all ranks' samples of one step, since every rank
        trains on its share of them in that step and the partition is the same everywhere.
        """
        self._batch_bounds(batch_idx, batch_size)   # checks both
        step = batch_size * self.num_replicas
        self.processed_indices.update(self._padded[self._recorded:self._recorded + step])
        self._recorded += step

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset indices processed by this rank; shared with all ranks on commit."""
        indices = {int(i) for i in indices}
        self.processed_indices.update(indices)
        self._unshared.update(indices)

    def _share_recorded_indices(self) -> None:
        """Merge every rank's ``record_indices`` (a collective call, on every rank)."""
        for recorded in allgather_object(sorted(self._unshared)):
            self.processed_indices.update(recorded)
        self._unshared = set()

    def state_dict(self) -> Dict[str, Any]:
        """Horovod's form, ``{"epoch", "processed_num"}`` (the first processed_num indices of
        the epoch's order are processed). When ``record_indices`` marked others, the
        processed indices (as seen by this rank) are added as ``"processed_indices"``."""
        state: Dict[str, Any] = {"epoch": self.epoch, "processed_num": self.processed_num}
        if not self._processed_is_prefix():
            state["processed_indices"] = set(self.processed_indices)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a ``state_dict()`` (Horovod's, or one with ``"processed_indices"``, which
        takes precedence) and re-partition."""
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        elif "processed_num" in state_dict:
            self.processed_indices = set(self._epoch_order()[:int(state_dict["processed_num"])])
        else:
            raise KeyError("ElasticSampler state_dict needs 'processed_indices' or "
                           "'processed_num'")
        self._unshared = set()
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples

