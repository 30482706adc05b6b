"""Training: the one loop (trainer.py), its step plan (plan.py) and its metrics (metrics.py)."""
