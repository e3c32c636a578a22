"""``horovod.common.exceptions``'s names: the same objects as :mod:`fusionring.exceptions`."""
from __future__ import annotations

from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
