"""The router's own replies: OpenAI-style error bodies, and the marker of a backend that
failed before answering (the router tries the next live one)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web


@dataclass
class Retry:
    """A backend failed before answering: try the next live one, or answer ``error``."""

    error: web.Response


# Statuses that mean "this server can't take requests now", not "this request is bad".
RETRY_STATUS = frozenset({502, 503, 504})


def error_reply(status: int, msg: str) -> web.Response:
    return web.json_response(
        {"error": {"message": msg, "type": "router_error", "code": status}}, status=status
    )


def unauthorized() -> web.Response:
    """401 as OpenAI's API answers a missing or wrong key."""
    return web.json_response(
        {
            "error": {
                "message": "missing or invalid API key: send Authorization: Bearer <key>",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
        status=401,
        headers={"WWW-Authenticate": 'Bearer realm="tiered-cache router"'},
    )


def passthrough_error(status: int, data: bytes, stage: str) -> web.Response:
    try:
        err = json.loads(data)
        msg = err.get("error", {}).get("message") or err.get("message") or str(err)
    except (json.JSONDecodeError, AttributeError):
        msg = data.decode(errors="replace")[:500]
    return error_reply(status if status < 500 else 502, f"{stage} server error ({status}): {msg}")
