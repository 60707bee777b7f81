"""How fsagent reaches an HTTP controller: TLS trust and the plain-HTTP rule.

The run token travels in every request, so fsagent speaks plain ``http://``
only to a loopback address (a controller on the same host, tests) unless the
operator passes ``--insecure-http``. ``https://`` is verified against the
system trust store, or only against ``--ca-file`` when one is given.
"""

from __future__ import annotations

import argparse
import ipaddress
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from fsagent.errors import FsagentError

EXIT_INSECURE = 2
"""Exit code for a refused plain-HTTP controller URL (a usage error)."""


class InsecureController(FsagentError):
    """Plain HTTP to a non-loopback controller without ``--insecure-http``."""

    exit_code = EXIT_INSECURE


@dataclass(frozen=True, slots=True)
class TransportOptions:
    ca_file: str | None = None
    """PEM bundle of the CAs to trust instead of the system store."""
    insecure_http: bool = False
    """Allow plain ``http://`` to a non-loopback controller."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ca-file",
        help="PEM file of CA certificates to trust for an https:// controller "
        "(default: the system trust store)",
    )
    parser.add_argument(
        "--insecure-http",
        action="store_true",
        help="allow plain http:// to a controller that is not on a loopback address "
        "(the run token then crosses the network unencrypted)",
    )


def options_from(args: argparse.Namespace) -> TransportOptions:
    return TransportOptions(
        ca_file=getattr(args, "ca_file", None),
        insecure_http=bool(getattr(args, "insecure_http", False)),
    )


def forwarded_argv(options: TransportOptions) -> list[str]:
    """The flags that give a child ``fsagent mount`` the same options."""
    argv = ["--ca-file", options.ca_file] if options.ca_file else []
    return [*argv, "--insecure-http"] if options.insecure_http else argv


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str, options: TransportOptions) -> None:
    """Refuse a controller URL the token must not be sent to."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return
    if parts.scheme != "http" or not parts.hostname:
        raise InsecureController(f"controller URL must be https://HOST[:PORT], got {url!r}")
    if not options.insecure_http and not is_loopback(parts.hostname):
        raise InsecureController(
            f"refusing plain http:// to {parts.hostname}: the run token would travel "
            "unencrypted; use https:// (or --insecure-http)"
        )


def ssl_context(options: TransportOptions) -> ssl.SSLContext:
    """Verification against ``--ca-file`` alone, or else the system trust store."""
    try:
        if options.ca_file:
            return ssl.create_default_context(cafile=options.ca_file)
        return ssl.create_default_context()
    except (OSError, ssl.SSLError) as exc:
        raise FsagentError(f"cannot load --ca-file {options.ca_file}: {exc}") from None


def untrusted_certificate(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The failed certificate verification behind ``exc``, if that is what it is."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
