"""RewardSet: score completions with every configured reward, user code in worker processes.

`RewardSet(specs)(prompts, completions, records)` gives each reward's scores, their weighted
total and the calls that failed (scored 0, counted and described in one line each);
`check(records)` refuses, before training, a reward that cannot be imported, raises or
returns no number (docs/rewards.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from unmask.errors import InputError, did_you_mean
from unmask.rewards.builtin import IN_PROCESS, RecordError, reference_answer, reference_key
from unmask.rewards.code_tests import test_units
from unmask.rewards.sandbox import MAX_ABS_REWARD, Worker, WorkerError
from unmask.rewards.spec import RewardSpec

#: records check() calls each reward on
CHECK_RECORDS = 2


@dataclass
class RewardScores:
    """The scores of N completions."""

    total: torch.Tensor
    """(N,) float32: the weighted sum of the rewards."""
    per_reward: dict[str, torch.Tensor]
    """Each reward's (N,) float32 scores, unweighted, by name."""
    failures: dict[str, int] = field(default_factory=dict)
    """Per reward: calls that were stopped, raised or returned no number (scored 0)."""
    failure_lines: list[str] = field(default_factory=list)
    """One line per failed call (or per reward whose worker could not run), for the log."""


class RewardSet:
    """The configured rewards; a context manager that stops its workers on exit."""

    def __init__(self, specs: list[RewardSpec]):
        self.specs = list(specs)
        self.names = [spec.label for spec in self.specs]
        self._workers: dict[int, Worker] = {}

    # --- scoring --------------------------------------------------------------------------

    def __call__(
        self, prompts: list[str], completions: list[str], records: list[dict]
    ) -> RewardScores:
        n = len(completions)
        if not len(prompts) == len(records) == n:
            raise ValueError(f"{len(prompts)} prompts, {n} completions, {len(records)} records")
        items = list(zip(prompts, completions, records))
        lines: list[str] = []
        outcomes: dict[int, list[list]] = {}
        started: list[int] = []
        for i, spec in enumerate(self.specs):  # the workers run while this process scores
            if spec.runs_user_code:
                try:
                    self._worker(i).submit(items)
                    started.append(i)
                except WorkerError as err:
                    outcomes[i] = [[None, None]] * n
                    lines.append(f"reward '{spec.label}': its worker could not start "
                                 f"({err.message}); all {n} completions scored 0")  # fmt: skip
        for i, spec in enumerate(self.specs):
            if not spec.runs_user_code:
                outcomes[i] = [self._in_process(spec, item) for item in items]
        for i in started:
            outcomes[i] = self._workers[i].collect()
        per_reward, failures = {}, {}
        total = torch.zeros(n, dtype=torch.float32)
        for i, spec in enumerate(self.specs):
            scores = torch.zeros(n, dtype=torch.float32)
            failures[spec.label] = 0
            for j, (score, error) in enumerate(outcomes[i]):
                if score is None:
                    failures[spec.label] += 1
                    if error is not None:
                        lines.append(f"reward '{spec.label}' on completion {j}: {error}; scored 0")
                else:
                    scores[j] = score
            per_reward[spec.label] = scores
            total += spec.weight * scores
        return RewardScores(total, per_reward, failures, lines)

    @staticmethod
    def _in_process(spec: RewardSpec, item: tuple) -> list:
        _, completion, record = item
        try:
            return [IN_PROCESS[spec.fn](completion, record, spec.options), None]
        except RecordError as err:
            return [None, str(err)]

    def _worker(self, i: int) -> Worker:
        spec = self.specs[i]
        worker = self._workers.get(i)
        if worker is None:
            target = "builtin:code" if spec.fn == "code" else spec.fn
            worker = Worker(target, timeout_s=spec.timeout_s, memory_mb=spec.memory_mb,
                            parallel=spec.parallel_calls, network=spec.network, env=spec.env,
                            options=spec.options if spec.builtin else {})  # fmt: skip
            self._workers[i] = worker
        if not worker.alive:
            worker.start()
        return worker

    def worker_pids(self) -> dict[str, int]:
        """The running workers' process ids, by reward name."""
        return {self.specs[i].label: w.pid for i, w in self._workers.items() if w.alive}

    def write_guarded(self) -> dict[str, bool]:
        """Per running worker: whether file-system changes are confined to its folder."""
        return {self.specs[i].label: w.write_guard for i, w in self._workers.items() if w.alive}

    def guards(self) -> dict[str, dict]:
        """Per running worker: which of its guards hold (docs/rewards.md, What the sandbox
        is), by name, and "why" those that do not."""
        return {self.specs[i].label: dict(w.guards) for i, w in self._workers.items() if w.alive}

    # --- checks before training -----------------------------------------------------------

    def check(self, records: list[dict]) -> None:
        """Import every user function in its worker and call each reward on the first
        records, with the record's reference answer (REFERENCE_KEYS) as the completion, or ""
        when it has none; InputError with one line for the first problem."""
        sample = list(records[:CHECK_RECORDS])
        for i, spec in enumerate(self.specs):
            where = f"rewards[{i}]"
            if spec.fn in ("exact_match", "numeric_match"):
                self._check_references(spec, where, sample)
            if spec.fn == "code":
                self._check_tests(spec, where, sample)
            if spec.runs_user_code:
                try:
                    worker = self._worker(i)
                except WorkerError as err:
                    raise InputError(_start_error(spec, where, err)) from None
                self._check_calls(spec, where, worker, sample)

    @staticmethod
    def _check_references(spec: RewardSpec, where: str, sample: list[dict]) -> None:
        for k, record in enumerate(sample):
            try:
                answer = reference_answer(record, spec.options.get("answer_key"))
                IN_PROCESS[spec.fn](answer, record, spec.options)
            except RecordError as err:
                key = spec.options.get("answer_key")
                fix = (f"give records a '{key}'" if key else
                       f"give records an 'answer', or set {where}.options.answer_key")  # fmt: skip
                raise InputError(f"{where} ({spec.fn}): record {k}: {err}: {fix}") from None

    @staticmethod
    def _check_tests(spec: RewardSpec, where: str, sample: list[dict]) -> None:
        key, entry_key = spec.options["tests_key"], spec.options["entry_key"]
        for k, record in enumerate(sample):
            if key not in record:
                raise InputError(
                    f"{where} (code): record {k} has no '{key}' (its keys: {sorted(record)}): "
                    f"give records their tests, or set {where}.options.tests_key"
                )
            try:
                test_units(record[key], record.get(entry_key), spec.options["partial"])
            except (SyntaxError, ValueError) as err:
                what = f"{type(err).__name__}: {err}" if isinstance(err, SyntaxError) else err
                raise InputError(f"{where} (code): record {k}'s '{key}': {what}") from None

    @staticmethod
    def _check_calls(spec: RewardSpec, where: str, worker: Worker, sample: list[dict]) -> None:
        items, used = [], []
        for record in sample:
            key = None if spec.fn == "code" else reference_key(record)
            prompt = record.get("prompt")
            items.append((prompt if isinstance(prompt, str) else "", record.get(key, ""), record))
            used.append(f"its '{key}'" if key else "an empty string")
        worker.submit(items)
        for k, (score, error) in enumerate(worker.collect()):
            if score is None:
                name = "the code reward" if spec.fn == "code" else f"'{spec.fn}'"
                raise InputError(f"{where}.fn: {name} {error} on record {k} (called with "
                                 f"{used[k]} as the completion){_fix(where, error)}")  # fmt: skip

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (their temporary folders go with them)."""
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_error(spec: RewardSpec, where: str, err: WorkerError) -> str:
    module, _, attribute = spec.fn.partition(":")
    if err.kind == "module_missing":
        return (f"{where}.fn: cannot import module '{module}' ({err.message}): check that "
                f"module '{module}' is importable from the directory you run unmask in "
                f"({os.getcwd()}) or from PYTHONPATH")  # fmt: skip
    if err.kind == "import_raised":
        fix = f"raise {where}.memory_mb" if err.message.startswith("MemoryError") else "fix it"
        return f"{where}.fn: importing module '{module}' raised {err.message}: {fix}"
    if err.kind == "attribute_missing":
        hint = did_you_mean(err.message, err.names, prefix=f"{module}:")
        return (f"{where}.fn: module '{module}' has no '{err.message}'{hint}: name a function "
                f"the module defines")  # fmt: skip
    if err.kind == "not_callable":
        return (f"{where}.fn: '{spec.fn}' is a {err.message}, not a function: name a "
                f"function fn(prompt, completion, record) -> float")  # fmt: skip
    return f"{where}.fn: could not load '{spec.fn}': {err.message}"


def _fix(where: str, error: str) -> str:
    if "beyond the reward limit" in error:
        return f": keep rewards within ±{MAX_ABS_REWARD:g} (rescale them)"
    if error.startswith("returned"):
        return ": return a float (an int or a bool also works)"
    if error.startswith("raised"):
        return ": a reward must return a number for any completion (catch what can fail)"
    if error.startswith("timed out"):
        return f": make it faster or raise {where}.timeout_s"
    if error.startswith("ran out of memory"):
        return f": raise {where}.memory_mb"
    return ""
