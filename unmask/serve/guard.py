"""What `unmask serve` checks of every request before a route sees it, and the headers it
adds to every response (docs/serving.md, Security).

A browser lets any page the user visits send requests to a server on 127.0.0.1: a form or
a `fetch` in no-cors mode can POST `text/plain`, and a DNS-rebinding name (one that first
resolves to the attacker's host, then to 127.0.0.1) makes the page same-origin in the
browser's eyes. So:
  - the Host header must name this server (`allowed_hosts`: the bound address and the
    loopback names by default): a rebinding page's requests carry its own name;
  - a request with an Origin header must come from the page itself (same scheme, host and
    port) or from an origin the user granted (`--cors-origin`);
  - a POST must say `Content-Type: application/json`, which a cross-site page cannot send
    without a CORS preflight, and a preflight is granted to configured origins only;
  - every response forbids inline script, framing and MIME sniffing (a Content-Security-
    Policy: the page's data is drawn as text, and an injected element could run nothing).
Refusals are OpenAI's error body with a 4xx status, as every other error of the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers

#: what the page may load: its own script and style, data from its own origin; nothing inline
#: (img-src blob:: a chart's PNG export draws the chart's own SVG, made a blob, on a canvas)
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
#: the names every server answers to, whatever address it is bound to
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
METHODS = "GET, POST, OPTIONS"


def host_name(host: str) -> str:
    """The name of a Host header or address without its port, lowercase: "[::1]:8000" ->
    "::1", "LocalHost.:80" -> "localhost"."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def allowed_host_names(
    bound: str, extra: list[str] | tuple[str, ...] = ()
) -> frozenset[str] | None:
    """The Host names a server bound to `bound` answers: the loopback names, the bound
    address and `extra` (--allowed-host). None (any) on a wildcard bind (0.0.0.0, ::)
    without extra names: every name that reaches such a server is legitimate, and the API
    key it must have (server.py) is what guards it."""
    bound = host_name(bound)
    if bound in WILDCARD_ADDRESSES and not extra:
        return None
    names = {*LOOPBACK_NAMES, *(host_name(name) for name in extra)}
    if bound not in WILDCARD_ADDRESSES:
        names.add(bound)
    return frozenset(names)


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Guard:
    """ASGI middleware: the checks of the module doc, then the app; the security headers
    (and a CORS grant for a configured origin) on every response. `count(outcome)` is
    told of each refusal (the server's /metrics)."""

    def __init__(self, app, allowed_hosts: frozenset[str] | None, cors_origins: frozenset[str],
                 count: Callable[[str], None] = lambda outcome: None):  # fmt: skip
        self.app, self.allowed_hosts, self.cors_origins = app, allowed_hosts, cors_origins
        self.count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        granted = origin if origin is not None and origin in self.cors_origins else None
        extra = list(SECURITY_HEADERS)
        if granted is not None:
            extra += [(b"access-control-allow-origin", granted.encode("latin-1")),
                      (b"vary", b"Origin")]  # fmt: skip
        refusal = self.refusal(scope, headers, origin, granted)
        if refusal is not None:
            status, body, more = refusal
            await self._respond(send, status, body, extra + more)
            return

        async def send_guarded(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_guarded)

    def refusal(self, scope, headers: Headers, origin: str | None, granted: str | None
                ) -> tuple[int, dict | None, list] | None:  # fmt: skip
        """(status, body or None, headers) of a request refused here, else None."""
        host = headers.get("host", "")
        if self.allowed_hosts is not None and host_name(host) not in self.allowed_hosts:
            self.count("http_400")
            return 400, error_body(
                f"the Host header {host!r} does not name this server; start it with "
                "--allowed-host NAME to answer to that name", code="invalid_host"), []  # fmt: skip
        method = scope["method"]
        if method == "OPTIONS":  # a CORS preflight (or a client asking what is allowed)
            grant = [(b"allow", METHODS.encode())]
            if granted is not None:
                grant += [(b"access-control-allow-methods", METHODS.encode()),
                          (b"access-control-allow-headers", b"Authorization, Content-Type"),
                          (b"access-control-max-age", b"600")]  # fmt: skip
            return 204, None, grant
        if origin is not None and granted is None and origin != f"{scope['scheme']}://{host}":
            self.count("http_403")
            return 403, error_body(
                f"a request from the web origin {origin!r} is refused (not this server's "
                f"page); start the server with --cors-origin {origin} to allow it",
                code="cross_origin"), []  # fmt: skip
        if method == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                self.count("http_415")
                return 415, error_body(
                    f"a POST body must be JSON with Content-Type: application/json (got "
                    f"{media or 'none'!r})", code="unsupported_media_type"), []  # fmt: skip
        return None

    @staticmethod
    async def _respond(send, status: int, body: dict | None, headers: list) -> None:
        content = b"" if body is None else json.dumps(body).encode()
        fields = [*headers, (b"content-length", str(len(content)).encode())]
        if body is not None:
            fields.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": fields})
        await send({"type": "http.response.body", "body": content})
