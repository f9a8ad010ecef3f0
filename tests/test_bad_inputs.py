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
        assert len(found) == 35, (rank, sorted(found))
