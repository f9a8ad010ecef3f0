"""Symmetric heaps: peers see each other's stores, and nothing is left in /dev/shm."""
import ctypes
import os
import subprocess
import sys

import torch
import torch.distributed as dist

from moe_comm.symm import ShmHeap, create_loopback_heaps, reap_stale_segments


def exchange_through_pointers(rank, world_size) -> list[int]:
    """Each rank writes (rank + 1) * 1000 + peer into every peer's segment at its own slot,
    through the peer-pointer table, then reads what all peers wrote into its segment."""
    heap = ShmHeap(dist.group.WORLD, 4096)
    heap.barrier()  # every rank has unlinked its name by now
    assert [n for n in os.listdir("/dev/shm") if n.startswith("moe_comm")] == [], \
        "segments must be unlinked right after the bootstrap"
    for peer in range(world_size):
        value = ctypes.c_int64((rank + 1) * 1000 + peer)
        ctypes.memmove(int(heap.peer_ptrs[peer]) + 8 * rank, ctypes.byref(value), 8)
    heap.barrier()
    seen = heap.view(0, (world_size,), torch.int64).tolist()
    heap.barrier()
    heap.close()
    return seen


def test_shm_peers_see_each_others_stores(ranks):
    for rank, seen in enumerate(ranks(4).run(exchange_through_pointers)):
        assert seen == [(src + 1) * 1000 + rank for src in range(4)]


def crash_after_bootstrap(rank, world_size):
    ShmHeap(dist.group.WORLD, 1 << 16)
    if rank == 1:
        os._exit(3)  # a rank dies holding the mapping
    return True


def test_crashed_rank_leaves_no_files(ranks):
    pool = ranks(2)
    try:
        pool.run(crash_after_bootstrap, timeout_s=60)
    except Exception as error:  # rank 1 died: the pool reports it
        assert "WorkerDied" in str(error) or "EOFError" in str(error), error
    pool.close()
    assert [n for n in os.listdir("/dev/shm") if n.startswith("moe_comm")] == []


def test_stale_segment_of_dead_process_is_reaped():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    name = f"moe_comm_{int(dead.stdout)}_deadbeef_r0"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        assert name in reap_stale_segments()
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_live_process_segment_is_kept():
    name = f"moe_comm_{os.getpid()}_cafe_r0"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        assert name not in reap_stale_segments()
        assert os.path.exists(f"/dev/shm/{name}")
    finally:
        os.unlink(f"/dev/shm/{name}")


def test_loopback_heaps_share_one_pointer_table():
    heaps = create_loopback_heaps(3, 256)
    assert all(torch.equal(h.peer_ptrs, heaps[0].peer_ptrs) for h in heaps)
    assert [int(p) for p in heaps[0].peer_ptrs] == [h.local.data_ptr() for h in heaps]
    assert all(int(h.local.abs().sum()) == 0 for h in heaps)
    view = heaps[1].view(128, (4,), torch.int64)
    view.fill_(7)
    assert heaps[1].local[128:160].view(torch.int64).tolist() == [7] * 4
    try:
        heaps[0].view(250, (2,), torch.int64)
    except ValueError as error:
        assert "not aligned" in str(error) or "exceeds" in str(error)
    else:
        raise AssertionError("misaligned view accepted")
