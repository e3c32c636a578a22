"""DistributedOptimizer: wraps any torch.optim optimizer with gradient allreduce.

Gradients are submitted as they become ready during backward (post-accumulate-grad
hooks), fused by the runtime's scheduler (a grouping plan's groups, or threshold fusion)
and averaged across ranks before the wrapped optimizer's step.

The wrapper is an ordinary class (no subclass built with ``type()``); it shares the
wrapped optimizer's ``param_groups`` and ``state``, so LR schedulers and checkpoints see
one optimizer.
"""
from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import state as _rt  # the routed runtime: _rt.get(), _rt.using()
from ..compression import Compression, capabilities, describe, resolve_compressor
from ..compression.base import compress_named
from ..config import settings
from ..ops import ReduceOp, resolve_op
from ..process_sets import is_added, runtime_for
from ..straggler import Straggler
from . import functions as F
from .grad_scaler import teach_grad_scaler

_RACE_MESSAGE = ("optimizer.zero_grad() was called after loss.backward() but before "
                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                 "a race condition.")
_SPARSE = object()  # ctx of a sparse gradient reduced by allgather
# Which DistributedOptimizer's hook reduces each parameter (by id: the parameter, the
# optimizer, the hook's handle; weak, so neither is kept alive). Wrapping a parameter again
# (after changing requires_grad, or with a new optimizer for a second phase) hands it to the
# new wrapper, instead of both submitting its gradient under one name.
_HOOKED: Dict[int, Tuple[Any, Any, Any]] = {}
# A small gradient's submission waits in the hook until a few more are ready (or a large one,
# or the step's last, or synchronize()): they are then submitted together. Submitted one per
# hook, each paid the submission path's Python on caches the backward pass had just evicted
# (docs/architecture.md; scripts/bench_many_tensors.py).
_DEFER_COUNT = 32
_DEFER_BYTES = 1 << 16
_DEFERRED = object()  # ctx of a gradient whose submission is deferred (see _defer)
_TOO_MANY_BACKWARDS = ("Gradients were computed more than backward_passes_per_step times before "
                       "call to step(). Increase backward_passes_per_step to accumulate gradients "
                       "locally.")


def _check_disjoint(groups: List[List[str]]) -> None:
    """A gradient can travel in one group only (names are wire names, 'allreduce.<param>')."""
    seen: Dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            if name in seen:
                raise ValueError(f"parameter {name.split('.', 1)[1]!r} is in groups {seen[name]} "
                                 f"and {index}; groups must not overlap")
            seen[name] = index


def _lies_in(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()


class _Unit:
    """One fusion group's flat gradient buffer (one per dtype), reduced as a single tensor.

    The group is fixed in advance, so its members are submitted and negotiated as one
    request once the last of them is ready: the runtime agrees on one name per group instead
    of one per gradient, which is most of the per-step bookkeeping of a model with many small
    tensors.
    """

    __slots__ = ("name", "flat", "members", "ready", "handle", "wire", "ctx")

    def __init__(self, name: str, flat: torch.Tensor, members: List[torch.Tensor]) -> None:
        self.name = name
        self.flat = flat
        self.members = members
        self.ready: set = set()   # members counted this step
        self.handle: Optional[int] = None
        self.wire: Optional[torch.Tensor] = None  # the compressed buffer, reused every step
        self.ctx = None

    def reset(self) -> None:
        self.ready = set()
        self.handle = None


def _names_of(optimizer: torch.optim.Optimizer, named_parameters) -> Dict[torch.Tensor, str]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"param.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(duplicates)}")
    by_param = {}
    for name, p in named:
        by_param.setdefault(p, name)  # a tied parameter keeps its first name
    unnamed = [id(p) for p in params if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were "
                         f"not named. Python object ids: {', '.join(map(str, unnamed))}")
    return {p: by_param[p] for p in params}


class DistributedOptimizer(torch.optim.Optimizer):
    """Averages gradients across ranks before delegating ``step()`` to `optimizer`.

    Arguments follow Horovod's: `compression` (e.g. Compression.fp16),
    `backward_passes_per_step` (local accumulation), `op` (Average, Sum, ...),
    `gradient_predivide_factor` (split the averaging before/after the sum), `groups`
    (explicit fusion groups: an int or lists of parameters; `num_groups` is its older
    name) and `grouping_plan` (a plan made by ``fusionring plan``: a path or a Plan,
    fusing gradients in balanced groups; or ``"auto"``: the first step runs with threshold
    fusion and records the order gradients become ready in, then balanced groups are made
    from rank 0's order, as ``make_plan`` would, and used from the second step on). With `process_set`, gradients are averaged
    over that set's ranks only (every member wraps its optimizer alike); on a rank outside
    the set, as in Horovod, the optimizer reduces nothing and steps on the local gradients.

    `gradient_buffer` (default: the ``FUSIONRING_GRADIENT_BUFFER`` setting, on) applies to
    threshold fusion: after the first step, gradients below the pack limit become views of
    one buffer laid out in the order they became ready, so fused batches are reduced where
    they lie rather than copied into the fusion buffer and back (as DDP's
    ``gradient_as_bucket_view``). A ``.grad`` kept from an earlier step then changes with the
    buffer, and ``p.grad.detach_()`` raises; pass False to keep every step's gradients apart.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression=Compression.none, backward_passes_per_step: int = 1,
                 op=ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0,
                 groups: Union[None, int, Sequence[Sequence[torch.Tensor]]] = None,
                 sparse_as_dense: bool = False, process_set=None, grouping_plan=None,
                 gradient_buffer: Optional[bool] = None, layer_selection=None) -> None:
        # As in Horovod, a rank outside `process_set` (a registered set) trains on its own:
        # its optimizer reduces nothing and steps on the local gradients.
        self._outside_set = (process_set is not None and is_added(process_set)
                             and not process_set.included())
        # A process set's own runtime, or None: the global runtime (looked up at each use,
        # so the optimizer outlives a shutdown() / init() of it).
        self._set_runtime = (None if self._outside_set
                             else runtime_for(process_set, "DistributedOptimizer"))
        runtime = self._set_runtime or _rt.get("DistributedOptimizer")
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups`.",
                          DeprecationWarning, stacklevel=2)
            if groups is None:
                groups = num_groups
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not "
                            f"{type(optimizer).__name__}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        op = resolve_op(op)
        if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        # Optimizer.__init__ sets up torch's hook tables; the groups and state are then
        # rebound to the wrapped optimizer's own objects so both stay one.
        self._wrapping = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self._wrapping = True
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer = optimizer
        compression = resolve_compressor(compression)
        self._compression = compression
        self._caps = capabilities(compression)  # what the compressor declared it can do
        self._op = op
        # Adasum combines updates, not gradients: each parameter takes its local step as soon
        # as its gradient is ready, and the step (the delta) is what ranks combine.
        self._adasum = op == ReduceOp.Adasum
        if self._adasum and self._caps.in_runtime:
            raise ValueError(f"op=Adasum cannot be combined with {describe(compression)} "
                             f"compression, which reduces with Sum or Average only")
        self._starting_models: Dict[torch.Tensor, torch.Tensor] = {}
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._sparse_as_dense = sparse_as_dense
        self._sparse_rows: Dict[torch.Tensor, object] = {}  # sparse_as_dense: each row-mask handle
        self._parameter_names = _names_of(optimizer, named_parameters)
        self._requires_update = [p for group in self.param_groups for p in group["params"]
                                 if p.requires_grad]
        self._allreduce_delay = {p: self.backward_passes_per_step for p in self._requires_update}
        self._burst_left = len(self._requires_update)  # gradients of this step not yet submitted
        self._handles: Dict[torch.Tensor, Tuple[Optional[int], object]] = {}
        self._deferred: List[torch.Tensor] = []  # ready, submission deferred (see _defer)
        self._deferred_bytes = 0
        # Each parameter's last compressed payload, reused by compressors with compress_into.
        self._wire_buffers: Dict[torch.Tensor, torch.Tensor] = {}
        self._synchronized = False
        self._should_synchronize = True
        # synchronize() ran because a GradScaler was about to read the gradients: step() does
        # not synchronize again, and does not warn as after a user's synchronize().
        self._synchronized_for_scaler = False
        teach_grad_scaler(DistributedOptimizer)
        self._hook_handles = []
        self._straggler = Straggler.from_settings()
        self._size = 1 if self._outside_set else runtime.size
        self._process_set = process_set
        # The gradients in the order they become ready, while the first step records it for
        # grouping_plan="auto" or the gradient buffer; None otherwise. At the end of that step
        # the order goes to _after_first_step (_learn_groups or _lay_out_gradients).
        self._ready_order: Optional[List[torch.Tensor]] = None
        self._after_first_step = None
        self._grad_views: Dict[torch.Tensor, torch.Tensor] = {}
        self._units: Dict[torch.Tensor, _Unit] = {}
        self._unit_list: List[_Unit] = []
        fusion_groups = self._fusion_groups(groups, grouping_plan, named_parameters)
        if fusion_groups is not None:
            self._use_groups(fusion_groups, runtime)
        if gradient_buffer is None:
            gradient_buffer = settings().gradient_buffer
        if self._after_first_step is not None:  # grouping_plan="auto"
            # Until the groups are learned, every gradient is reduced on its own: the first
            # step's sums then do not depend on which gradients a cycle happened to batch.
            self._auto_label = runtime.new_group_label()
            runtime.set_fusion_groups([[f"allreduce.{self._tensor_name(p)}"]
                                       for p in self._requires_update], label=self._auto_label)
        elif (gradient_buffer and fusion_groups is None and self._size > 1 and not self._adasum
              and self._caps.identity
              and runtime.config.fusion_threshold_bytes > 0 and runtime.packs_fused_batches()):
            self._ready_order, self._after_first_step = [], self._lay_out_gradients
        # Layer selection reduces in synchronize() (the agreement needs every gradient), so
        # no per-gradient hooks are registered.
        self._selection = layer_selection
        if layer_selection is not None:
            if self._adasum:  # Adasum's per-parameter local steps run in hooks, which selection has none of
                raise ValueError("layer_selection: op=Adasum is not supported with layer selection; use "
                                 "op=Average or op=Sum")
            if named_parameters is None and not layer_selection.layers:
                # every name would be param.<group>.<index>: one layer per param group, so it all travels
                raise ValueError("layer_selection: the layers are read from the parameters' names "
                                 "(module.parameter), and without named_parameters= there are none; pass "
                                 "named_parameters=model.named_parameters(), or give the selector the model "
                                 "(for example LayerSelection.norm(0.25, model=model))")
            layer_selection.attach([(self._parameter_names[p], p) for p in self._requires_update])
        elif self._size > 1:
            self._register_hooks()

    # ------------------------------------------------------------------ setup
    def _tensor_name(self, p: torch.Tensor) -> str:
        return self._parameter_names[p]

    def _fusion_groups(self, groups, grouping_plan, named_parameters) -> Optional[List[List[str]]]:
        if groups is not None and grouping_plan is not None:
            raise ValueError("pass either groups (or num_groups) or grouping_plan, not both")
        full = lambda p: f"allreduce.{self._tensor_name(p)}"  # noqa: E731 - the wire name
        if isinstance(groups, int):
            if groups < 1:
                raise ValueError("groups must be a positive int or a list of parameter lists")
            # Horovod's split: the first len % groups groups take one parameter more
            params = self._requires_update
            d, r = divmod(len(params), groups)
            bounds = [i * d + min(i, r) for i in range(groups + 1)]
            return [[full(p) for p in params[a:b]] for a, b in zip(bounds, bounds[1:]) if b > a]
        if groups is not None:
            # As Horovod: a listed parameter without a gradient to reduce (frozen, or not in
            # the optimizer) is left out of its group.
            known = set(self._requires_update)
            out = []
            for group in groups:
                if not isinstance(group, (list, tuple)) or not all(
                        isinstance(p, torch.Tensor) for p in group):
                    raise ValueError("groups must be a positive int or a list of parameter lists")
                members = [full(p) for p in group if p in known]
                if members:
                    out.append(members)
            # As Horovod: a parameter in no list is a group of its own
            listed = {id(p) for group in groups for p in group}
            out += [[full(p)] for p in self._requires_update if id(p) not in listed]
            return out
        source = grouping_plan if grouping_plan is not None else settings().grouping_plan_path
        if source is None:
            return None
        if isinstance(source, str) and source == "auto":
            if self._size > 1 and not self._adasum:
                self._ready_order, self._after_first_step = [], self._learn_groups
            return None
        from ..plan import load_plan
        from ..scheduler import tensor_groups_from_plan

        plan = load_plan(grouping_plan)  # None: the setting, named in its errors
        if named_parameters is None:
            raise ValueError("grouping_plan needs named_parameters (model.named_parameters()) "
                             "to match the plan's parameter names")
        by_name = {name: p for p, name in self._parameter_names.items()}
        plan.check_model([(name, p) for name, p in by_name.items()])
        updated = set(self._requires_update)
        return tensor_groups_from_plan(
            plan, lambda n: f"allreduce.{n}" if n in by_name and by_name[n] in updated else None)

    def _use_groups(self, fusion_groups: List[List[str]], runtime,
                    label: Optional[str] = None) -> None:
        """Fuse gradients in these groups (wire names) from now on, on every rank."""
        _check_disjoint(fusion_groups)
        # Known groups let each gradient live in its group's fusion buffer, as DDP's
        # gradient_as_bucket_view does: no pack/unpack copies around the reduction.
        # Compressors that act element by element can compress a group's buffer as a whole.
        if self._caps.elementwise:
            self._grad_views = self._group_buffers(fusion_groups)
        if self._size > 1:
            # One label per optimizer, so a GAN's two optimizers each keep their groups.
            label = label or runtime.new_group_label()
            if self._grad_views and not self._adasum:
                fusion_groups = self._make_units(fusion_groups, label)
            runtime.set_fusion_groups(fusion_groups, label=label)

    def _learn_groups(self, ready: List[torch.Tensor]) -> None:
        """grouping_plan="auto": after the first step, group the gradients as ``make_plan``
        would, in the order rank 0 saw them ready (one order for every rank)."""
        from ..plan import CostModel, choose_buffer_bytes, partition_sizes

        seen = [self._tensor_name(p) for p in ready]
        root = 0 if self._set_runtime is None else min(self._process_set.ranks)
        with _rt.using(self._set_runtime):
            order = F.broadcast_object(seen, root_rank=root, name="grouping_plan.auto.order",
                                       process_set=self._process_set)
        by_name = {name: p for p, name in self._parameter_names.items()}
        updated = set(self._requires_update)
        params = [by_name[n] for n in order if n in by_name and by_name[n] in updated]
        sizes = [p.numel() * p.element_size() for p in params]
        bounds = partition_sizes(sizes, choose_buffer_bytes(
            sum(sizes), CostModel.ring_default(self._size))) if params else []
        groups = [params[a:b] for a, b in bounds]
        # What rank 0 did not see ready (unused there) keeps a group of its own.
        grouped = set(params)
        groups += [[p] for p in self._requires_update if p not in grouped]
        self._use_groups([[f"allreduce.{self._tensor_name(p)}" for p in group] for group in groups],
                         self._set_runtime or _rt.get("DistributedOptimizer"),
                         label=self._auto_label)

    def _lay_out_gradients(self, ready: List[torch.Tensor]) -> None:
        """Threshold fusion: from now on, keep the gradients below the pack limit as views of
        one buffer in the order this rank saw them ready (the order the runtime agrees them
        in, so what a cycle fuses usually lies back to back). Larger ones are reduced where
        they lie anyway. The layout is this rank's own; a batch that is not contiguous is
        still packed, so nothing else depends on it."""
        seen = set(ready)
        order = ready + [p for p in self._requires_update if p not in seen]
        limit = (self._set_runtime or _rt.get("DistributedOptimizer")).config.pack_limit_bytes
        members = [p for p in order if p.numel() > 0
                   and (limit <= 0 or p.numel() * p.element_size() < limit)]
        if len(members) > 1:
            self._grad_views = self._group_buffers(
                [[f"allreduce.{self._tensor_name(p)}" for p in members]])

    def _group_buffers(self, fusion_groups: List[List[str]]) -> Dict[torch.Tensor, torch.Tensor]:
        """One flat buffer per group and dtype; each parameter gets a view of its slice, in
        the group's order (the order the runtime fuses them in). The buffers are kept, each
        with its members, in ``self._flats``."""
        by_name = {f"allreduce.{name}": p for p, name in self._parameter_names.items()}
        views: Dict[torch.Tensor, torch.Tensor] = {}
        self._flats: List[Tuple[int, torch.Tensor, List[torch.Tensor]]] = []
        for index, group in enumerate(fusion_groups):
            params = [by_name[n] for n in group if n in by_name]
            for dtype in dict.fromkeys(p.dtype for p in params):
                members = [p for p in params if p.dtype == dtype and p.device.type == "cpu"
                           and p.layout == torch.strided]
                flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype)
                offset = 0
                for p in members:
                    views[p] = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                if members:
                    self._flats.append((index, flat, members))
        return views

    def _make_units(self, fusion_groups: List[List[str]], label: str) -> List[List[str]]:
        """Turn each group's flat buffers into units; returns the runtime's groups: one per
        unit (its buffer is reduced where it lies) and the members left outside any buffer."""
        runtime_groups: List[List[str]] = []
        parts = [index for index, _, _ in self._flats]
        for index, flat, members in self._flats:
            names = [self._tensor_name(m) for m in members]
            span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
            part = f".{flat.dtype}".replace("torch.", "") if parts.count(index) > 1 else ""
            unit = _Unit(f"{label}.group{index}{part}[{span}]", flat, members)
            self._unit_list.append(unit)
            for m in members:
                self._units[m] = unit
            runtime_groups.append([f"allreduce.{unit.name}"])
        in_units = {f"allreduce.{self._tensor_name(m)}" for m in self._units}
        for group in fusion_groups:
            rest = [n for n in group if n not in in_units]
            if rest:
                runtime_groups.append(rest)
        return runtime_groups

    def _into_group_buffer(self, p: torch.Tensor) -> None:
        view = self._grad_views.get(p)
        grad = p.grad
        if (view is None or grad is None or grad.layout != torch.strided
                or grad.data_ptr() == view.data_ptr() or grad.shape != view.shape
                or grad.dtype != view.dtype):
            return  # a sparse gradient cannot live in the buffer (nor has it a data pointer)
        if grad.requires_grad:  # backward(create_graph=True): the copy must not be recorded
            if p not in self._units:
                return  # outside a group the buffer only saves copies: keep the graph
            with torch.no_grad():
                view.copy_(grad)
        else:
            view.copy_(grad)
        p.grad = view  # later backwards accumulate into the buffer in place

    def _register_hooks(self) -> None:
        for p in self._requires_update:
            self._hook(p)

    def _hook(self, p: torch.Tensor) -> None:
        """Reduce `p`'s gradients from now on, taking it over from an earlier wrapper."""
        earlier = _HOOKED.get(id(p))
        if earlier is not None:
            param, owner, handle = earlier[0](), earlier[1](), earlier[2]
            if param is p and owner is not None and owner is not self:
                handle.remove()
                owner._hand_over(p)
        handle = p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._hook_handles.append(handle)
        _HOOKED[id(p)] = (weakref.ref(p), weakref.ref(self), handle)

    def _hand_over(self, p: torch.Tensor) -> None:
        """A newer DistributedOptimizer wraps `p`: this one no longer reduces it."""
        self._requires_update = [q for q in self._requires_update if q is not p]
        self._allreduce_delay.pop(p, None)
        self._handles.pop(p, None)
        self._deferred = [q for q in self._deferred if q is not p]  # by identity: tensors
        self._reset_delays()

    # ------------------------------------------------------------------ gradient flow
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        # New gradients: a synchronize() before them (one whose step a GradScaler skipped)
        # does not cover them.
        self._synchronized = self._synchronized_for_scaler = False
        if self._straggler is not None:
            self._straggler.gradient_ready()
        unit = self._units.get(p)
        if unit is not None:
            # Runs for every gradient of every step: kept to a few lookups.
            delay = self._allreduce_delay[p]
            if delay <= 0:
                raise AssertionError(_TOO_MANY_BACKWARDS)
            if p.grad is not self._grad_views[p]:
                self._into_group_buffer(p)
            self._allreduce_delay[p] = delay - 1
            if p not in self._handles:
                self._handles[p] = (None, unit)
            if delay == 1:
                self._unit_member_ready(unit, p)
            return
        if self._ready_order is not None:
            self._ready_order.append(p)
        self._into_group_buffer(p)
        entry = self._handles.get(p)
        if entry is not None and (entry[0] is not None or entry[1] is _DEFERRED):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(_TOO_MANY_BACKWARDS)
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._defer(p)
        else:
            self._handles[p] = (None, None)

    def _defer(self, p: torch.Tensor) -> None:
        """Queue `p`'s submission, and submit the queue once it is long or large enough, or
        holds the step's last gradient. Its name is what the other ranks match, so when each
        rank submits makes no difference to the sums."""
        self._handles[p] = (None, _DEFERRED)
        self._deferred.append(p)
        grad = p.grad
        if self._adasum or grad.is_sparse:
            self._deferred_bytes = _DEFER_BYTES  # its own path: submitted at once
        else:
            self._deferred_bytes += grad.numel() * grad.element_size()
        if (self._deferred_bytes >= _DEFER_BYTES or len(self._deferred) >= _DEFER_COUNT
                or len(self._deferred) == self._burst_left):
            self._submit_deferred()

    def _submit_deferred(self) -> None:
        """Submit every deferred gradient, in the order they became ready."""
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        if not deferred:
            return
        with _rt.burst(self._set_runtime):
            if self._caps.identity and not self._adasum and not any(
                    p.grad.is_sparse for p in deferred):  # the common case: queued at once
                self._submit_plain(deferred)
            else:
                for p in deferred:
                    self._handles[p] = self._submit_grad(p)
        self._submitted(len(deferred))

    def _submit_plain(self, params: List[torch.Tensor]) -> None:
        """Submit the dense gradients of `params` uncompressed, in one batch."""
        prescale, postscale = self._scale_factors()
        names = self._parameter_names
        handles, error = F.allreduce_many_async_(
            [p.grad for p in params], [names[p] for p in params], op=self._op,
            prescale_factor=prescale, postscale_factor=postscale)
        for p, handle in zip(params, handles):
            self._handles[p] = (handle, None)
        if error is not None:
            raise error

    def _unit_member_ready(self, unit: _Unit, p: torch.Tensor) -> None:
        """Count `p` in its unit, and submit the unit when it was the last member."""
        if p in unit.ready:
            return
        view = self._grad_views[p]
        grad = p.grad
        if grad is None:
            with torch.no_grad():
                p.grad = view.zero_()
        elif grad is not view and not _lies_in(grad, view):
            # A gradient that cannot live in the buffer (a sparse one) goes on its own, and
            # its slice is zeroed so the unit's content is the same on every rank.
            self._handles[p] = self._allreduce_grad_async(p)
            with torch.no_grad():
                view.zero_()
        unit.ready.add(p)
        if len(unit.ready) == len(unit.members):
            self._submit_unit(unit)

    def _submit_unit(self, unit: _Unit) -> None:
        payload = unit.flat
        if not self._caps.identity:
            started = time.perf_counter()
            if unit.wire is None or not self._caps.reduces_into:
                unit.wire, unit.ctx = compress_named(self._compression, unit.flat, unit.name)
                F.check_summable(self._compression, unit.wire, unit.name)
            elif unit.wire is not unit.flat:
                with torch.no_grad():
                    unit.ctx = self._compression.compress_into(unit.flat, unit.wire)
            payload = unit.wire
            F.trace_compression(self._compression, unit.name, "compress", started,
                                runtime=self._set_runtime)
        prescale, postscale = self._scale_factors()
        with _rt.burst(self._set_runtime):
            unit.handle = F.allreduce_async_(payload, name=unit.name, op=self._op,
                                             prescale_factor=prescale,
                                             postscale_factor=postscale)
        self._submitted(len(unit.members))

    def _finish_unit(self, unit: _Unit) -> None:
        """Wait for the unit's reduction; its members' gradients are views of the buffer."""
        try:
            F.synchronize(unit.handle)
        finally:
            unit.handle = None
        if unit.wire is not None and unit.wire is not unit.flat:
            started = time.perf_counter()
            with torch.no_grad():
                if self._caps.reduces_into:
                    self._compression.decompress_into(unit.wire, unit.ctx, unit.flat)
                else:
                    unit.flat.copy_(self._compression.decompress(unit.wire, unit.ctx))
            F.trace_compression(self._compression, unit.name, "decompress", started,
                                runtime=self._set_runtime)

    def _drop_sparse_rows(self) -> None:
        """Release the row masks of gradients whose reduction failed or was dropped."""
        for handle in self._sparse_rows.values():
            try:
                F.synchronize(handle)
            except Exception:  # noqa: BLE001 - the gradient's own error is the one raised
                pass
        self._sparse_rows.clear()

    def _scale_factors(self) -> Tuple[float, float]:
        # Horovod's split of Average around the sum: divide by f before, multiply by f after.
        if self._op == ReduceOp.Average:
            return 1.0 / self._gradient_predivide_factor, self._gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_grad_async(self, p: torch.Tensor):
        # The gradients of one backward pass arrive within a short while: negotiated as one
        # burst, they cost one round and one fused collective instead of several.
        with _rt.burst(self._set_runtime):
            return self._submit_grad(p)

    def _submit_grad(self, p: torch.Tensor):
        if self._adasum:
            return self._adasum_delta_async(p)
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                # Horovod's default: gather every rank's indices and values (ctx marks it).
                return F.sparse_allreduce_async(grad, name=self._tensor_name(p),
                                                op=self._op), _SPARSE
            # Reduced dense; the result goes back sparse, on the rows some rank's gradient has
            # (one byte each, reduced beside it): a row looked up whose sum is zero still counts,
            # as it does in one process (SparseAdam decays its moments).
            grad = grad.coalesce()
            rows = torch.zeros(grad.shape[:grad.sparse_dim()], dtype=torch.uint8, device=grad.device)
            rows[tuple(grad.indices())] = 1
            self._sparse_rows[p] = F.allreduce_async_(rows, name=self._tensor_name(p) + "#rows",
                                                      op=ReduceOp.Max)
            grad = grad.to_dense()
        prescale, postscale = self._scale_factors()
        if self._caps.identity:  # nothing to compress, trace or check: the common case
            return F.allreduce_async_(grad, name=self._parameter_names[p], op=self._op,
                                      prescale_factor=prescale,
                                      postscale_factor=postscale), None
        if self._caps.in_runtime:
            # The compressor reduces the fused buffer itself; its decompress(x, None) is x.
            handle = F.allreduce_async_(grad, name=self._tensor_name(p), op=self._op,
                                        prescale_factor=prescale, postscale_factor=postscale,
                                        compression=self._compression)
            return handle, None
        started = time.perf_counter()
        compressed, ctx = self._compress(p, grad)
        self._trace(p, "compress", started)
        F.check_summable(self._compression, compressed, self._tensor_name(p))
        handle = F.allreduce_async_(compressed, name=self._tensor_name(p), op=self._op,
                                    prescale_factor=prescale, postscale_factor=postscale)
        return handle, ctx

    def _trace(self, p: torch.Tensor, phase: str, started: float) -> None:
        # On this optimizer's runtime (a process set's, when it has one), wherever it is called.
        F.trace_compression(self._compression, self._tensor_name(p), phase, started,
                            runtime=self._set_runtime)

    def _compress(self, p: torch.Tensor, grad: torch.Tensor):
        """The compressor's payload for `grad`, written into last step's payload when the
        compressor can (its reduction finished in synchronize(), so the memory is free)."""
        into = self._compression.compress_into if self._caps.reduces_into else None
        wire = self._wire_buffers.get(p)
        if (into is not None and wire is not None and wire.shape == grad.shape
                and not grad.is_sparse):
            with torch.no_grad():
                return wire, into(grad, wire)
        compressed, ctx = compress_named(self._compression, grad, self._tensor_name(p))
        if (into is not None and isinstance(compressed, torch.Tensor)
                and compressed.data_ptr() != grad.data_ptr()):
            self._wire_buffers[p] = compressed
        return compressed, ctx

    def _adasum_delta_async(self, p: torch.Tensor):
        """Step the wrapped optimizer on `p` alone, turn `p` into the step's delta and start
        combining the deltas with Adasum; synchronize() adds the result to the start."""
        start = self._starting_models.get(p)
        if start is None:
            start = self._starting_models[p] = torch.empty_like(p, requires_grad=False)
        with torch.no_grad():
            start.copy_(p)
        stashed = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p] if any(p is q for q in group["params"]) else []
            self._optimizer.step()
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        with torch.no_grad():
            p.sub_(start)
        compressed, ctx = compress_named(self._compression, p.data, self._tensor_name(p))
        handle = F.allreduce_async_(compressed, name=self._tensor_name(p), op=ReduceOp.Adasum)
        return handle, ctx

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (submitting any not yet submitted)."""
        if self._selection is not None and not self._outside_set:
            from .layer_sync import reduce_selected
            reduce_selected(self._selection, self._requires_update, self._compression,
                            self._process_set, op=self._op)
            self._synchronized = True
            return
        if self._size == 1:
            self._synchronized = True
            return
        for p in self._requires_update:
            if p not in self._handles:
                # Unused on this rank: send zeros so ranks that did use it do not hang.
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._into_group_buffer(p)
                unit = self._units.get(p)
                if unit is not None:
                    self._handles[p] = (None, unit)
                    self._unit_member_ready(unit, p)
                else:
                    self._handles[p] = self._allreduce_grad_async(p)
        self._submit_deferred()
        for p, (handle, ctx) in list(self._handles.items()):
            if isinstance(ctx, _Unit):
                self._unit_member_ready(ctx, p)  # accumulating still: sent as it is
            elif handle is None:
                self._handles[p] = self._allreduce_grad_async(p)
        errors = []
        identity = self._caps.identity and not self._adasum
        for p, (handle, ctx) in self._handles.items():
            if isinstance(ctx, _Unit):
                if ctx.handle is not None:
                    try:
                        self._finish_unit(ctx)
                    except Exception as exc:  # noqa: BLE001 - release every handle, then raise
                        errors.append(exc)
                view = self._grad_views[p]
                grad = p.grad
                if grad is not view and grad is not None and not _lies_in(grad, view):
                    with torch.no_grad():
                        p.grad.copy_(view)  # the gradient was replaced after backward
                continue
            try:
                output = F.synchronize(handle)
                self._allreduce_delay[p] = self.backward_passes_per_step
                self._take_reduced(p, output, ctx, identity)
            except Exception as exc:  # noqa: BLE001 - release every handle, then raise
                errors.append(exc)
        self._handles.clear()
        self._drop_sparse_rows()
        for unit in self._unit_list:
            unit.reset()
        self._reset_delays()
        self._synchronized = True
        if errors:
            raise errors[0]
        if self._ready_order is not None:
            ready, self._ready_order = list(dict.fromkeys(self._ready_order)), None
            self._after_first_step(ready)

    def _take_reduced(self, p: torch.Tensor, output: torch.Tensor, ctx: Any,
                      identity: bool) -> None:
        """Put parameter `p`'s reduced gradient `output` into p.grad (decoded with `ctx`)."""
        # A compressor that reduces inside the runtime wrote the result in place, decoded.
        plain = identity or (self._caps.in_runtime and not self._adasum)
        if plain and ctx is not _SPARSE and not p.grad.is_sparse:
            if output.data_ptr() != p.grad.data_ptr():  # reduced in place: nothing to do
                with torch.no_grad():
                    p.grad.copy_(output)
            return
        into = self._compression.decompress_into if self._caps.reduces_into else None
        started = time.perf_counter()
        if (into is not None and not plain and ctx is not _SPARSE and not self._adasum
                and not p.grad.is_sparse):
            with torch.no_grad():
                into(output, ctx, p.grad)  # one cast into place, no decoded copy
            self._trace(p, "decompress", started)
            return
        if ctx is _SPARSE or plain:
            result = output
        else:
            result = self._compression.decompress(output, ctx)
            self._trace(p, "decompress", started)
        if self._adasum:
            with torch.no_grad():
                start = self._starting_models[p]
                start.add_(result.to(start.dtype))
                p.copy_(start)
        elif p.grad.is_sparse:
            # Optimizers for sparse gradients (SparseAdam) need them to stay sparse.
            if not result.is_sparse:
                rows = F.synchronize(self._sparse_rows.pop(p))
                index = rows.nonzero().t()
                result = torch.sparse_coo_tensor(index, result[tuple(index)], result.shape,
                                                 is_coalesced=True, check_invariants=False)
            with torch.no_grad():
                p.grad.zero_().add_(result)
        elif result.data_ptr() != p.grad.data_ptr():
            with torch.no_grad():
                p.grad.copy_(result)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before gradients are reduced."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = int(passes)
        self._reset_delays()

    def _reset_delays(self) -> None:
        # Every parameter starts counting its backward passes afresh.
        for p in self._requires_update:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._burst_left = len(self._requires_update)

    def _submitted(self, count: int) -> None:
        """`count` more gradients are on their way; after the step's last one, the runtime
        negotiates what it gathered at once instead of waiting out its burst window."""
        self._burst_left -= count
        if self._burst_left == 0:
            runtime = self._set_runtime or _rt.routed()
            if runtime is not None:
                runtime.end_burst()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block, step() does not synchronize (call synchronize() yourself)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize gradients (unless skipped), then run the wrapped optimizer's step."""
        if self._straggler is not None:
            self._straggler.step()
        if self._should_synchronize and not self._synchronized_for_scaler:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = self._synchronized_for_scaler = False
        if self._adasum and self._size > 1:
            # The local steps already ran (one per parameter, as its gradient was ready).
            if self._straggler is not None:
                self._straggler.step_ended()
            return closure() if closure is not None else None
        # A GradScaler hands a fused optimizer (_step_supports_amp_scaling) its scale and
        # found-inf flag as attributes of the optimizer it was given: this wrapper.
        handed = {name: self.__dict__[name] for name in ("grad_scale", "found_inf")
                  if name in self.__dict__}
        for name, value in handed.items():
            setattr(self._optimizer, name, value)
        try:
            return self._optimizer.step(closure)
        finally:
            for name in handed:
                self._optimizer.__dict__.pop(name, None)
            if self._straggler is not None:
                self._straggler.step_ended()

    def _synchronize_for_scaler(self) -> None:
        """A GradScaler is about to read the gradients: reduce them first (once per step)."""
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
            self._synchronized_for_scaler = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients; refuses while allreduces of this step are in flight."""
        if self._handles:
            raise AssertionError(_RACE_MESSAGE)
        if self._synchronized_for_scaler:  # the scaler skipped that step
            self._synchronized = self._synchronized_for_scaler = False
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ state
    def state_dict(self):
        state = self._optimizer.state_dict()
        if self._caps.stateful:
            state = dict(state)
            state["fusionring"] = {"compression": self._compression.state_dict()}
        if self._selection is not None:
            state = dict(state)
            state.setdefault("fusionring", {})["layer_selection"] = self._selection.state_dict()
        if "fusionring" in state:
            # Residuals are this rank's own: a loader on another rank keeps its own instead.
            state["fusionring"]["rank"] = F.rank()
        return state

    def load_state_dict(self, state_dict) -> None:
        """Restore ``state_dict()``. Compressor residuals and layer-selection residuals are
        the saving rank's own: loaded on another rank (every rank loading rank 0's file),
        the rest is loaded, this rank keeps its own residuals, and a warning says so."""
        self._load(state_dict, broadcast=False)

    def _load_broadcast_state(self, state_dict) -> None:
        """broadcast_optimizer_state's load: the root's state, this rank's own residuals."""
        self._load(state_dict, broadcast=True)

    def _load(self, state_dict, broadcast: bool) -> None:
        # As Horovod: the step starts afresh, so a checkpoint loaded between two accumulated
        # backward passes does not count the one before it. Reductions in flight are waited
        # for (the other ranks started them too) and their results dropped.
        self._submit_deferred()  # deferred here may be submitted on the others
        for handle, ctx in list(self._handles.values()):
            pending = ctx.handle if isinstance(ctx, _Unit) else handle
            if pending is not None:
                try:
                    F.synchronize(pending)
                except Exception:  # noqa: BLE001 - its result is dropped either way
                    pass
        self._handles.clear()
        self._drop_sparse_rows()
        for unit in self._unit_list:
            unit.reset()
        self._reset_delays()
        self._synchronized = self._synchronized_for_scaler = False
        self._should_synchronize = True
        state_dict = dict(state_dict)
        extra = state_dict.pop("fusionring", None)
        self._optimizer.load_state_dict(state_dict)
        self.param_groups = self._optimizer.param_groups
        self.state = self._optimizer.state
        if not extra:
            return
        saver = extra.get("rank", F.rank())
        foreign = saver != F.rank()
        compression = extra.get("compression") if self._caps.stateful else None
        selection = extra.get("layer_selection") if self._selection is not None else None
        if foreign and compression is not None and "residuals" in compression:
            compression = dict(compression,
                               residuals=self._compression.state_dict()["residuals"])
        if foreign and selection is not None and "acc" in selection:
            acc = self._selection.acc
            own = acc.state_dict()["residual"] if acc is not None else {}
            selection = dict(selection, acc=dict(selection["acc"], residual=own))
            mine = self._selection.state_dict()
            selection.update({key: mine[key] for key in self._selection.per_rank_state
                              if key in mine})
        if foreign and not broadcast and (compression is not None or selection is not None):
            warnings.warn(f"DistributedOptimizer on rank {F.rank()}: the state was saved by rank "
                          f"{saver}, and residuals (and a layer selection's state) are each rank's "
                          f"own; this rank keeps its own "
                          f"(save optimizer.state_dict() on every rank and load each rank's own "
                          f"to resume them)", stacklevel=3)
        if compression is not None:
            self._compression.load_state_dict(compression)
        if selection is not None:
            self._selection.load_state_dict(selection)

    def add_param_group(self, param_group: dict) -> None:
        if not self.__dict__.get("_wrapping"):  # called by Optimizer.__init__ itself
            return super().add_param_group(param_group)
        if self._selection is not None:  # its layers were learned when the optimizer was built
            raise ValueError("add_param_group: a DistributedOptimizer with layer_selection cannot take "
                             "parameters after it is built; give every param group to the optimizer "
                             "it wraps before wrapping it")
        self._optimizer.add_param_group(param_group)
        for p in param_group["params"] if isinstance(param_group["params"], list) else []:
            if p.requires_grad and p not in self._allreduce_delay:
                self._parameter_names.setdefault(p, f"param.{len(self.param_groups) - 1}."
                                                    f"{len(self._requires_update)}")
                self._requires_update.append(p)
                self._allreduce_delay[p] = self.backward_passes_per_step
                self._burst_left += 1
                if self._size > 1:
                    self._hook(p)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r})"

    def __getattr__(self, name: str):
        # Attributes particular to the wrapped optimizer (e.g. LBFGS internals).
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)
