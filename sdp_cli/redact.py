"""Credentials out of everything sdp prints or stores (docs/reliability.md, "Security defaults").

A URL may carry ``user:password@`` (``engine.urls=[http://user:pw@host:8000]``); sdp uses it to
connect but writes it only as ``user:***@`` (a lone ``token@`` becomes ``***@``): in error
lines, events, overrides.json and config.yaml. Torch-free.
"""

from __future__ import annotations

import ipaddress
import re

#: scheme://userinfo@ — the userinfo has no "/", "@" or whitespace
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]*)(?P<password>:[^/@\s]*)?@")
MASK = "***"


def redact_urls(text: str) -> str:
    """``text`` with the credentials of every URL in it masked."""

    def mask(match: re.Match[str]) -> str:
        if match.group("password") is None:
            return f"{match.group('scheme')}{MASK}@"
        return f"{match.group('scheme')}{match.group('user')}:{MASK}@"

    return _USERINFO.sub(mask, text)


def is_redacted(text: str) -> bool:
    """Whether ``text`` holds a URL whose credentials were masked (so it cannot be used)."""
    return f"{MASK}@" in text


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps a server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
