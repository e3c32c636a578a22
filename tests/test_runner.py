"""fusionring.run (horovod.run): a function called on N ranks from Python, results back by rank."""
from __future__ import annotations

import json
import socket
import threading

import pytest

import fusionring
from fusionring import runner

pytestmark = pytest.mark.timeout(180)


def test_results_come_back_by_rank_from_a_function_defined_here():
    scale = 3.0  # captured by value: the function is not importable from the ranks

    def train(base, offset=0):
        import torch

        import fusionring.torch as hvd
        hvd.init()
        total = hvd.allreduce(torch.full((2,), float(hvd.rank() + base)) * scale, op=hvd.Sum)
        return hvd.rank(), hvd.size(), total.tolist(), offset

    results = fusionring.run(train, args=(1,), kwargs={"offset": 7}, np=3)
    expected_total = sum((r + 1) * scale for r in range(3))
    assert results == [(r, 3, [expected_total] * 2, 7) for r in range(3)]
    assert fusionring.run(lambda: "one", num_proc=1) == ["one"]
    assert fusionring.run is runner.run


def test_a_failing_rank_is_named_with_its_traceback():
    def step():
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            raise KeyError("no such layer")
        return "fine"

    with pytest.raises(RuntimeError) as raised:
        fusionring.run(step, np=2)
    text = str(raised.value)
    assert "rank(s) 1 of 2 failed" in text and "KeyError: 'no such layer'" in text
    assert "rank 0" not in text


def test_a_return_value_that_cannot_travel_is_an_error_naming_the_rank():
    with pytest.raises(RuntimeError, match="rank 0: the return value could not be pickled"):
        fusionring.run(lambda: threading.Lock(), np=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"np": 2, "min_np": 1}, "min_np is for elastic runs"),
    ({"np": 2, "min_num_proc": 1}, "min_num_proc is for elastic runs"),
    ({"np": 2, "max_num_proc": 4}, "max_num_proc is for elastic runs"),
    ({"np": 2, "host_discovery_script": "discover.sh"}, "host_discovery_script is for elastic"),
    ({"np": 2, "network_interface": "eth0", "network_interfaces": "eth1"}, "disagree"),
    ({"np": 2, "use_gloo": True}, "use_gloo"),
    ({"np": 0}, "positive whole number"),
    ({"np": 2, "num_proc": 3}, "disagree"),
    ({"np": 2, "hosts": "a:0"}, "SLOTS > 0"),
])
def test_options_fusionring_cannot_honour_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fusionring.run(lambda: None, **kwargs)


# horovod.run's parameters in Horovod 0.28.1 (horovod/runner/__init__.py), deprecated names included
HOROVOD_RUN_PARAMETERS = (
    "func", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "slots", "reset_limit",
    "cooldown_range", "hosts", "hostfile", "host_discovery_script", "start_timeout", "ssh_port",
    "ssh_identity_file", "disable_cache", "output_filename", "verbose", "use_gloo", "use_mpi", "mpi_args",
    "network_interface", "network_interfaces", "executable", "np", "min_np", "max_np")


def test_run_takes_every_keyword_of_horovod_run():
    import inspect
    accepted = inspect.signature(fusionring.run).parameters
    assert [name for name in HOROVOD_RUN_PARAMETERS if name not in accepted] == []
    assert list(accepted)[:3] == ["func", "args", "kwargs"]


def test_network_interfaces_is_network_interface(monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "_driver_address",
                        lambda hosts, interface: seen.append(interface) or "127.0.0.1")
    assert fusionring.run(lambda: 7, np=1, network_interfaces="lo") == [7]
    assert seen == ["lo"]


def test_the_exchange_answers_only_the_token():
    server = runner._Exchange(("127.0.0.1", 0), "secret", b"the call")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        def ask(token):
            with socket.create_connection(server.server_address[:2], timeout=10) as sock:
                runner.send_message(sock, json.dumps({"token": token, "op": "get"}).encode())
                try:
                    return runner.receive_message(sock)
                except ConnectionError:
                    return None

        assert ask("wrong") is None
        assert ask("secret") == b"the call"
    finally:
        server.shutdown()
        server.server_close()
