"""Evaluation of a saved model, the work behind `unmask eval`: likelihood scores of a file
(scores.py: `score_file`), lm-eval tasks with a preset (evaluate.py: `evaluate_tasks`, with
presets.py and tasks.py) and the lm-evaluation-harness model `unmask` (harness.py). The
held-out exact match at the end of training is sampling.accuracy's. harness.py and
evaluate.py need the eval extra (lm-eval), so neither is imported here."""
