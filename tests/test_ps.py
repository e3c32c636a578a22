"""The parameter server's single-process parts: payloads, message helpers, argument checks."""
import pickle

import numpy as np
import pytest
import torch

import fusionring.torch as hvd
from fusionring import ps
from fusionring.exceptions import NotInitializedError
from fusionring.ps import payload, protocol


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(6, 8, generator=g)), ("b", torch.randn(8, generator=g)),
            ("s", torch.randn((), generator=g))]


def _decode_with_sender_spec(compression, named):
    layout, buffer = payload.encode(compression, named)
    # the layout crosses the wire pickled, the decoder is rebuilt on the server from the spec
    layout = pickle.loads(pickle.dumps(layout))
    decoder = payload.build_decoder(payload.decoder_spec(compression))
    return payload.decode(decoder, layout, buffer.copy()), buffer


def test_none_payload_round_trips_exactly():
    named = _named()
    out, buffer = _decode_with_sender_spec(hvd.Compression.none, named)
    assert buffer.size == sum(t.numel() * 4 for _, t in named)
    for name, t in named:
        np.testing.assert_array_equal(out[name].numpy(), t.numpy())


def test_fp16_payload_is_the_float16_rounding():
    named = _named(1)
    out, buffer = _decode_with_sender_spec(hvd.Compression.fp16, named)
    assert buffer.size == sum(t.numel() * 2 for _, t in named)
    for name, t in named:
        assert out[name].dtype == torch.float32
        np.testing.assert_array_equal(out[name].numpy(), t.numpy().astype(np.float16).astype(np.float32))


def test_per_rank_nm_payload_keeps_the_largest_n_of_every_m():
    named = [("w", torch.randn(16, 8, generator=torch.Generator().manual_seed(2)))]
    comp = hvd.Compression.nm(2, 4, shared_mask=False, error_feedback=False)
    out, buffer = _decode_with_sender_spec(comp, named)
    x = named[0][1].numpy().reshape(-1, 4)
    expect = np.zeros_like(x)
    top = np.argsort(-np.abs(x), axis=1, kind="stable")[:, :2]
    np.put_along_axis(expect, top, np.take_along_axis(x, top, axis=1), axis=1)
    np.testing.assert_array_equal(out["w"].numpy(), expect.reshape(16, 8))
    assert buffer.size < named[0][1].numel() * 4  # fewer bytes than dense


def test_two_workers_per_rank_masks_need_no_agreement():
    # each worker's push is decoded on its own: different masks, then summed densely on the server
    comp_a = hvd.Compression.nm(2, 4, shared_mask=False, error_feedback=False)
    comp_b = hvd.Compression.nm(2, 4, shared_mask=False, error_feedback=False)
    a, b = torch.randn(32), torch.randn(32)
    da, _ = _decode_with_sender_spec(comp_a, [("g", a)])
    db, _ = _decode_with_sender_spec(comp_b, [("g", b)])
    ra, _ = _decode_with_sender_spec(hvd.Compression.nm(2, 4, shared_mask=False, error_feedback=False), [("g", a)])
    torch.testing.assert_close(da["g"] + db["g"], ra["g"] + db["g"], rtol=0, atol=0)
    assert (da["g"] != 0).sum() == 16 and (db["g"] != 0).sum() == 16


def test_shared_mask_nm_is_refused_naming_compression():
    with pytest.raises(ValueError, match="compression.*shared_mask"):
        payload.check_compressor(hvd.Compression.nm(2, 4, shared_mask=True))
    payload.check_compressor(hvd.Compression.nm(2, 4, shared_mask=False))
    with pytest.raises(ValueError, match="compression"):
        payload.check_compressor(object())


def test_pack_and_unpack_restore_parameters():
    src = [t for _, t in _named(3)] + [torch.arange(5, dtype=torch.float64)]
    buffer = payload.pack(src)
    assert buffer.size == payload.packed_bytes(src)
    dst = [torch.zeros_like(t) for t in src]
    payload.unpack_into(buffer, dst)
    for s, d in zip(src, dst):
        assert torch.equal(s, d)
    with pytest.raises(ValueError, match="bytes"):
        payload.unpack_into(buffer[:-4], dst)


def test_shards_are_balanced_by_bytes_and_cover_every_parameter():
    names = [f"p{i}" for i in range(7)]
    nbytes = [400, 100, 100, 100, 100, 60, 40]
    shards = protocol.shard_names(names, nbytes, 2)
    assert sorted(sum(shards, [])) == sorted(names)
    loads = [sum(nbytes[names.index(n)] for n in s) for s in shards]
    assert sorted(loads) == [440, 460]  # largest first, each to the least loaded server
    assert protocol.shard_names(names, nbytes, 2) == shards  # deterministic
    assert protocol.shard_names(names, nbytes, 1) == [names]


def test_model_mismatch_names_the_parameter_and_the_workers():
    ref = protocol.describe_model([("a", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    assert protocol.model_mismatch(ref, ref, 1) is None
    shape = protocol.describe_model([("a", torch.zeros(3, 2)), ("b", torch.zeros(3))])
    msg = protocol.model_mismatch(ref, shape, 2)
    assert "'a'" in msg and "worker 0" in msg and "worker 2" in msg and "[2, 3]" in msg
    dtype = protocol.describe_model([("a", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.float64))])
    assert "'b'" in protocol.model_mismatch(ref, dtype, 1)
    missing = protocol.describe_model([("a", torch.zeros(2, 3))])
    assert "not in worker 1's" in protocol.model_mismatch(ref, missing, 1)


def test_headers_survive_pickling():
    h = protocol.Header(protocol.PUSH, {"iteration": 3, "nbytes": 12})
    back = pickle.loads(pickle.dumps(h))
    assert back.kind == "push" and back.fields == {"iteration": 3, "nbytes": 12}
    assert len({protocol.TAG_TO_SERVER, protocol.TAG_TO_SERVER_DATA, protocol.TAG_TO_WORKER,
                protocol.TAG_TO_WORKER_DATA}) == 4


def test_poll_until_raises_past_the_deadline():
    import time
    from fusionring.exceptions import StallError
    with pytest.raises(StallError, match="server rank 0"):
        protocol.poll_until(lambda: False, time.monotonic() + 0.05, lambda: "server rank 0 is silent")


def test_calls_before_init_raise():
    with pytest.raises(NotInitializedError):
        ps.worker_rank()
    with pytest.raises(NotInitializedError):
        ps.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                                named_parameters=[])


def test_init_needs_a_worker_rank():
    # one process: no rank is left to be a worker
    with pytest.raises(ValueError, match="num_servers"):
        ps.init(num_servers=1)


def test_parts_travel_alone_when_large_and_together_when_small():
    small = payload.SMALL_PART_BYTES
    assert payload.runs([10, 10, 2 * small, 5, 5, small, small - 1, 1]) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8)]
    assert payload.runs([]) == [] and payload.runs([0, 0]) == [(0, 2)]


def test_only_sends_from_a_parts_own_memory_hold_it():
    """A server may change its parameters once the sends that read their memory are done; grouped small parts
    travel as a copy, so it need not wait for those (asynchronous updates would wait on each reply)."""
    from mpi4py import MPI
    comm = MPI.COMM_SELF
    small = payload.SMALL_PART_BYTES
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 255, n, dtype=np.uint8) for n in (10, 20, 2 * small, 30)]
    expected = np.concatenate(parts)
    copied = []
    held = payload.send_parts(comm, parts, 0, 7, copied=copied)
    # the large part and the last small one travel alone, from their memory; (10, 20) as one copy
    assert len(held) == 2 and len(copied) == 1
    for p in (parts[0], parts[1]):
        p[...] = 0  # changed while their send is in flight: what arrives is what was sent
    received = np.empty(expected.size, np.uint8)
    payload.recv_parts(comm, received, [p.size for p in parts], 0, 7)
    MPI.Request.Waitall(held + copied)
    assert np.array_equal(received, expected)
    # without `copied`, every request comes back to the caller, as a worker wants them
    requests = payload.send_parts(comm, parts, 0, 8)
    assert len(requests) == 3
    payload.recv_parts(comm, received, [p.size for p in parts], 0, 8)
    MPI.Request.Waitall(requests)


def test_uncompressed_parts_are_views_of_the_gradients():
    named = _named(4)
    layout, parts = payload.encode_parts(hvd.Compression.none, named)
    for (_, t), part in zip(named, parts):
        assert np.shares_memory(part, t.numpy())
    assert payload.part_sizes(pickle.loads(pickle.dumps(layout))) == [p.size for p in parts]
