"""``horovod.common.process_sets``'s names: the same objects as :mod:`fusionring.process_sets`."""
from __future__ import annotations

from ..process_sets import (ProcessSet, add_process_set, global_process_set, process_set_by_id,
                            process_sets, remove_process_set)

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "process_set_by_id",
           "process_sets", "remove_process_set"]
