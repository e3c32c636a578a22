"""One rank of :func:`fusionring.run`: ``python -m fusionring.run_task HOST:PORT``.

Fetches the pickled call from the driver, runs it, and sends back ``("ok", value)`` or ``("error",
traceback)``; exits 1 after a failure, so mpiexec ends the job as it would for a script.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from typing import Optional, Tuple

from .runner import TOKEN_ENV, pickler, receive_message, send_message


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=300)


def _request(address: str, header: dict, body: Optional[bytes] = None) -> bytes:
    with _connect(address) as sock:
        send_message(sock, json.dumps(header).encode())
        if body is not None:
            send_message(sock, body)
        return receive_message(sock)


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or TOKEN_ENV not in os.environ:
        print("fusionring.run_task is started by fusionring.run(), not by hand", file=sys.stderr)
        return 2
    address, token = argv[0], os.environ.pop(TOKEN_ENV)
    pickle = pickler()
    rank = _rank()
    outcome: Tuple[str, object]
    try:
        func, args, kwargs = pickle.loads(_request(address, {"token": token, "op": "get"}))
        outcome = ("ok", func(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - the driver reports it, naming this rank
        outcome = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - a return value that cannot travel
        outcome = ("error", f"the return value could not be pickled: {type(exc).__name__}: {exc}")
        data = pickle.dumps(outcome)
    _request(address, {"token": token, "op": "put", "rank": rank}, data)
    if outcome[0] == "error":
        sys.stderr.write(f"fusionring.run: rank {rank} failed:\n{outcome[1]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
