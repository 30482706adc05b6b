"""The web page's routes of `unmask serve`: the page and its files (open: they hold no
data), GET /api/info (the model, its defaults, the playground's options) and the runs
folder's listing and curves (GET /api/runs, /api/runs/NAME). app.py's `build_app` mounts
them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from unmask.serve import runs_view
from unmask.serve.protocol import RequestError, finite_json

STATIC = Path(__file__).resolve().parent / "static"
#: the page's files (GET /static/NAME), by name, with their media types: a request names
#: one of these, never a path
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".svg": "image/svg+xml"}  # fmt: skip
STATIC_FILES = {
    path.name: MEDIA_TYPES[path.suffix]
    for path in sorted(STATIC.iterdir())
    if path.suffix in MEDIA_TYPES
}
#: the page's icon (also answered at /favicon.ico, where browsers look without a link)
FAVICON = "favicon.svg"


def routes(server, route: Callable) -> list[Route]:
    """The page's routes for `server` (app.Server); `route` wraps a handler with the API key
    check (`open_route`: none) and the error bodies (app.build_app)."""

    async def page(request: Request):
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    async def favicon(request: Request):
        return FileResponse(STATIC / FAVICON, media_type=STATIC_FILES[FAVICON])

    async def static_file(request: Request):
        name = request.path_params["name"]
        kind = STATIC_FILES.get(name)  # names only: the folder's own files, never a path
        if kind is None:
            raise RequestError(404, f"no page file {name!r}")
        return FileResponse(STATIC / name, media_type=kind)

    # a runs folder's files are read off the event loop, and whatever they hold is data:
    # NaN / infinite numbers (a diverged run) are served as null
    async def runs(request: Request):
        if server.runs_dir is None:
            raise RequestError(404, "this server was started without --runs DIR")
        rows = await run_in_threadpool(runs_view.list_runs, server.runs_dir)
        return JSONResponse(finite_json({"runs": rows}))

    async def run_curves(request: Request):
        if server.runs_dir is None:
            raise RequestError(404, "this server was started without --runs DIR")
        name = request.path_params["name"]
        found = await run_in_threadpool(runs_view.run_dir, server.runs_dir, name)
        if found is None:  # names only: never a path from the request
            raise RequestError(404, f"no run named {name!r} in the runs folder")
        return JSONResponse(finite_json(await run_in_threadpool(runs_view.curves, found)))

    async def info(request: Request):
        return JSONResponse({"model": server.model_name, "runs": server.runs_dir is not None,
                             "train": server.training is not None,
                             "defaults": server.sm.saved,
                             "sampling_options": server.sampling_options,
                             "playground": server.playground,
                             "images": server.picture_limits(),
                             "notices": server.notices})  # fmt: skip

    return [
        # the page and its script hold no data: they load without the key, the page asks it
        Route("/", route(page, open_route=True), methods=["GET"]),
        Route("/static/{name}", route(static_file, open_route=True), methods=["GET"]),
        Route("/favicon.ico", route(favicon, open_route=True), methods=["GET"]),
        Route("/api/info", route(info), methods=["GET"]),
        Route("/api/runs", route(runs), methods=["GET"]),
        Route("/api/runs/{name}", route(run_curves), methods=["GET"]),
    ]
