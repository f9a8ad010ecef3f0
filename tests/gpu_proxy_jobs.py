"""The proxy's GPU half between processes of one GPU (``RankPool(..., compiled=True)``): each
rank's segment is device memory registered with NIXL, a Triton kernel posts descriptors to the
proxy's ring in pinned host memory (``kernels.proxy.post_transfer``, as the Buffer's kernels
do), the proxy thread WRITEs device memory to the peer's device memory and the peer's proxy
raises the signal word in device memory once the rows landed. The receiving rank polls the word
on its own stream (a kernel that spins would hold the GPU its peer's copies need when the
processes take turns) and then checks every byte."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import triton

from moe_comm.error_record import ErrorRecord
from moe_comm.kernels.comm import one_thread
from moe_comm.kernels.proxy import post_transfer
from moe_comm.transport.nixl import NixlProxy

DATA, SIGNALS = 4096, 0  # byte offsets: rows from here, signal words from 0


@triton.jit
def _post_kernel(ring_addr, slots, peer, signal_off, value, src, dst, nbytes, stride, rows,
                 errors, timeout_ns):
    if one_thread():
        post_transfer(ring_addr, slots, peer, signal_off, value, 1, src, dst, nbytes, stride,
                      rows, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, errors, timeout_ns)


def _pattern(rank: int, n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + 31 * rank) % 251).to(torch.uint8)


def _read_word(words: torch.Tensor, word: int, stream) -> int:
    if stream is None:  # host memory (CPU ranks)
        return int(words[word])
    with torch.cuda.stream(stream):
        host = words[word:word + 1].to("cpu", non_blocking=True)
    stream.synchronize()
    return int(host[0])


def _wait_word(segment: torch.Tensor, word: int, value: int, timeout_s: float, peer: int):
    """Polls ``segment``'s int64 word (on a GPU from a side stream) until it reaches ``value``
    (bounded; the error names the peer)."""
    words = segment.view(torch.int64)
    stream = torch.cuda.Stream(segment.device) if segment.is_cuda else None
    deadline = time.monotonic() + timeout_s
    while True:
        now = _read_word(words, word, stream)
        if now >= value:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {dist.get_rank()}: signal word {word} from rank {peer} is "
                               f"{now} after {timeout_s} s, expected {value}")
        time.sleep(1e-3)


def device_to_device(rank, world_size, row_bytes: int = 14336, rows: int = 64,
                     device: str = "cuda:0") -> dict:
    """Rank r posts to rank r ^ 1: ``rows`` contiguous rows (signal word 0), then the first
    half of every other row (signal word 1; strided: one NIXL entry per row). Returns what the
    proxy counted. ``device="cpu"``: the same between CPU ranks (host memory)."""
    if device != "cpu":
        torch.cuda.set_device(0)
    peer, n = rank ^ 1, rows * row_bytes
    segment = torch.zeros(DATA + 3 * n, dtype=torch.uint8, device=device)
    segment[DATA:DATA + n] = _pattern(rank, n).to(device)
    if segment.is_cuda:
        torch.cuda.synchronize()
    proxy = NixlProxy(dist.group.WORLD, segment, rank, world_size, [peer], timeout_s=60.0,
                      labels={SIGNALS: "first", SIGNALS + 8: "second"})
    errors = ErrorRecord(segment.device)
    try:
        dist.barrier()
        for signal, dst, nbytes, stride, count in (
                (SIGNALS, DATA + n, row_bytes, row_bytes, rows),
                (SIGNALS + 8, DATA + 2 * n, row_bytes // 2, 2 * row_bytes, rows // 2)):
            _post_kernel[(1,)](proxy.ring_addr, proxy.slots, peer, signal, 1, DATA, dst, nbytes,
                               stride, count, errors.address, int(60e9))
        if segment.is_cuda:
            torch.cuda.synchronize()
        errors.raise_timeout(rank=rank, channel="the proxy's ring", timeout_s=60.0)
        for word in (0, 1):
            _wait_word(segment, word, 1, 60.0, peer)
        got = segment[DATA + n:].cpu()
        want = _pattern(peer, n)
        assert torch.equal(got[:n], want), f"rank {rank}: contiguous rows differ"
        strided, half = got[n:2 * n].view(rows, row_bytes), row_bytes // 2
        assert torch.equal(strided[0::2, :half], want.view(rows, row_bytes)[0::2, :half]), \
            f"rank {rank}: strided rows differ"
        assert not strided[1::2].any() and not strided[0::2, half:].any(), \
            f"rank {rank}: bytes outside the strided rows were written"
        counts = {label: int(b[peer]) for label, b in proxy.bytes_by_label().items()}
        return dict(bytes=counts, messages=int(proxy.messages_to[peer]), memory=proxy._memory.kind)
    finally:
        dist.barrier()
        proxy.close()
