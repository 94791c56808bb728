"""Security headers for the browser chat page and its static files.

The page runs the user's API key (typed in or passed as ``?api_key=``) and renders model
output, so it gets the headers a browser needs to keep other sites out of it:

- ``Content-Security-Policy``: scripts, styles and connections only from this origin
  (CSP 3 ``'self'`` covers ``ws:``/``wss:`` to the same host, which the page's WebSocket
  uses); no inline script, no plugins, no ``<base>`` rewriting; ``frame-ancestors 'none'``
  so no other page can frame it (clickjacking);
- ``X-Frame-Options: DENY`` for browsers that predate ``frame-ancestors``;
- ``X-Content-Type-Options: nosniff`` so a file is never run as a type it was not sent as;
- ``Referrer-Policy: no-referrer`` so a ``?api_key=`` in the page's URL never leaves it.

API responses are JSON or SSE that no browser renders, and keep their headers as they are.
"""

from __future__ import annotations

from flask import Flask, Response, request

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# The chat page (``web.ws``'s ``page`` blueprint) and Flask's static file route.
PAGE_ENDPOINTS = frozenset({"chat_page.chat_page", "static"})


def add_page_headers(response: Response) -> Response:
    """``after_request`` hook: the headers above on the page and its static files."""
    if request.endpoint in PAGE_ENDPOINTS:
        for name, value in PAGE_HEADERS.items():
            response.headers.setdefault(name, value)
    return response


def register(app: Flask) -> None:
    app.after_request(add_page_headers)
