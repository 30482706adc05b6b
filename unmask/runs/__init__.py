"""Run folders read back: what a run wrote (metrics.jsonl, config.yaml, checkpoints, held-out
results) as tables (`unmask runs`, the end-of-run summary), the Runs page's data
(serve/runs_view.py) and plots (`unmask plot`, a run's plots/). Below the trainer, the
server and the CLI, which all read runs through it; it imports no training code."""
