"""`unmask serve`: an OpenAI-compatible HTTP server for a trained model, with continuous
batching at block boundaries (engine.py), the OpenAI routes (app.py) and a web page that
shows the canvas unmasking and the runs of a folder (static/, runs_view.py).
docs/serving.md."""

from unmask.serve.app import Server, build_app, metrics_text
from unmask.serve.engine import Draining, Engine, Job, QueueFull
from unmask.serve.server import run_server

__all__ = [
    "Draining",
    "Engine",
    "Job",
    "QueueFull",
    "Server",
    "build_app",
    "metrics_text",
    "run_server",
]
