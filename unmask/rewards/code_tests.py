"""The code reward's runner: a completion's Python code against the record's tests.

Runs only inside a reward worker's call process (unmask/rewards/worker.py loads this file
by path), never in the training process. Standard library only.

A completion whose own code cannot run (a syntax error, an exception at its top level, out of
memory) raises: the worker reports the call as a failure. A test that fails (an assert, or
an exception while the test runs) only lowers the score.
"""

import ast
import builtins
import re
import signal

_FENCE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


class TestTimeout(Exception):
    """A test ran past test_timeout_s."""


def fenced_code(completion: str) -> str:
    """The first ``` fenced block of the completion (unclosed: to the end), else all of it."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


def test_units(tests, entry: str | None, partial: bool) -> tuple[list, list]:
    """(setup, tests): compiled statements run in order; each test counts once. Setup is
    whatever in a source is not a top-level assert (partial scoring only)."""
    sources = [tests] if isinstance(tests, str) else list(tests)
    if not sources or not all(isinstance(s, str) for s in sources):
        raise ValueError("the record's tests must be Python source or a list of sources")
    units = []
    for k, source in enumerate(sources):
        name = f"<test {k}>"
        if partial and isinstance(tests, str):
            for node in ast.parse(source, name).body:
                code = compile(ast.Module([node], []), name, "exec")
                units.append((isinstance(node, ast.Assert), code))
        else:
            units.append((True, compile(source, name, "exec")))
    if entry:
        units.append((True, compile(f"check({entry})", "<check>", "exec")))
    if not any(is_test for is_test, _ in units):
        raise ValueError("the record's tests hold no test")
    return units


def _alarm(signum, frame):
    raise TestTimeout


def run_tests(
    prompt: str,
    completion: str,
    record: dict,
    tests_key: str = "tests",
    entry_key: str = "entry",
    partial: bool = False,
    test_timeout_s: float | None = None,
    extract_code: bool = True,
) -> float:
    """1.0 when every test passes (else 0.0), or the passing fraction with partial."""
    if tests_key not in record:
        raise ValueError(f"the record has no {tests_key!r} (its keys: {sorted(record)})")
    entry = record.get(entry_key)
    units = test_units(record[tests_key], entry, partial)
    code = fenced_code(completion) if extract_code else completion
    namespace = {"__name__": "__solution__", "__builtins__": builtins}
    exec(compile(code, "<completion>", "exec"), namespace)  # raises: the call failed
    if test_timeout_s:
        signal.signal(signal.SIGALRM, _alarm)
    passed = total = 0
    for is_test, unit in units:
        total += is_test
        try:
            if test_timeout_s:
                signal.setitimer(signal.ITIMER_REAL, test_timeout_s)
            exec(unit, namespace)
            passed += is_test
        except MemoryError:
            raise
        except BaseException:  # noqa: B036 - a failed test, whatever the code under test did
            if not partial:
                return 0.0
        finally:
            if test_timeout_s:
                signal.setitimer(signal.ITIMER_REAL, 0)
    return passed / total if partial else 1.0
