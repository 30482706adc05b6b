"""Training output that is not a terminal (a file, a pipe, CI): no tqdm bar, and a plain
progress line whenever no line was printed for PROGRESS_SECONDS (train/metrics.py)."""

import time

from unmask.train.metrics import PROGRESS_SECONDS, MetricsLogger


def test_progress_lines_between_log_lines_when_output_is_not_a_terminal(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=100, show_progress=True)
    assert logger.bar is None and PROGRESS_SECONDS == 30.0  # pytest's stderr: not a tty
    logger.advance(1, {"loss": "2.000"})
    assert capsys.readouterr().out == ""  # within PROGRESS_SECONDS of the start: quiet
    logger.progress_seconds = 0.05
    time.sleep(0.06)
    logger.advance(2, {"loss": "1.500"})
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 2/100 | loss 1.500 | eta ")
    logger.log(3, {"loss": 1.25})  # a log line restarts the quiet time
    logger.advance(3)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("step 3/100 | loss 1.2500")
    logger.close()
    (tmp_path / "quiet").mkdir()
    silent = MetricsLogger(tmp_path / "quiet", total_steps=10, show_progress=False)
    silent.progress_seconds = 0.0
    silent.advance(1, {"loss": "1.0"})
    assert capsys.readouterr().out == ""  # train.disable_tqdm: no progress at all
    silent.close()
