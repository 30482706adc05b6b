"""Evaluation: `unmask eval`'s likelihood scores of files (scores.py) and the
lm-evaluation-harness model `unmask` (harness.py; needs the eval extra, so it is not
imported here)."""
