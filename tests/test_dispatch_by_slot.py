"""``Buffer.dispatch_by_slot``: each received token's row once, in slot order (the DeepEP
facade's normal dispatch, without a copy), equal to ``dispatch``'s rows gathered by slot."""
import by_slot_jobs as jobs
import pytest

from cases import Case


@pytest.mark.parametrize("fp8,ue8m0", [(False, False), (True, False), (True, True)])
def test_by_slot_is_dispatch_gathered_by_slot(ranks, fp8, ue8m0):
    """Zipf skew, an empty rank, alignment 16 (padding rows), both parities."""
    case = Case(4, 16, 256, 4, (9, 0, 13, 6), routing="zipf", alignment=16, seed=31)
    for out in ranks(4).run(jobs.by_slot_against_dispatch, case, fp8, ue8m0):
        assert len(out["slots"]) == 2 and sum(out["slots"]) > 0, out


def test_by_slot_in_rounds_is_refused(ranks):
    case = Case(2, 4, 128, 2, (7, 5), seed=32)
    for msg in ranks(2).run(jobs.by_slot_in_rounds_is_refused, case):
        assert msg.startswith("dispatch_by_slot needs one round; this Buffer runs a call in"), msg
