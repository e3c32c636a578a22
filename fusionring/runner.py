"""``fusionring.run(func, ...)``: call a Python function on N ranks from Python, as ``horovod.run`` does.

::

    import fusionring
    import fusionring.torch as hvd

    def train(lr):
        hvd.init()
        ...
        return hvd.rank(), final_loss

    results = fusionring.run(train, args=(0.1,), np=2)   # [(0, ...), (1, ...)], by rank

The function, its arguments and each rank's return value travel pickled (``cloudpickle``, so functions
defined in ``__main__`` or a notebook work) over a TCP connection to this process, which every rank opens
with a one-time token. The ranks are started by :mod:`fusionring.launcher` (``fusionrun``), so the keyword
arguments that name horovodrun options (``hosts``, ``ssh_port``, ``network_interface``, ``mpi_args``, ...)
mean what those options mean there.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import socketserver
import struct
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import launcher
from .network import interface_address

TOKEN_ENV = "FUSIONRING_RUN_TOKEN"
_HEADER = struct.Struct("!Q")


def pickler():
    """cloudpickle where installed (it pickles functions by value), else the standard pickle."""
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:  # pragma: no cover - a dependency of fusionring
        import pickle
        return pickle


# ------------------------------------------------------------------------------------ the wire

def send_message(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive_message(sock: socket.socket) -> bytes:
    header = _receive_exactly(sock, _HEADER.size)
    return _receive_exactly(sock, _HEADER.unpack(header)[0])


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _Exchange(socketserver.ThreadingTCPServer):
    """Hands out the pickled call and keeps what each rank sends back; every request must carry
    the token, or it is dropped unread."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: Tuple[str, int], token: str, call: bytes):
        super().__init__(address, _Handler)
        self.token = token
        self.call = call
        self.results: Dict[int, bytes] = {}
        self.lock = threading.Lock()


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Exchange = self.server  # type: ignore[assignment]
        try:
            header = json.loads(receive_message(self.request))
            if not hmac.compare_digest(str(header.get("token", "")), server.token):
                return
            if header.get("op") == "get":
                send_message(self.request, server.call)
            elif header.get("op") == "put":
                data = receive_message(self.request)
                with server.lock:
                    server.results[int(header["rank"])] = data
                send_message(self.request, b"ok")
        except (ConnectionError, OSError, ValueError, KeyError, TypeError):
            return


# ------------------------------------------------------------------------------------ the driver

def _driver_address(hosts: Optional[str], network_interface: Optional[str]) -> str:
    """An address of this machine that the ranks can reach: 127.0.0.1 when they all run here, the
    named interface's, or the one this machine uses to reach the first host."""
    if not hosts:
        return "127.0.0.1"
    if network_interface:
        address = interface_address(network_interface.split(",")[0].strip())
        if address:
            return address
    first = hosts.split(",")[0].partition(":")[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(first), 9))  # picks the route; sends nothing
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _forward(stream, target) -> None:
    for chunk in iter(lambda: stream.read1(1 << 16), b""):
        buffer = getattr(target, "buffer", None)
        if buffer is not None:
            target.flush()
            buffer.write(chunk)
            buffer.flush()
        else:  # a text-only stream (a notebook's)
            target.write(chunk.decode(errors="replace"))
            target.flush()


def _refuse(**options: Any) -> None:
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"run(): {name} is for elastic runs, which fusionring does not do: "
                             f"it starts a fixed set of MPI ranks")


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        np: Optional[int] = None, num_proc: Optional[int] = None, hosts: Optional[str] = None,
        hostfile: Optional[str] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, network_interface: Optional[str] = None,
        output_filename: Optional[str] = None, mpi_args: Optional[str] = None,
        verbose: Optional[bool] = None, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, executable: Optional[str] = None,
        env: Optional[Dict[str, str]] = None, start_timeout: Optional[int] = None,
        disable_cache: Optional[bool] = None, min_np: Optional[int] = None,
        max_np: Optional[int] = None, slots: Optional[int] = None,
        reset_limit: Optional[int] = None, cooldown_range: Optional[Tuple[int, int]] = None,
        mpiexec: Optional[str] = None, network_interfaces: Optional[str] = None,
        min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        host_discovery_script: Optional[str] = None) -> List[Any]:
    """Call ``func(*args, **kwargs)`` on `np` ranks and return their results, indexed by rank.

    Keyword arguments follow ``horovod.run`` (``num_proc`` is a synonym of ``np``; default 1;
    ``network_interfaces`` of ``network_interface``).
    `env` replaces the environment the ranks start with (default: this process's). Raises
    ``RuntimeError`` naming every rank that failed, with its traceback, when any did; ``ValueError``
    for elastic options and ``use_gloo`` (start_timeout and disable_cache change nothing, as in
    ``fusionrun``). Rank output goes to this process's ``sys.stdout`` / ``sys.stderr``.
    """
    _refuse(min_np=min_np, max_np=max_np, min_num_proc=min_num_proc, max_num_proc=max_num_proc,
            slots=slots, reset_limit=reset_limit, cooldown_range=cooldown_range,
            host_discovery_script=host_discovery_script)
    if network_interface is not None and network_interfaces is not None \
            and network_interface != network_interfaces:
        raise ValueError(f"run(): network_interface={network_interface!r} and "
                         f"network_interfaces={network_interfaces!r} disagree")
    network_interface = network_interface if network_interface is not None else network_interfaces
    if use_gloo:
        raise ValueError("run(): use_gloo: fusionring's ranks are MPI processes")
    if np is not None and num_proc is not None and np != num_proc:
        raise ValueError(f"run(): np={np} and num_proc={num_proc} disagree")
    ranks = np if np is not None else num_proc if num_proc is not None else 1
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"run(): np must be a positive whole number, got {ranks!r}")
    del use_mpi, start_timeout, disable_cache  # MPI is the only way; no pre-launch checks

    pickle = pickler()
    call = pickle.dumps((func, tuple(args), dict(kwargs or {})))
    token = secrets.token_hex(16)
    if hostfile is not None and hosts is None:
        try:
            listed = launcher._read_hostfile(hostfile)
        except launcher.LaunchError as exc:
            raise ValueError(f"run(): {exc}") from None
    else:
        listed = hosts
    server = _Exchange((_driver_address(listed, network_interface), 0), token, call)
    address = "%s:%d" % server.server_address[:2]
    words = ["-np", str(ranks)]
    for option, value in (("-H", hosts), ("--hostfile", hostfile), ("--ssh-port", ssh_port),
                          ("--ssh-identity-file", ssh_identity_file),
                          ("--network-interfaces", network_interface),
                          ("--output-filename", output_filename), ("--mpi-args", mpi_args),
                          ("--mpiexec", mpiexec)):
        if value is not None:
            words += [option, str(value)]
    if verbose:
        words.append("--verbose")
    words += ["--", executable or sys.executable, "-m", "fusionring.run_task", address]

    thread = threading.Thread(target=server.serve_forever, name="fusionring-run", daemon=True)
    thread.start()
    try:
        try:
            request = launcher.parse_args(words)
        except launcher.LaunchError as exc:
            raise ValueError(f"run(): {exc}") from None
        request.rank_env[TOKEN_ENV] = token
        found = launcher.find_mpiexec(request.mpiexec)
        launch = launcher.build_launch(request, found, launcher.detect_flavour(found),
                                       environ=env)
        for note in launch.notes:
            print(f"fusionring.run: {note}", file=sys.stderr)
        if verbose:
            shown = launch.shell_command().replace(token, "...")
            print(f"fusionring.run: {shown}", file=sys.stderr, flush=True)
        launch.prepare()
        code = _execute(launch, env)
    finally:
        server.shutdown()
        server.server_close()
    return _collect(server.results, ranks, code, pickle)


def _execute(launch: "launcher.Launch", env: Optional[Dict[str, str]]) -> int:
    """Run mpiexec with its output forwarded to sys.stdout / sys.stderr; its exit code."""
    full_env = dict(os.environ if env is None else env)
    full_env.update(launch.env_added)
    try:
        child = subprocess.Popen(launch.argv, env=full_env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as exc:
        raise RuntimeError(f"could not start {launch.argv[0]}: {exc}") from exc
    pumps = [threading.Thread(target=_forward, args=(child.stdout, sys.stdout), daemon=True),
             threading.Thread(target=_forward, args=(child.stderr, sys.stderr), daemon=True)]
    for pump in pumps:
        pump.start()
    try:
        code = child.wait()
    except KeyboardInterrupt:
        child.terminate()  # Hydra and Open MPI pass it on to the ranks
        child.wait()
        raise
    for pump in pumps:
        pump.join()
    return code


def _collect(results: Dict[int, bytes], ranks: int, code: int, pickle) -> List[Any]:
    values: List[Any] = [None] * ranks
    failed: List[Tuple[int, str]] = []
    for rank in range(ranks):
        data = results.get(rank)
        if data is None:
            failed.append((rank, "returned nothing (the process ended before its function did)"))
            continue
        status, value = pickle.loads(data)
        if status == "ok":
            values[rank] = value
        else:
            failed.append((rank, value))
    if failed:
        names = ", ".join(str(rank) for rank, _ in failed)
        detail = "\n".join(f"rank {rank}: {text.rstrip()}" for rank, text in failed)
        raise RuntimeError(f"fusionring.run: rank(s) {names} of {ranks} failed (mpiexec exit "
                           f"code {code})\n{detail}")
    if code != 0:
        raise RuntimeError(f"fusionring.run: mpiexec exited with code {code} after every rank "
                           f"returned")
    return values
