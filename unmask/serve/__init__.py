"""`unmask serve`: an OpenAI-compatible HTTP server for a trained model, with continuous
batching at block boundaries (engine.py), the OpenAI routes (app.py), the checks every
request passes first (guard.py) and a web page that shows the canvas unmasking and the runs
of a folder (static/, runs_view.py). docs/serving.md.

Names are imported when first used: the CLI reads protocol.Limits' defaults without loading
starlette and uvicorn (the serve extra)."""

import importlib

_WHERE = {
    "Server": "app",
    "build_app": "app",
    "metrics_text": "app",
    "Draining": "engine",
    "Engine": "engine",
    "Job": "engine",
    "QueueFull": "engine",
    "run_server": "server",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'unmask.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"unmask.serve.{_WHERE[name]}"), name)
