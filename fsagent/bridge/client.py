"""The bridge client a ``--controller`` option names: :func:`open_client`
(the interface: :mod:`fsagent.bridge.base`).
"""

from __future__ import annotations

from pathlib import Path

from fsagent.bridge.base import BridgeClient
from fsagent.bridge.directory import DirectoryBridgeClient
from fsagent.bridge.http import HttpBridgeClient
from fsagent.bridge.tls import TransportOptions, check_url


def open_client(
    controller: str,
    token: str | None,
    *,
    retry_deadline: float = 60.0,
    tls: TransportOptions | None = None,
) -> BridgeClient:
    """``dir:PATH`` / ``file://PATH`` → DirectoryBridgeClient; http(s) URL → HttpBridgeClient
    (plain ``http://`` only to loopback unless ``tls.insecure_http``: :mod:`fsagent.bridge.tls`)."""
    if controller.startswith("dir:"):
        return DirectoryBridgeClient(Path(controller[4:]))
    if controller.startswith("file://"):
        return DirectoryBridgeClient(Path(controller[7:]))
    if token is None:
        raise ValueError("a run token is required for an HTTP controller")
    check_url(controller, tls or TransportOptions())
    return HttpBridgeClient(controller, token, retry_deadline=retry_deadline, tls=tls)
