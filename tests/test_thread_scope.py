"""A rule of the kernels' source that the interpreter cannot check (it runs a program as one
thread, so ``one_thread()`` is always true there): no reduction and no barrier under
``if one_thread():``, directly or through a helper. On a GPU only thread 0 reaches such a
reduction, whose partners never arrive: it returns what thread 0 holds alone (the low-latency
dispatch over NVSHMEM sent such counts to its peers until this rule was kept)."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
# tl calls that need every thread of the program
COLLECTIVE = {"sum", "max", "min", "cumsum", "cumprod", "reduce", "argmax", "argmin", "xor_sum",
              "associative_scan", "debug_barrier", "histogram", "sort", "dot", "gather"}


def _called(node: ast.AST, functions: dict) -> set[str]:
    """``tl.<collective>`` and the kernels' own functions called anywhere in ``node``."""
    out = set()
    for n in ast.walk(node):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                and f.value.id == "tl" and f.attr in COLLECTIVE:
            out.add(f"tl.{f.attr}")
        elif isinstance(f, ast.Name) and f.id in functions:
            out.add(f.id)
    return out


def collective_under_one_thread(sources: dict[str, str]) -> list[str]:
    """``file:line: call (why)`` for every collective reached from the body of an ``if`` whose
    condition calls ``one_thread()``; helpers are followed by name through ``sources``."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    functions = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, []).append(node)
    memo: dict[str, str | None] = {}

    def collective_in(name: str, seen: tuple = ()) -> str | None:
        if name not in memo:
            memo[name] = None
            for fn in functions[name]:
                for c in sorted(_called(fn, functions)):
                    why = c if c.startswith("tl.") else (
                        None if c in seen else collective_in(c, seen + (name,)))
                    if why:
                        memo[name] = why if c == why else f"{c} -> {why}"
                        break
        return memo[name]

    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.If) and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id == "one_thread" for n in ast.walk(node.test))):
                continue
            for stmt in node.body:
                for c in sorted(_called(stmt, functions)):
                    why = c if c.startswith("tl.") else collective_in(c)
                    if why:
                        found.append(f"{name}:{node.lineno}: {c} ({why})")
    return found


def test_no_reduction_or_barrier_under_one_thread():
    sources = {p.name: p.read_text() for p in sorted(KERNELS.glob("*.py"))}
    assert "def one_thread" in sources["comm.py"]
    assert collective_under_one_thread(sources) == []


def test_the_rule_finds_a_reduction_under_one_thread_directly_and_through_a_helper():
    src = '''
def count(v):
    return tl.sum(v)

def kernel(v, out):
    if one_thread():
        tl.store(out, tl.sum(v))
    if (v > 0) & one_thread():
        tl.store(out, count(v))
    if one_thread():
        tl.store(out, 1)
    n = tl.sum(v)
'''
    assert [f.split(" (")[0] for f in collective_under_one_thread({"k.py": src})] == [
        "k.py:6: tl.sum", "k.py:8: count"]
