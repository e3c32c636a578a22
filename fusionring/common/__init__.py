"""Horovod's ``horovod.common`` names, for scripts that import them by module path
(``from horovod.common.exceptions import HorovodInternalError`` with only ``horovod`` changed).
The objects are fusionring's own; see :mod:`fusionring.exceptions` and
:mod:`fusionring.process_sets`."""
