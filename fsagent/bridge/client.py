"""The bridge client a ``--controller`` option names: :func:`open_client`,
and :func:`client_from_args` for the commands that take ``--controller`` and
``--token-file`` (the interface: :mod:`fsagent.bridge.base`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fsagent.bridge.base import BridgeClient
from fsagent.bridge.directory import DirectoryBridgeClient
from fsagent.bridge.http import HttpBridgeClient
from fsagent.bridge.tls import TransportOptions, check_url, options_from
from fsagent.errors import FsagentError


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


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise FsagentError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise FsagentError(f"token file {path} is empty")
    return token


def client_from_args(args: argparse.Namespace) -> BridgeClient:
    token = read_token(args.token_file)
    if token is None and not args.controller.startswith(("dir:", "file://")):
        raise FsagentError("--token-file is required for an HTTP controller")
    return open_client(
        args.controller, token, retry_deadline=args.retry_deadline, tls=options_from(args)
    )
