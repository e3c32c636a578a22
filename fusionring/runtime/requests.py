"""A submitted operation (Request) and the runtime's counters (Stats)."""
from __future__ import annotations

import _thread
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..negotiation import Ready, TensorSpec
from ..reduction import ReductionContext


class Done:
    """Whether a request has finished: set once by the background loop, waited on by callers.

    ``threading.Event``'s interface on one lock, held from creation and released by set();
    wait() takes it and hands it straight back, so every waiter passes once it is set. An
    Event builds a Condition and its locks, and every gradient of every step makes a request
    on the training thread.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._set:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        self._release()
        return True

    def _release(self) -> None:
        # Two threads setting at once (a failure racing a completion) release it twice:
        # the second finds it already free, which is the state both want.
        try:
            self._lock.release()
        except RuntimeError:
            pass


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted operation; `output` receives the result in place."""

    name: str
    spec: TensorSpec
    tensor: torch.Tensor                 # contiguous input (CPU, or CUDA for spec.device)
    output: Optional[torch.Tensor]       # contiguous result buffer (may be `tensor`)
    core_op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    handle: int = -1
    submitted_at: float = 0.0
    ready_info: Optional[Ready] = None
    done: Done = dataclasses.field(default_factory=Done)
    error: Optional[BaseException] = None
    payload: Any = None                  # kind-specific data (e.g. fusion groups)
    # (submission, place) of a request submitted in a group (submit_group): a compressed
    # group is laid out in its given order, not in the order its names were first negotiated.
    group_place: Optional[Tuple[int, int]] = None
    # A compressor that reduces inside the runtime: called on the background thread as
    # communicator(ReductionContext) in place of the plain ring allreduce; it reads and
    # writes each output where it lies (no pack or unpack copy) and returns the bytes it sent.
    communicator: Optional[Callable[[ReductionContext], Optional[int]]] = None
    # A CUDA tensor reduced on its GPU: the event its producer's stream recorded at
    # submission, which the NCCL stream waits for before it reads the tensor.
    ready_event: Any = None

    nbytes: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        # Asked for many times per cycle (scheduling, routing, counting); the tensor is fixed.
        self.nbytes = self.tensor.numel() * self.tensor.element_size()


@dataclasses.dataclass
class Stats:
    """Counters for benchmarks and the training example."""

    cycles: int = 0
    full_exchanges: int = 0
    allreduce_batches: int = 0
    allreduce_tensors: int = 0
    allreduce_bytes: int = 0
    bytes_sent: int = 0
    # Bytes copied into the threshold-fusion buffer (and back out): gradients laid out back
    # to back in their batch's order are reduced where they lie and add nothing here.
    packed_bytes: int = 0
    # Batches the negotiation round reduced itself (the window's band_then_allreduce): also
    # counted in allreduce_batches.
    batches_in_round: int = 0
    batch_bytes: List[int] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def count_batch(self, tensors: int, nbytes: int, sent: int) -> None:
        """One allreduce batch: `tensors` tensors, `nbytes` reduced, `sent` bytes sent."""
        self.allreduce_batches += 1
        self.allreduce_tensors += tensors
        self.allreduce_bytes += nbytes
        self.bytes_sent += sent
        self.batch_bytes.append(nbytes)
        if len(self.batch_bytes) > 100000:
            del self.batch_bytes[:50000]
