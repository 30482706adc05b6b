"""Evaluation with other tools: the lm-evaluation-harness model `unmask` (harness.py; needs
the eval extra, so it is not imported here)."""
