"""The torch.library custom ops: schemas, fake implementations, autograd, torch.compile."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

import moe_comm
from cases import Case, expert_fn, make_inputs
from moe_comm import reference
from moe_comm.types import DispatchOutputs


def _one_rank(H=32, E=4, T=8, dtype=torch.float32):
    buf = moe_comm.Buffer.loopback(1, H, E, T, dtype)[0]
    xs, idxs, ws = make_inputs(Case(1, E, H, 2, (T,), dtype, seed=5))
    return buf, xs[0], idxs[0], ws[0]


@pytest.mark.parametrize("max_recv_rows", [None, 40])
def test_opcheck_dispatch_and_combine(max_recv_rows):
    buf, x, idx, w = _one_rank()
    torch.library.opcheck(torch.ops.moe_comm.dispatch.default,
                          (buf.id, x, None, idx, w, 1, 0, False, False, max_recv_rows))
    outs = DispatchOutputs(*torch.ops.moe_comm.dispatch(buf.id, x, None, idx, w, 1, 0, False,
                                                        False, max_recv_rows))
    y, tpe, offsets = outs.x, outs.tokens_per_expert, outs.expert_offsets
    slot_of, slot_rows, slot_off = outs.slot_of, outs.slot_rows, outs.slot_offsets
    torch.library.opcheck(torch.ops.moe_comm.combine.default,
                          (buf.id, y, outs.weights, None, slot_of, slot_rows, slot_off))
    torch.library.opcheck(torch.ops.moe_comm.dispatch_cached.default,
                          (buf.id, x, slot_of, slot_rows, slot_off, tpe, offsets, y.shape[0]))


def test_a_cached_dispatch_refuses_rows_unlike_its_handles_and_stays_usable():
    """Another hidden size, fewer or more tokens, another dtype: ValueError naming the shape
    before anything is sent; then the right rows move as the dispatch moved them."""
    buf, x, idx, w = _one_rank()
    outs = DispatchOutputs(*torch.ops.moe_comm.dispatch(buf.id, x, None, idx, w, 1, 0, False,
                                                        False, None))

    def cached(rows):
        return torch.ops.moe_comm.dispatch_cached(
            buf.id, rows, outs.slot_of, outs.slot_rows, outs.slot_offsets,
            outs.tokens_per_expert, outs.expert_offsets, outs.x.shape[0])

    for bad in (x[:, :16], x[:3], torch.cat([x, x]), x.double()):
        with pytest.raises(ValueError, match=r"x must be \[8, 32\] torch.float32, got"):
            cached(bad)
    assert torch.equal(cached(x), outs.x)


def test_fake_implementations_give_shapes():
    buf, x, idx, w = _one_rank(H=32, E=4)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fx, fidx, fw = mode.from_tensor(x), mode.from_tensor(idx), mode.from_tensor(w)
        outs = DispatchOutputs(*torch.ops.moe_comm.dispatch(buf.id, fx, None, fidx, fw, 16, 0,
                                                            False, False, None))
        assert outs.x.shape[1] == 32 and outs.x.dtype == torch.float32
        static = DispatchOutputs(*torch.ops.moe_comm.dispatch(buf.id, fx, None, fidx, fw, 16,
                                                              0, False, False, 99))
        assert static.x.shape == (99, 32) and static.weights.shape == (99,)  # no dynamic size
        assert outs.tokens_per_expert.shape == (4,) and outs.expert_offsets.shape == (5,)
        assert outs.slot_of.shape == (8, 1) and outs.slot_of.dtype == torch.int32  # [T, R]
        out, pair = torch.ops.moe_comm.combine(buf.id, outs.x, outs.weights, None, outs.slot_of,
                                               outs.slot_rows, outs.slot_offsets)
        assert out.shape == (8, 32) and pair.shape == (0,)


def test_autograd_one_rank_against_reference():
    buf, x, idx, w = _one_rank(dtype=torch.float64)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    res = buf.dispatch(x1, idx, w1)
    out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
    out.square().sum().backward()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference.dispatch_all([x2], [idx], [w2], num_experts=4)[0]
    ref_out = reference.combine_all([expert_fn(ref.x, ref.expert_offsets)], [ref.handle],
                                    [ref.weights])[0]
    ref_out.square().sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-12, atol=1e-12)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _ops_run(fn) -> list:
    """The names of moe_comm's custom ops that ``fn()`` ran (the profiler's events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith("moe_comm::")})


def test_eager_calls_run_the_ops_body_with_its_results(monkeypatch):
    """Eager calls run each op's body in place of the custom op, with the op's bits: under the
    autograd Function where autograd records them (forward and backward: the gradients of the
    op's path), alone where it does not (grad mode off, or no input requiring grad); a call a
    dispatch mode watches takes the op."""
    from moe_comm import ops

    applied = []

    def counted(name):
        apply = getattr(ops, name).apply

        def counting(*args):
            applied.append(name)
            return apply(*args)

        monkeypatch.setattr(getattr(ops, name), "apply", counting)

    counted("_Dispatch")
    counted("_Combine")
    buf, x, idx, w = _one_rank(dtype=torch.float64)

    def moe(x, w):
        res = buf.dispatch(x, idx, w)
        out = buf.combine(expert_fn(res.x, res.expert_offsets), res.handle, res.weights)
        if out.requires_grad:
            out.square().sum().backward()
        return res, out

    def grads(watch):
        x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
        applied.clear()
        if watch:
            with _PassThrough():
                names = _ops_run(lambda: moe(x1, w1))
        else:
            names = _ops_run(lambda: moe(x1, w1))
        assert applied == ["_Dispatch", "_Combine"], (watch, applied)
        return x1.grad, w1.grad, names

    gx_op, gw_op, names = grads(watch=True)  # a mode watches: every op, its backward's too
    assert names == ["moe_comm::combine", "moe_comm::dispatch", "moe_comm::dispatch_cached",
                     "moe_comm::row_dot"], names
    gx, gw, names = grads(watch=False)
    assert names == [], names
    assert torch.equal(gx, gx_op) and torch.equal(gw, gw_op)
    with _PassThrough():
        through_op, out_op = moe(x, w)
    for grad in (False, True):
        applied.clear()
        with torch.set_grad_enabled(grad):
            names = _ops_run(lambda: moe(x, w))
            res, out = moe(x, w)
        assert applied == [] and names == [], (grad, applied, names)
        assert res.x.grad_fn is None and out.grad_fn is None
        for field in ("x", "weights", "src_rank", "src_token", "tokens_per_expert",
                      "expert_offsets"):
            assert torch.equal(getattr(res, field), getattr(through_op, field)), field
        assert torch.equal(out, out_op)


@pytest.mark.slow
def test_torch_compile_aot_eager():
    buf, x, idx, w = _one_rank()

    def moe(x, idx, w):
        res = buf.dispatch(x, idx, w)
        return buf.combine(res.x * 2, res.handle, res.weights)

    eager = moe(x, idx, w)
    compiled = torch.compile(moe, backend="aot_eager")(x, idx, w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
