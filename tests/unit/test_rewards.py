"""The rewards that run in the training process (exact_match, numeric_match, format), the
`rewards:` parser's one-line errors, and the code reward's runner on harmless code (the
sandboxed runs are in tests/integration/test_reward_sandbox.py)."""

from fractions import Fraction
from pathlib import Path

import pytest

from unmask.errors import InputError
from unmask.rewards import RewardSet, extract_number, parse_rewards
from unmask.rewards.builtin import RecordError, exact_match, format_match, numeric_match
from unmask.rewards.code_tests import fenced_code, run_tests
from unmask.rewards.sandbox import (
    PASSED_ENV,
    checked_result,
    left_open,
    notice_line,
    worker_environment,
)

# --- numeric_match ------------------------------------------------------------------------

EXTRACTIONS = [
    # GSM8K: the number after the last ####, whatever follows
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72),
    ("#### 72\nThe end: 5", 72),
    ("#### 1,234", 1234),
    ("#### -3", -3),
    # \boxed{}: fractions, LaTeX fractions, signs, units, nested braces
    ("so \\boxed{3/4}", Fraction(3, 4)),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
    ("\\boxed{\\tfrac34}", Fraction(3, 4)),
    ("\\boxed{-\\dfrac{1}{2}}", Fraction(-1, 2)),
    ("\\boxed{\\$1,000}", 1000),
    ("\\boxed{12} and later 13", 12),
    ("\\boxed{\\frac{x}{2}} so 7", 2),  # not a fraction of numbers: the box's first number
    # a text that is one fraction
    ("3/4", Fraction(3, 4)),
    ("$-1/2$.", Fraction(-1, 2)),
    # otherwise the last number in the text
    ("the ratio is 3/4", 4),
    ("The answer is 1,234.", 1234),
    ("She has -5 apples", -5),
    ("3-5 = -2", -2),
    ("It costs $18.50 in total", Fraction(37, 2)),
    ("first 42. then 43", 43),
    ("12.5.", Fraction(25, 2)),
    ("about .5 of it", Fraction(1, 2)),
    ("v2 is 7", 7),  # a digit inside a word is not a number
    ("1,23", 23),  # not a thousands separator: two numbers
    ("no number here", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "number"), EXTRACTIONS)
def test_extract_number(text, number):
    assert extract_number(text) == number


def test_numeric_match_compares_final_numbers():
    gsm8k = {"answer": "She pays 3 * 24 = 72 dollars.\n#### 72"}
    assert numeric_match("So the answer is 72.", gsm8k, {}) == 1.0
    assert numeric_match("#### 72.0", gsm8k, {}) == 1.0
    assert numeric_match("So the answer is 71.", gsm8k, {}) == 0.0
    assert numeric_match("I don't know", gsm8k, {}) == 0.0
    assert numeric_match("\\boxed{0.75}", {"answer": "\\boxed{\\frac34}"}, {}) == 1.0
    assert numeric_match("\\boxed{0.75}", {"target": "3/4"}, {}) == 1.0
    assert numeric_match("0.333", {"answer": "1/3"}, {}) == 0.0
    assert numeric_match("0.333", {"answer": "\\boxed{1/3}"}, {"tolerance": 1e-3}) == 1.0
    assert numeric_match("7", {"label": "7", "answer": "8"}, {"answer_key": "label"}) == 1.0
    with pytest.raises(RecordError, match=r"the reference answer 'none' holds no number"):
        numeric_match("7", {"answer": "none"}, {})
    with pytest.raises(RecordError, match=r"no reference answer \(one of answer, target"):
        numeric_match("7", {"prompt": "x"}, {})


def test_exact_match_and_format():
    assert exact_match(" 321\n", {"answer": "321"}, {}) == 1.0
    assert exact_match("3210", {"answer": "321"}, {}) == 0.0
    assert exact_match("ABC", {"response": "abc"}, {"ignore_case": True}) == 1.0
    assert exact_match("ABC", {"response": "abc"}, {}) == 0.0
    tagged = {"pattern": r"<think>.*</think>\s*<answer>.*</answer>"}
    ok = "<think>a\nb</think>\n<answer>4</answer>\n"
    assert format_match(ok, {}, tagged) == 1.0
    assert format_match("x " + ok, {}, tagged) == 0.0
    assert format_match("x " + ok, {}, {**tagged, "match": "search"}) == 1.0
    assert format_match(ok, {}, {**tagged, "dotall": False}) == 0.0


def test_in_process_rewards_total_and_missing_answers():
    specs = parse_rewards(
        [{"fn": "exact_match", "weight": 0.5}, "numeric_match",
         {"fn": "format", "weight": -1, "options": {"pattern": r"\d+"}}]
    )  # fmt: skip
    with RewardSet(specs) as rewards:
        scores = rewards(["p"] * 3, ["72", "#### 72 dollars", "9"],
                         [{"answer": "72"}, {"answer": "72"}, {"prompt": "no answer"}])  # fmt: skip
    assert rewards.names == ["exact_match", "numeric_match", "format"]
    assert scores.per_reward["exact_match"].tolist() == [1.0, 0.0, 0.0]
    assert scores.per_reward["numeric_match"].tolist() == [1.0, 1.0, 0.0]
    assert scores.per_reward["format"].tolist() == [1.0, 0.0, 1.0]
    assert scores.total.tolist() == [0.5, 1.0, -1.0]
    assert scores.failures == {"exact_match": 1, "numeric_match": 1, "format": 0}
    assert scores.failure_lines[0].startswith(
        "reward 'exact_match' on completion 2: the record has no reference answer (one of "
    )
    assert scores.failure_lines[0].endswith("it has ['prompt']); scored 0")


def test_check_refuses_records_without_reference_or_number():
    with pytest.raises(InputError) as err:
        RewardSet(parse_rewards(["numeric_match"])).check([{"prompt": "p", "answer": "n/a"}])
    assert str(err.value) == (
        "rewards[0] (numeric_match): record 0: the reference answer 'n/a' holds no number: "
        "give records an 'answer', or set rewards[0].options.answer_key"
    )
    specs = parse_rewards([{"fn": "format", "options": {"pattern": "x"}}, "exact_match"])
    with pytest.raises(InputError, match=r"^rewards\[1\] \(exact_match\): record 1: the record "):
        RewardSet(specs).check([{"answer": "a"}, {"prompt": "p"}])
    RewardSet(parse_rewards(["exact_match"])).check([{"answer": "a"}])  # fine: no error


# --- parse_rewards ------------------------------------------------------------------------


def test_parse_rewards_forms():
    specs = parse_rewards(
        [{"fn": "my_rewards:score", "weight": 0.5, "timeout_s": 2},
         "numeric_match", {"fn": "code", "options": {"partial": True}},
         {"fn": "pkg.mod:Scorer.score", "name": "scorer"}]
    )  # fmt: skip
    assert [s.label for s in specs] == ["score", "numeric_match", "code", "scorer"]
    assert [s.weight for s in specs] == [0.5, 1.0, 1.0, 1.0]
    assert specs[0].timeout_s == 2.0 and specs[0].memory_mb == 1024
    assert specs[2].options["partial"] is True and specs[2].options["tests_key"] == "tests"
    assert [s.runs_user_code for s in specs] == [True, False, True, True]
    assert specs[0].network is False and specs[0].env == []  # no network, no extra variables
    judge = parse_rewards([{"fn": "j:score", "network": True, "env": ["OPENAI_API_KEY"]}])[0]
    assert judge.network is True and judge.env == ["OPENAI_API_KEY"]
    assert parse_rewards(None) == []


BAD = [
    ({"fn": "numeric_mach"},
     "rewards[0].fn: 'numeric_mach' is neither a built-in reward (exact_match, numeric_match, "
     "format, code) (did you mean 'numeric_match'?) nor module:function (e.g. "
     "my_rewards:score)"),
    ({"fn": "my rewards.py:score"},
     "rewards[0].fn: 'my rewards.py:score' is neither a built-in reward (exact_match, "
     "numeric_match, format, code) nor module:function (e.g. my_rewards:score)"),
    ({"fn": "m:f", "weigth": 1}, "unknown config key 'rewards[0].weigth' (did you mean 'weight'?)"),
    ({"fn": "m:f", "netwrok": True},
     "unknown config key 'rewards[0].netwrok' (did you mean 'network'?)"),
    ({"fn": "m:f", "timeout_s": 0},
     "bad value for config key 'rewards[0].timeout_s': must be > 0 (got 0)"),
    ({"fn": "m:f", "weight": float("nan")},
     "bad value for config key 'rewards[0].weight': must be a finite number (got nan)"),
    ({"weight": 1}, "bad value for config key 'rewards[0].fn': Field required"),
    ({"fn": "format"}, "bad value for config key 'rewards[0].options.pattern': Field required"),
    ({"fn": "format", "options": {"pattern": "("}},
     "bad value for config key 'rewards[0].options.pattern': not a valid regular expression "
     "(missing ), unterminated subpattern at position 0) (got '(')"),
    ({"fn": "code", "options": {"partail": True}},
     "unknown config key 'rewards[0].options.partail' (did you mean 'partial'?)"),
    ({"fn": "m:f", "options": {"a": 1}},
     "rewards[0].options: options are for built-in rewards; a user function is called as "
     "fn(prompt, completion, record): remove options or read them from the record"),
    (3, "rewards[0] must be a mapping like {fn: numeric_match, weight: 1.0}, got int 3"),
]  # fmt: skip


@pytest.mark.parametrize(("item", "message"), BAD)
def test_parse_rewards_errors_are_one_line(item, message):
    with pytest.raises(InputError) as err:
        parse_rewards([item])
    assert str(err.value) == message


def test_parse_rewards_refuses_a_non_list_and_twin_names():
    with pytest.raises(InputError, match=r"^rewards must be a list like \[\{fn: numeric_match"):
        parse_rewards({"fn": "numeric_match"})
    with pytest.raises(InputError) as err:
        parse_rewards(["numeric_match", {"fn": "a:score"}, {"fn": "b:score"}])
    assert str(err.value) == (
        "rewards[2] and rewards[1] are both named 'score': give one of them a `name:`"
    )
    assert [s.label for s in parse_rewards([{"fn": "a:score"}, {"fn": "b:score", "name": "b"}])]


# --- the code reward's runner (harmless code; the sandbox is tested elsewhere) -----------


def test_fenced_code():
    assert fenced_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == (
        "def f():\n    return 1\n"
    )
    assert fenced_code("```\nx = 1\n") == "x = 1\n"  # unclosed: to the end
    assert fenced_code("x = 1") == "x = 1"


def test_run_tests_scores():
    record = {"tests": "assert f(1) == 1\nassert f(2) == 3\nassert f(3) == 3"}
    assert run_tests("", "def f(x):\n    return x", record) == 0.0
    assert run_tests("", "def f(x):\n    return x", record, partial=True) == pytest.approx(2 / 3)
    assert (
        run_tests("", "```python\ndef f(x):\n    return x\n```", {"tests": ["assert f(1) == 1"]})
        == 1.0
    )
    listed = {"tests": ["assert f(1) == 1", "assert f(2) == 3", "assert g(2)"]}
    assert run_tests("", "def f(x):\n    return x", listed, partial=True) == pytest.approx(1 / 3)
    humaneval = {"tests": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
                 "entry": "add"}  # fmt: skip
    assert run_tests("", "def add(a, b):\n    return a + b", humaneval) == 1.0
    assert run_tests("", "def add(a, b):\n    return a - b", humaneval) == 0.0
    assert run_tests("", "def plus(a, b):\n    return a + b", humaneval) == 0.0
    with pytest.raises(SyntaxError):  # the completion's own code cannot run: a failure
        run_tests("", "def add(a, b) return a + b", humaneval)
    with pytest.raises(ValueError, match=r"the record has no 'tests' \(its keys: \['entry'\]\)"):
        run_tests("", "", {"entry": "add"})


# --- what the training process takes from a reward worker ---------------------------------


def test_worker_results_are_checked_again_in_the_training_process():
    assert checked_result([0.5, None]) == [0.5, None]
    assert checked_result([3, None]) == [3.0, None]
    assert checked_result([-1e6, None]) == [-1e6, None]
    assert checked_result([None, "timed out"]) == [None, "timed out"]
    limit = "beyond the reward limit of ±1e+06"
    assert checked_result([1e39, None]) == [None, f"returned 1e+39, {limit}"]
    assert checked_result([float("nan"), None]) == [None, "returned nan, not a finite number"]
    malformed = [None, "the reward worker sent a malformed result"]
    for result in (["1.0", None], [True, None], [1.0, "x"], [None, None], {"score": 1}, [1.0]):
        assert checked_result(result) == malformed


def test_worker_environment_is_an_allow_list(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    env = worker_environment("/tmp/w", ["OPENAI_API_KEY"])
    assert env["HOME"] == env["TMPDIR"] == "/tmp/w"
    assert env["PATH"] == "/usr/bin:/bin" and env["LC_ALL"] == "C.UTF-8"
    assert env["OPENAI_API_KEY"] == "sk-secret"  # named by the reward's `env:`
    assert "HF_TOKEN" not in env
    assert set(env) - {"HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "OPENAI_API_KEY"} <= (
        set(PASSED_ENV) | {k for k in env if k.startswith("LC_")}
    )


def test_left_open_names_what_missing_guards_allow():
    held = {"write_guard": True, "network_namespace": True, "pid_namespace": True,
            "own_proc": True, "call_namespaces": True, "process_limit": True}  # fmt: skip
    assert left_open(held, network=False) == []
    assert left_open({}, network=False)[:2] == [
        "change files outside its folder",
        "use the network",
    ]
    assert left_open({}, network=True) == [
        "change files outside its folder",
        "see and signal your other processes (the trainer too)",
        "read your other processes' environment in /proc",
        "leave processes behind that start their own session",
        "start processes without limit",
    ]
    fallback = {"write_guard": True, "tcp_blocked": True, "signals_scoped": True}
    assert left_open(fallback, network=False) == [
        "use the network but TCP (UDP, for one)",
        "read your other processes' environment in /proc",
        "leave processes behind that start their own session",
        "start processes without limit",
    ]


def test_the_notice_in_the_docs_is_the_one_printed():
    """docs/rewards.md's example: a user without user namespaces, on Linux 6.12 or later."""
    guards = {"write_guard": True, "tcp_blocked": True, "signals_scoped": True,
              "why": ["namespaces: unshare: Operation not permitted"]}  # fmt: skip
    line = notice_line(guards, network=False)
    assert line.startswith("unmask: reward workers run with fewer guards here (namespaces: ")
    assert line in (Path(__file__).parents[2] / "docs" / "rewards.md").read_text()
    every = {name: True for name in ("write_guard", "network_namespace", "pid_namespace",
                                     "own_proc", "call_namespaces", "process_limit")}  # fmt: skip
    assert notice_line(every, network=False) is None
