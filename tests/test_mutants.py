"""``make mutants`` runs apart from ``make test`` (it takes tens of minutes); what it needs of the
tree is checked here in seconds: every mutation of ``tests/mutants.py`` still finds its line in
the product (a change that moves the line breaks the mutation, not a test) and changes it, and
names test files that exist."""
from __future__ import annotations

import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mutants  # noqa: E402


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutation_applies_to_the_tree(m, tmp_path):
    target = tmp_path / m.path
    target.parent.mkdir(parents=True)
    shutil.copy(os.path.join(mutants.ROOT, m.path), target)
    original = mutants.mutate(str(tmp_path), m)  # SystemExit if the line is gone
    assert target.read_text() != original, m.name
    for test in m.tests:
        assert os.path.exists(os.path.join(mutants.ROOT, test.split("::")[0])), (m.name, test)


def test_the_check_fails_on_a_line_that_is_gone(tmp_path):
    m = mutants.MUTANTS[0]
    gone = mutants.Mutant(m.name, m.promise, m.path, m.old + " (not in the file)", m.new,
                          m.tests)
    (tmp_path / m.path).parent.mkdir(parents=True)
    shutil.copy(os.path.join(mutants.ROOT, m.path), tmp_path / m.path)
    with pytest.raises(SystemExit, match="not in"):
        mutants.mutate(str(tmp_path), gone)
