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
    ({"np": 2, "use_gloo": True}, "use_gloo"),
    ({"np": 0}, "positive whole number"),
    ({"np": 2, "num_proc": 3}, "disagree"),
    ({"np": 2, "hosts": "a:0"}, "SLOTS > 0"),
])
def test_options_fusionring_cannot_honour_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fusionring.run(lambda: None, **kwargs)


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
