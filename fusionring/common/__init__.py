"""Horovod's ``horovod.common`` names, for scripts that import them by module path
(``from horovod.common.exceptions import HorovodInternalError`` with only ``horovod`` changed).
The objects are fusionring's own: ``exceptions`` and ``process_sets`` are
:mod:`fusionring.exceptions` and :mod:`fusionring.process_sets`; ``elastic`` holds the
framework-free elastic state (``State``, ``ObjectState``, ``run_fn``) and ``util`` Horovod's
small helpers (``env``, ``split_list``, the ``*_built`` checks)."""
