"""Every public call of the native Buffer with one mistake, on 1 and 2 ranks: a TypeError or
ValueError whose text names the argument, before any kernel runs on its inputs (a bad normal
dispatch input on 2 ranks still takes part in the call as a refusal, with no rows:
tests/test_call_agreement.py), and correct calls afterwards match the reference bit for bit. The
facade's table is tests/test_deep_ep.py::test_bad_input_to_every_facade_call_names_the_argument.
"""
import pytest
from bad_input_jobs import bad_inputs


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_bad_input_names_its_argument_and_the_buffer_goes_on(ranks, world_size):
    for rank, found in enumerate(ranks(world_size).run(bad_inputs)):
        wrong = {what: text for what, text in found.items()
                 if not (text is True or (isinstance(text, str) and
                                         text.split(":")[0] in ("TypeError", "ValueError",
                                                                "RuntimeError")))}
        assert not wrong, (rank, wrong)
        assert len(found) == 36, (rank, sorted(found))


def test_dispatch_inputs_are_checked_once_per_signature(monkeypatch):
    """A dispatch's inputs are checked on the first call of each signature (what the checks
    read: types, dtypes, shapes, devices, the ints); a bad input after good ones is still
    refused, by the same error."""
    import torch

    import moe_comm
    from moe_comm import buffer as buffer_module

    checked = []
    check = buffer_module.check_dispatch_inputs
    monkeypatch.setattr(buffer_module, "check_dispatch_inputs",
                        lambda *args, **kwargs: (checked.append(args[0].shape[0]),
                                                 check(*args, **kwargs)))
    buf = moe_comm.Buffer.loopback(1, 128, 8, 6)[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn((6, 128), generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    w = torch.rand((6, 2), generator=g)
    first = buf.dispatch(x, idx, w)
    again = buf.dispatch(x.clone(), idx.clone(), w.clone())
    assert checked == [6]
    assert torch.equal(first.x, again.x) and torch.equal(first.src_token, again.src_token)
    buf.dispatch(x[:4], idx[:4], w[:4])
    buf.dispatch(x, idx, w, expert_alignment=4)
    assert checked == [6, 4, 6]
    with pytest.raises(TypeError, match="topk_idx must be torch.int64"):
        buf.dispatch(x, idx.int(), w)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        buf.dispatch(x, idx, w[:, :1])
    assert checked == [6, 4, 6, 6, 6]
    assert torch.equal(buf.dispatch(x, idx, w).x, first.x) and checked == [6, 4, 6, 6, 6]
    buf.close()
