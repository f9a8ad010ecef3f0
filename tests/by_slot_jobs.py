"""What ``tests/test_dispatch_by_slot.py`` runs on CPU ranks in processes."""
import torch
import torch.distributed as dist

import moe_comm
from cases import Case, make_inputs


def by_slot_against_dispatch(rank, world_size, case: Case, fp8: bool, ue8m0: bool) -> dict:
    """Per call (two: both parities): ``dispatch_by_slot`` against ``dispatch`` on the same
    inputs, by the formula of its docstring; returns what was compared."""
    buf = moe_comm.Buffer(dist.group.WORLD, case.hidden, case.num_experts, case.max_tokens,
                          case.dtype)
    compared = []
    try:
        for it in range(2):
            xs, idxs, ws = make_inputs(case, it)
            kw = dict(fp8=fp8, ue8m0=ue8m0) if fp8 else {}
            want = buf.dispatch(xs[rank], idxs[rank], ws[rank], case.alignment, **kw)
            got = buf.dispatch_by_slot(xs[rank], idxs[rank], ws[rank], case.alignment, **kw)
            h = want.handle
            n = int(h.recv_slot_offsets[-1])
            rows = h.slot_rows[:n].to(torch.int64)
            first = torch.where(rows >= 0, rows, h.num_rows).amin(1)
            assert got.x.shape[0] == n and bool((first < h.num_rows).all()), (n, first)
            same = lambda a, b: a.dtype == b.dtype and torch.equal(  # noqa: E731
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            assert same(got.x, want.x[first]), f"rank {rank} call {it}: rows"
            if fp8:
                assert same(got.x_scales, want.x_scales[first]), f"rank {rank} call {it}: scales"
            for name in ("weights", "src_rank", "src_token", "tokens_per_expert",
                         "expert_offsets"):
                assert same(getattr(got, name), getattr(want, name)), (rank, it, name)
            for name in ("slot_rows", "recv_slot_offsets", "num_rows"):
                a, b = getattr(got.handle, name), getattr(h, name)
                assert (a == b) if isinstance(a, int) else same(a, b), (rank, it, name)
            # the slot order is DeepEP's: source rank, then token
            order = want.src_rank[first] * case.max_tokens + want.src_token[first]
            assert bool((order[1:] > order[:-1]).all()), f"rank {rank} call {it}: order"
            compared.append(n)
    finally:
        buf.close()
    return {"slots": compared}


def by_slot_in_rounds_is_refused(rank, world_size, case: Case) -> str:
    from moe_comm.workspace import staging_slot_bytes

    per_slot = staging_slot_bytes(world_size, case.hidden, case.topk, case.dtype)
    buf = moe_comm.Buffer(dist.group.WORLD, case.hidden, case.num_experts, case.max_tokens,
                          case.dtype, staging_bytes=2 * per_slot)
    try:
        xs, idxs, ws = make_inputs(case)
        buf.dispatch_by_slot(xs[rank], idxs[rank], ws[rank])
    except ValueError as error:
        return str(error)
    finally:
        buf.close()
    return "not refused"
