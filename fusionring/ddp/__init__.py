"""fusionring's gradient compressors for ``torch.nn.parallel.DistributedDataParallel``.

``from fusionring.ddp import hooks`` then ``ddp_model.register_comm_hook(hooks.NMState(), hooks.nm_hook)``
(or ``hooks.ClusterState()`` with ``hooks.cluster_hook``, or ``hooks.LayerSelectionState(selection=...,
model=model)`` with ``hooks.layer_selection_hook``).
Only ``torch.distributed`` (DDP's process group) and fusionring's C++ kernels are used: no MPI, no runtime.
"""
