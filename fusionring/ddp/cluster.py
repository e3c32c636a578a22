"""Cluster-and-hash quantization (``Compression.cluster``) as a DDP communication hook.

```python
from fusionring.ddp import hooks
state = hooks.ClusterState(process_group=None, k=16)      # error feedback on by default
ddp_model.register_comm_hook(state, hooks.cluster_hook)
```

Every rank encodes its bucket (plus what it kept back) with its own codebook, so the payloads
are not summable: one allgather of the compressed buckets (about log2(k) bits per value), then
every rank decodes and adds all of them in rank order, the same sum everywhere. Each rank
receives P - 1 payloads where a dense ring moves 2 (P - 1) / P buckets, so at k=16 against
float32 gradients the allgather moves fewer bytes up to P = 16 ranks.
"""
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist

from ..compression import ClusterCompressor
from .state import HookState, mean_into_bucket


class ClusterState(HookState):
    """State of :func:`cluster_hook`: the quantizer's configuration (as ``Compression.cluster``),
    its per-bucket residuals and its sampling stream's position, saved by ``state_dict()`` and by
    pickling (``torch.save(state)``)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, k: int = 16,
                 sample: int = 4096, buckets: Optional[int] = None,
                 values: Union[torch.dtype, str] = torch.float32, error_feedback: bool = True,
                 seed: int = 0) -> None:
        super().__init__(process_group)
        self.compressor = ClusterCompressor(k, sample, buckets, values, error_feedback, seed)

    def config(self) -> Dict[str, Any]:
        return self.compressor.state_dict()["config"]

    def codec_state(self) -> Dict[str, Any]:
        state = self.compressor.state_dict()
        return {"position": state["position"], "residuals": state["residuals"]}

    def load_codec_state(self, state: Dict[str, Any]) -> None:
        self.compressor.load_state_dict(dict(state, config=self.config()))

    def keys(self):
        return list(self.compressor.memory.residuals)

    def residual_store(self):
        compressor = self.compressor
        return (compressor.memory.residuals, compressor._lock) if compressor.error_feedback else None

    def forget(self, keys) -> None:
        self.compressor.forget(keys)

    def __repr__(self) -> str:
        return f"ClusterState({self.compressor.name})"


def cluster_hook(state: ClusterState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Quantize `bucket`, allgather the payloads over ``state``'s group, return the decoded average."""
    HookState.check_hook(state, "cluster_hook", ClusterState)
    state.agree("cluster_hook", bucket)
    group = state.group()
    size = group.size()
    buffer = bucket.buffer()
    compressor = state.compressor
    # The bucket is scratch space: its decoded average replaces it.
    payload, ctx = compressor.compress(buffer, name=state.key(bucket), scratch=True)
    state.end_of_step(bucket)
    gathered = [torch.empty_like(payload) for _ in range(size)]
    future = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        return mean_into_bucket(buffer, gathered, compressor.decode_add, ctx.count,
                                payload.device)

    return future.then(decode)
