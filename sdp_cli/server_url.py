"""What makes a string a usable inference-server URL, for ``engine.urls`` and ``recompute
--server``: checked before any connection attempt, so a typo costs no retries. Torch-free."""

from __future__ import annotations

from urllib.parse import urlsplit

from sdp_cli.redact import redact_urls


def server_url_problem(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL with a host and a valid port (credentials masked in
    the reason), or None."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        return redact_urls(str(err))
    if parts.scheme not in ("http", "https"):
        return "no http:// or https:// scheme"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    if parts.query or parts.fragment:
        return "a query or fragment"
    return None
