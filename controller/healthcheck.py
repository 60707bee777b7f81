"""The container image's health probe: ``python -m controller.healthcheck``.

It asks the running ``controller serve`` for ``/readyz`` the way that process
was told to serve: it reads the server's command line (``/proc/PID/cmdline``:
PID 1 in a container, or the first ``controller serve`` process when PID 1 is
some init that started it; ``--pid`` names one), parses it with
``serve``'s own argument parser, and connects to its ``--listen`` address (a wildcard
address becomes loopback) over HTTPS when ``--tls-cert`` is given, plain HTTP
otherwise. Over HTTPS it trusts exactly the configured certificate (it need
not name the loopback address), so the probe also notices a server that
serves some other one.

Exit status 0 when ready; 1 with one line on stderr otherwise (Docker keeps
the probe's output in ``docker inspect``).
"""

from __future__ import annotations

import argparse
import http.client
import os
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ProbeError(Exception):
    pass


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    cert: Path | None
    """The server's ``--tls-cert`` (absolute), or None for plain HTTP."""

    @property
    def url(self) -> str:
        scheme = "https" if self.cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/readyz"


def command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError as exc:
        raise ProbeError(f"cannot read the command line of process {pid}: {exc}") from None
    return [a.decode(errors="surrogateescape") for a in raw.split(b"\0") if a]


def serve_index(argv: list[str]) -> int | None:
    """Where ``serve`` is in ``argv`` if it runs ``controller serve``: the
    ``controller`` script (or ``python -m controller.cli``) with ``serve``
    as its subcommand."""
    for i, arg in enumerate(argv[:-1]):
        program = Path(arg).name == "controller"
        module = arg == "-m" and argv[i + 1] == "controller.cli"
        if program or module:
            at = i + (2 if module else 1)
            return at if argv[at : at + 1] == ["serve"] else None
    return None


def is_serve(argv: list[str]) -> bool:
    return serve_index(argv) is not None


def find_serve() -> int:
    """PID 1 if it is ``controller serve``, else the lowest-numbered process
    that is (PID 1 is an init that started it)."""
    if is_serve(command_line(1)):
        return 1
    for pid in sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if is_serve(command_line(pid)):
                return pid
        except ProbeError:  # gone meanwhile, or not ours to read
            continue
    raise ProbeError("no `controller serve` process runs here")


def serve_arguments(pid: int) -> tuple[list[str], Path]:
    """The arguments of ``serve`` in process ``pid``'s command line, and its
    working directory (a relative ``--tls-cert`` is relative to it)."""
    argv = command_line(pid)
    at = serve_index(argv)
    if at is None:
        raise ProbeError(f"process {pid} is not `controller serve`: {' '.join(argv)[:200]}")
    try:
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:  # not ours to inspect: a container's probe starts in its WORKDIR too
        cwd = Path.cwd()
    return argv[at:], cwd


def target_of(argv: list[str], cwd: Path) -> Target:
    """Where and how ``controller serve argv[1:]`` listens."""
    from controller.cli import build_parser  # serve's own options, defaults and all

    try:
        args, _ = build_parser().parse_known_args(argv)
    except SystemExit:
        raise ProbeError(f"cannot parse the serve command line: {' '.join(argv)[:200]}") from None
    host, sep, port = str(args.listen).rpartition(":")
    if not sep or not port.isdigit():
        raise ProbeError(f"unusable --listen {args.listen!r}")
    host = host.strip("[]")
    host = WILDCARDS.get(host, host)
    cert = None if args.tls_cert is None else cwd / args.tls_cert
    return Target(host, int(port), cert)


def ready(target: Target, timeout: float) -> tuple[int, str]:
    """The status and the start of the body of ``GET /readyz``."""
    conn: http.client.HTTPConnection
    if target.cert is None:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout)
    else:
        ctx = ssl.create_default_context(cafile=str(target.cert))
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the leaf itself is trusted
        ctx.check_hostname = False  # it names the public host, not loopback
        conn = http.client.HTTPSConnection(target.host, target.port, timeout=timeout, context=ctx)
    try:
        conn.request("GET", "/readyz", headers={"User-Agent": "controller-healthcheck"})
        resp = conn.getresponse()
        return resp.status, resp.read(300).decode(errors="replace")
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.healthcheck", description=__doc__)
    parser.add_argument(
        "--pid", type=int, help="the serve process (default: PID 1, else the first one found)"
    )
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default 4)")
    opts = parser.parse_args(argv)
    try:
        pid = find_serve() if opts.pid is None else opts.pid
        target = target_of(*serve_arguments(pid))
        try:
            status, body = ready(target, opts.timeout)
        except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
            raise ProbeError(f"{target.url}: {exc}") from None
    except ProbeError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {target.url} answered {status}: {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
