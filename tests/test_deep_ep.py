"""``moe_comm.deep_ep``: DeepEP's Buffer API over moe_comm, against a model of DeepEP's
semantics (``deep_ep_jobs``) on CPU ranks."""
import subprocess
import sys
import types

import deep_ep_jobs
import pytest

from cases import Case
from moe_comm import deep_ep


@pytest.mark.parametrize("R,alignment", [(2, 1), (4, 4), (8, 1)])
def test_normal_mode_matches_deepep_semantics(ranks, R, alignment):
    case = Case(R, 4 * R, 128, 4, tuple(6 + (r % 3) for r in range(R)), alignment=alignment,
                seed=R)
    ranks(R).run(deep_ep_jobs.normal_mode, case)


def test_normal_mode_fp8_pairs(ranks):
    case = Case(2, 8, 256, 2, (7, 5), seed=3)
    ranks(2).run(deep_ep_jobs.normal_mode, case, fp8=True)


@pytest.mark.parametrize("R,fp8,ue8m0", [(2, False, False), (4, True, False), (8, False, False),
                                         (2, True, True)])
def test_low_latency_matches_deepep_semantics(ranks, R, fp8, ue8m0):
    case = Case(R, 2 * R, 512 if ue8m0 else 256, 2, tuple(4 + r for r in range(R)), seed=5 + R)
    ranks(R).run(deep_ep_jobs.low_latency, case, fp8=fp8, ue8m0=ue8m0)


def test_what_cannot_be_honoured_raises_with_a_sentence(ranks):
    case = Case(2, 8, 256, 2, (5, 6), seed=9)
    for out in ranks(2).run(deep_ep_jobs.refusals, case):
        assert set(out) == {"no_topk", "local_buffer", "bias", "nonlocal_weights", "logfmt",
                            "round_scale"}, out
        assert all(msg.startswith("moe_comm.deep_ep: ") and len(msg) > 40
                   for msg in out.values()), out


def test_install_registers_and_refuses_a_real_deep_ep(monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.delitem(sys.modules, "deep_ep.utils", raising=False)
    deep_ep.install()
    import deep_ep as imported
    from deep_ep.utils import EventOverlap

    assert imported is deep_ep and EventOverlap is deep_ep.EventOverlap
    deep_ep.install()  # idempotent
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    with pytest.raises(RuntimeError, match="already imported"):
        deep_ep.install()


def test_check_prints_the_feature_table():
    proc = subprocess.run([sys.executable, "-m", "moe_comm.deep_ep", "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "get_dispatch_layout" in proc.stdout and "use_logfmt" in proc.stdout


def test_shrink_mask_calls(ranks):
    R = 4
    case = Case(R, 2 * R, 128, 2, (4, 5, 3, 4), seed=13)
    for statuses in ranks(R).run(deep_ep_jobs.shrink_masks, case):   # a call while masked
        assert statuses == [[0] * R, [0] * (R - 1) + [1], [0] * R], statuses
