"""Stopping a run cleanly on a signal: SLURM's pre-emption (SIGTERM, or SIGUSR1 sent ahead
of the time limit with `--signal=USR1@120`) and Ctrl-C (SIGINT).

The first signal only sets a flag; the loop reads it after the step in progress (with
several processes, the flag is summed over ranks with that step's loss, so one that arrives
later in the step is acted on after the next), saves a checkpoint and stops (exit code 0 for SIGTERM and SIGUSR1, so requeue scripts go on; 130
for SIGINT). A second Ctrl-C stops at once: checkpoints are written to a temporary folder
and renamed into place, so stopping mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopSignals:
    """Context manager: while active, STOP_SIGNALS request a stop (`requested`)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers live there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    @property
    def exit_code(self) -> int:
        """What the process should exit with after stopping cleanly."""
        return 130 if self.received == signal.SIGINT else 0
