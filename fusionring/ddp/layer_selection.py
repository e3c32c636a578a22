"""Layer selection as a DDP communication hook: k whole layers travel each step, the rest wait.

```python
from fusionring.ddp import hooks
from fusionring.selection import LayerSelection
state = hooks.LayerSelectionState(process_group=None, selection=LayerSelection.norm(0.25),
                                  model=model)
ddp_model.register_comm_hook(state, hooks.layer_selection_hook)
```

The choice of layers needs every layer's gradient, and DDP hands gradients over bucket by
bucket, so the hook holds each bucket (returning a future it completes later) until the last
one arrives. Then, as ``DistributedOptimizer(layer_selection=...)`` does (docs/layer-selection.md):
every rank adds its gradients to what it kept back, scores its layers, the scores are summed by
one allreduce of one float64 per layer, and every rank takes the same top k. The chosen layers'
accumulated gradients travel as one allreduce of their concatenation; the bucket slices of the
other layers are set to zero and their sums stay in the residual until they are chosen.

Where DDP differs from the optimizer path: an unchosen layer's gradient is zero, not None, so a
wrapped optimizer with momentum or weight decay still moves it (identically on every replica).
"""

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..selection import (HyperSelector, LayerSelector, NormSelector, RandomSelector,
                         RoundRobinSelector)
from .state import HookState

# Names accepted for `selection`, with the class each builds (fraction 0.25, as `hyper`'s default).
_KINDS = {"hyper": HyperSelector, "norm": NormSelector, "round_robin": RoundRobinSelector,
          "random": RandomSelector}
_DEFAULT_FRACTION = 0.25


def _describe(selector: LayerSelector) -> Dict[str, Any]:
    """Plain-typed constructor arguments of `selector` (its learned state is saved apart)."""
    kind = next(name for name, cls in _KINDS.items() if type(selector) is cls)
    description = {"kind": kind, "fraction": selector.fraction, "k": selector.k_arg,
                   "max_wait": selector.max_wait, "warmup_steps": selector.warmup_steps}
    if isinstance(selector, HyperSelector):
        description.update(ema=selector.ema, hidden=selector.hidden, lr=selector.lr,
                           seed=selector.seed, accumulate=selector.accumulate)
    if isinstance(selector, RandomSelector):
        description["seed"] = selector.seed
    return description


def _build(description: Dict[str, Any]) -> LayerSelector:
    args = dict(description)
    kind = args.pop("kind")
    warmup_steps = int(args.pop("warmup_steps", 0))   # a description saved before it existed has none
    if kind == "hyper":
        return HyperSelector(None, args.pop("fraction"), args.pop("k"), warmup_steps=warmup_steps,
                             **args)
    if kind == "random":
        return RandomSelector(args["fraction"], args["k"], args.get("seed", 0), args["max_wait"],
                              warmup_steps=warmup_steps)
    return _KINDS[kind](args["fraction"], args["k"], args["max_wait"], warmup_steps=warmup_steps)


class LayerSelectionState(HookState):
    """State of :func:`layer_selection_hook`: the selector, its residuals and this step's buckets.

    `selection`: a selector as ``DistributedOptimizer(layer_selection=...)`` takes
    (``LayerSelection.norm(fraction)``, ``.round_robin``, ``.random``, ``.hyper(model)``), or one
    of the names "norm", "round_robin", "random", "hyper" (a quarter of the layers). `model`: the
    module whose parameters DDP reduces (the model or the DDP wrapper), needed unless the selector
    was built with ``model=``: a bucket shows DDP's parameters, not their layers.

    The state pickles (``torch.save(state)``) and has a ``state_dict()`` that
    ``torch.load(..., weights_only=True)`` reads; neither holds the model or the process group,
    so a loaded state is given the model again: ``from_state_dict(sd, model=model)`` or
    ``state.attach(model)``.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 selection: Union[LayerSelector, str, Dict[str, Any]] = "norm",
                 model: Optional[torch.nn.Module] = None) -> None:
        super().__init__(process_group)
        if isinstance(selection, str):
            if selection not in _KINDS:
                raise ValueError(f"LayerSelectionState: selection={selection!r} is not one of "
                                 f"{sorted(_KINDS)} or a LayerSelection selector")
            selection = _build({"kind": selection, "fraction": _DEFAULT_FRACTION, "k": None,
                                "max_wait": None})
        elif isinstance(selection, dict):   # a description from `config()` (loading)
            selection = _build(selection)
        elif not isinstance(selection, LayerSelector):
            raise ValueError(f"LayerSelectionState: selection must be a LayerSelection selector "
                             f"or a name, not {type(selection).__name__}")
        self.selection = selection
        self._config = {"selection": _describe(selection)}
        self._names: Dict[int, str] = {}    # id(parameter) -> name, from the attached model
        self._pending: List[Tuple[torch.Tensor, List[Tuple[str, int, int]], torch.futures.Future]] = []
        self.last_chosen: List[int] = []     # layer indices sent by the last step (every rank's)
        if model is not None:
            self.attach(model)
        elif selection.layers:
            self._names = {id(p): n for n, p in selection.params.items()}

    def attach(self, model: torch.nn.Module) -> None:
        """Learn `model`'s layers; a selector built with its own model must hold the same ones."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"LayerSelectionState: model= must be a torch.nn.Module (the model or "
                            f"its DDP wrapper), not {type(model).__name__}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if self.selection.params:
            if {id(p) for p in self.selection.params.values()} != {id(p) for _, p in named}:
                raise ValueError("LayerSelectionState: model= holds other parameters than the "
                                 "model the selector was built with")
        else:
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                named = [(n[len("module."):], p) for n, p in named]
            loaded = self.__dict__.pop("_loaded", None)
            self.selection.layers = []
            self.selection.attach(named)
            if loaded is not None:
                self.load_codec_state(loaded)
        self._names = {id(p): n for n, p in self.selection.params.items()}

    # ---------------------------------------------------------------- HookState surface
    def config(self) -> Dict[str, Any]:
        return self._config

    def shared_settings(self) -> Dict[str, Any]:
        # What decides how many layers travel; a selector's own learning (seed, lr, ...) may
        # differ by rank, as the ranks agree on the layers by summing their scores.
        selection = self._config["selection"]
        return {key: selection[key] for key in ("kind", "fraction", "k", "max_wait", "warmup_steps")}

    def codec_state(self) -> Dict[str, Any]:
        if "_loaded" in self.__dict__:
            return self._loaded   # loaded, not attached yet: save what was loaded
        return {"layers": [list(names) for names in self.selection.layers],
                "selector": self.selection.state_dict()}

    def load_codec_state(self, state: Dict[str, Any]) -> None:
        if self.selection.params:
            if [list(n) for n in self.selection.layers] != [list(n) for n in state["layers"]]:
                raise ValueError("LayerSelectionState: the saved state names other layers "
                                 f"({state['layers'][:3]}...) than the model's "
                                 f"({self.selection.layers[:3]}...)")
            self.selection.load_state_dict(state["selector"])
        else:
            # No model yet: keep the state until `attach` tells parameters their names.
            self.selection.layers = [list(n) for n in state["layers"]]
            self._loaded = state

    def keys(self):
        """Names of the parameters that hold a residual."""
        acc = self.selection.acc
        if acc is None:
            loaded = self.__dict__.get("_loaded")
            return sorted(loaded["selector"]["acc"]["residual"]) if loaded else []
        return sorted(acc.residual)

    def forget(self, keys) -> None:
        """Residuals are kept per parameter, not per bucket: DDP rebuilding buckets loses none."""

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any], process_group: Optional[dist.ProcessGroup] = None,
                        model: Optional[torch.nn.Module] = None) -> "LayerSelectionState":
        """A new state from ``state_dict()``, attached to `model` when given."""
        new = super().from_state_dict(state, process_group)
        if model is not None:
            new.attach(model)
        return new

    def __repr__(self) -> str:
        described = self._config["selection"]
        amount = f"k={described['k']}" if described["k"] is not None else f"fraction={described['fraction']}"
        return f"LayerSelectionState({described['kind']}, {amount})"

    # ---------------------------------------------------------------- one step
    def _slices(self, bucket: dist.GradBucket) -> List[Tuple[str, int, int]]:
        """(parameter name, offset, count) of each parameter in `bucket`'s flat buffer."""
        if not self._names:
            raise RuntimeError("LayerSelectionState has no model: pass model= (or a selector "
                               "built with model=), or call state.attach(model) after loading")
        out, offset = [], 0
        for p in bucket.parameters():
            name = self._names.get(id(p))
            if name is None:
                raise ValueError(f"LayerSelectionState: bucket {bucket.index()} holds a parameter "
                                 f"of shape {tuple(p.shape)} that the attached model does not own")
            out.append((name, offset, p.numel()))
            offset += p.numel()
        if offset != bucket.buffer().numel():
            raise RuntimeError(f"LayerSelectionState: bucket {bucket.index()} holds "
                               f"{bucket.buffer().numel()} values, its parameters {offset}")
        return out

    def _reduce(self, group: dist.ProcessGroup) -> torch.futures.Future:
        """Agree on the layers over every held bucket, start their allreduce, return its future."""
        selection, acc = self.selection, self.selection.acc
        size = group.size()
        summed: Dict[str, torch.Tensor] = {}
        for buffer, slices, _ in self._pending:
            for name, offset, count in slices:
                summed[name] = acc.add(name, buffer.narrow(0, offset, count).detach())
        # DDP runs hooks inside backward, where grad mode is off; the hypernetwork trains here.
        with torch.enable_grad():
            # On the buckets' device: an NCCL group reduces GPU tensors only.
            scores = torch.tensor(selection.scores(summed), dtype=torch.float64,
                                  device=self._pending[0][0].device)
        if size > 1:
            dist.all_reduce(scores, group=group)   # a few hundred bytes; every rank, same sums
        chosen = selection.choose(scores.tolist())
        selection.step_count += 1
        sent = [n for i in chosen for n in selection.layers[i] if n in summed]
        acc.settle(chosen, selection.layers, summed)
        self.last_chosen = chosen
        pending, self._pending = self._pending, []

        if sent:
            # float32 sums for 16-bit layers; a float64 model's layers are summed in float64.
            wide = torch.float64 if any(summed[n].dtype == torch.float64 for n in sent) \
                else torch.float32
            flat = torch.cat([summed[n].reshape(-1).to(wide) for n in sent])
            future = dist.all_reduce(flat, group=group, async_op=True).get_future()
        else:
            flat = torch.zeros(0)
            future = torch.futures.Future()
            future.set_result([flat])

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            try:
                average = fut.value()[0].div_(size)
                at, where = 0, {}
                for n in sent:
                    count = summed[n].numel()
                    where[n] = average[at:at + count]
                    at += count
                for buffer, slices, _ in pending:
                    buffer.zero_()
                    for name, offset, count in slices:
                        if name in where:
                            buffer.narrow(0, offset, count).copy_(where[name])
            except Exception as exc:
                for _, _, held in pending[:-1]:
                    held.set_exception(exc)
                raise
            for buffer, _, held in pending[:-1]:
                held.set_result(buffer)
            return pending[-1][0]

        return future.then(decode)


def layer_selection_hook(state: LayerSelectionState,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hold `bucket` until the step's last; then reduce the agreed layers of all of them."""
    HookState.check_hook(state, "layer_selection_hook", LayerSelectionState)
    state.agree("layer_selection_hook", bucket)
    if bucket.index() == 0:
        state._pending = []   # a step that raised half-way leaves nothing behind
    held: torch.futures.Future = torch.futures.Future()
    pending = state._pending
    pending.append((bucket.buffer(), state._slices(bucket), held))
    if not bucket.is_last():
        return held
    try:
        return state._reduce(state.group())
    except Exception as exc:
        # DDP waits on every bucket's future: fail them all rather than leave one to hang.
        state._pending = []
        for _, _, waiting in pending[:-1]:
            waiting.set_exception(exc)
        raise
