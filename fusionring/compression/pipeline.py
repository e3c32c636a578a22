"""A compressed reduction as a pipeline over chunks: while the ring carries one chunk, a
helper thread encodes the next and decodes the one before, so the CPU work hides behind the
transfer instead of adding to it. Generic over what encode, reduce and decode do."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, List, Optional


_helper_lock = threading.Lock()
_helper: Optional[concurrent.futures.ThreadPoolExecutor] = None


def run_pipeline(chunks: int, encode: Callable[[int], None], reduce: Callable[[int], None],
              decode: Callable[[int], None]) -> None:
    """encode(k), reduce(k), decode(k) for every chunk, reduce on this thread in chunk order,
    encode and decode on a helper thread so they overlap the reductions of other chunks."""
    global _helper
    if chunks == 1:
        encode(0)
        reduce(0)
        decode(0)
        return
    with _helper_lock:
        if _helper is None:
            _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fusionring-pipeline")
        helper = _helper

    def submit(stage: Callable[[int], None], k: int) -> concurrent.futures.Future:
        try:
            return helper.submit(stage, k)
        except RuntimeError:  # the interpreter is shutting down: run it here instead
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                stage(k)
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - handed on through the future
                done.set_exception(exc)
            return done

    encoded = [submit(encode, 0), submit(encode, 1)]
    decoded: List[concurrent.futures.Future] = []
    try:
        for k in range(chunks):
            encoded[k].result()
            reduce(k)
            decoded.append(submit(decode, k))
            if k + 2 < chunks:
                encoded.append(submit(encode, k + 2))
        for future in decoded:
            future.result()
    finally:  # never return while the helper may still touch the buffers
        concurrent.futures.wait(encoded + decoded)


def split_chunks(pieces: list, count: int, full: int) -> List[list]:
    """Consecutive pieces grouped into pipeline chunks. The first and last chunks are a quarter
    of the others: the first encode and the last decode are the only ones nothing hides.
    `pieces` are (_, lo, hi, ...) tuples of `count` elements in all; `full`: elements a chunk
    holds."""
    if count <= full:
        return [pieces]
    middle = count - full // 2
    parts = max(1, -(-middle // full))
    ends = [full // 4] + [full // 4 + middle * (i + 1) // parts for i in range(parts)] + [count]
    chunks: List[list] = [[]]
    done = 0
    for piece in pieces:  # a piece goes to the chunk its middle falls in
        middle_at = done + (piece[2] - piece[1]) / 2
        if chunks[-1] and middle_at >= ends[len(chunks) - 1]:
            chunks.append([])
        chunks[-1].append(piece)
        done += piece[2] - piece[1]
    return chunks
