"""The bridge client: how fsagent reads its run, manifests and objects and
saves checkpoints.

One interface (:class:`BridgeClient`: the read side and the write side) with
implementations side by side, so the filesystem, the shipper and warm start
can be tested and benchmarked without a controller:

* :class:`HttpBridgeClient` talks to the controller's ``/bridge/v1`` routes
  (:mod:`common.bridge`) with the run token, retrying transient failures
  (honouring ``Retry-After`` on 429 and 503, at most :data:`RETRY_AFTER_MAX`).
* :class:`DirectoryBridgeClient` serves a run, manifests and objects from a
  local directory (layout in its docstring); it is read-only.
* :class:`fsagent.memclient.MemoryBridgeClient` keeps a run in memory and
  accepts checkpoints, validating them like the controller, with fault
  injection.

Objects are streamed to a destination file while their SHA-256 is computed;
the caller compares it with the manifest digest before publishing anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar

import httpx
import trio

from common.bridge import MANIFEST_PAGE_MAX, PREFIX, encode_batch
from common.limits import SCOPES
from common.types import Digest, FileVersion
from fsagent.errors import (
    ControllerRefused,
    ControllerUnavailable,
    ObjectUnavailable,
)
from fsagent.tls import TransportOptions, check_url, ssl_context, untrusted_certificate

log = logging.getLogger(__name__)
T = TypeVar("T")
CHUNK = 256 * 1024
RETRY_AFTER_MAX = 60.0
"""Longest wait a ``Retry-After`` header can ask for between two attempts."""

Frames = Callable[[], AsyncIterator[bytes]]
"""Upload frames of one object (:mod:`common.bridge`); called again per attempt."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: str
    company_id: str
    agent_id: str
    lease_epoch: int
    active: bool
    bindings: dict[str, str | None]
    agent_entry: str | None = None
    """The agent's instruction entry. A controller that names it holds the agent
    folder contract (spec/agent-files.md): the entry cannot be unlinked or
    renamed away, and the local copy of the agent folder is discarded at stop."""
    warnings: tuple[dict[str, Any], ...] = ()
    """The run's current warnings (e.g. an agent folder at a storage limit)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunInfo:
        bindings = {scope: data["bindings"].get(scope) for scope in SCOPES}
        entry = data.get("agentEntry")
        warnings = data.get("warnings") or []
        return cls(
            str(data["runId"]),
            str(data["companyId"]),
            str(data["agentId"]),
            int(data["leaseEpoch"]),
            bool(data["active"]),
            bindings,
            None if entry is None else str(entry),
            tuple(w for w in warnings if isinstance(w, dict)),
        )


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    path: str
    kind: str
    digest: Digest | None
    byte_size: int
    executable: bool
    version: FileVersion
    deleted: bool

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ManifestEntry:
        return cls(
            str(data["path"]),
            str(data["kind"]),
            data.get("digest"),
            int(data.get("byteSize", 0)),
            bool(data.get("executable", False)),
            FileVersion(int(data.get("version", 0))),
            bool(data.get("deleted", False)),
        )


@dataclass(frozen=True, slots=True)
class ManifestPage:
    entries: list[ManifestEntry]
    next_since: int | None
    high_water: int


def manifest_pages(
    entries: Iterable[ManifestEntry], since: int, high_water: int, page_size: int
) -> Iterator[ManifestPage]:
    """What the controller answers for ``since``, cut into pages (for local sources):
    entries newer than ``since`` in version order; deleted ones only when since > 0."""
    chosen = sorted(
        (e for e in entries if e.version > since and (since > 0 or not e.deleted)),
        key=lambda e: e.version,
    )
    for i in range(0, max(len(chosen), 1), page_size):
        page = chosen[i : i + page_size]
        more = i + page_size < len(chosen)
        yield ManifestPage(page, int(page[-1].version) if more else None, high_water)


class BridgeClient(ABC):
    """What fsagent needs from the controller: the read side and the write side.

    ``writable`` is False for a source that cannot take checkpoints (a local
    directory): the mount then serves it without a shipper.
    """

    writable: ClassVar[bool] = True

    # --- read side ---

    @abstractmethod
    async def get_run(self) -> RunInfo:
        """The run this client's token belongs to, with its four bindings."""

    @abstractmethod
    def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        """Pages of the folder's manifest with ``version > since``, in version order.

        Raises ControllerRefused meaning common.errors.ResyncRequired when ``since`` is older than the purge floor.
        """

    @abstractmethod
    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        """Write the object's bytes to ``dest``; return (sha256 hex of what was written, size).

        Raises ObjectUnavailable when the controller does not serve it.
        """

    @abstractmethod
    async def refresh_requested(self) -> bool:
        """Whether the run asks for the server's changes after its final save."""

    # --- write side ---

    @abstractmethod
    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        """Stream one object as upload frames; return the controller's (digest, size).

        ``frames`` is called again for each attempt, so a retry re-reads the file.
        """

    @abstractmethod
    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        """Upload several small objects in one request (all or nothing); return
        the controller's (digest, size) per member, in order."""

    @abstractmethod
    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        """Apply one checkpoint body (all or nothing); return its receipt.

        The same operation id and body again returns the same receipt.
        """

    @abstractmethod
    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        """Tell the controller that a save started or failed (shown on /sync).
        With ``scope``, fsagent gave up on that folder's save: the controller
        records an explicit failure receipt for it (operation id, final)."""

    @abstractmethod
    async def refresh_applied(self) -> None:
        """Clear the run's refresh request once its changes are taken."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most clients hold nothing
        """Release connections."""

    def fork(self) -> BridgeClient | None:
        """A client with the same settings and connections of its own, for the
        event loop of another thread (:mod:`fsagent.shipthread`); None when this
        client cannot serve another thread, and checkpoints then stay on the
        mount's loop."""
        return None


def _flush_and_sync(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())


async def copy_hashing(chunks: AsyncIterator[bytes], dest: Path) -> tuple[str, int]:
    """Stream chunks into ``dest`` (file I/O in a worker thread), hashing as we go."""
    sha = hashlib.sha256()
    size = 0
    fh: BinaryIO = await trio.to_thread.run_sync(lambda: open(dest, "wb"))  # noqa: SIM115
    try:
        async for chunk in chunks:
            sha.update(chunk)
            size += len(chunk)
            await trio.to_thread.run_sync(fh.write, chunk)
        await trio.to_thread.run_sync(_flush_and_sync, fh)
    finally:
        fh.close()
    return sha.hexdigest(), size


# --- retries -----------------------------------------------------------------


class _Transient(Exception):
    """A failure worth retrying (network, 5xx, 429), maybe with the server's wait."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP
    date), bounded to [0, RETRY_AFTER_MAX]; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value) if value.isdigit() else None
        if seconds is None:
            when = parsedate_to_datetime(value).timestamp()
            seconds = when - (time.time() if now is None else now)
    except (TypeError, ValueError, OverflowError):
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX)


async def with_retries(
    what: str,
    attempt_once: Callable[[], Awaitable[T]],
    *,
    deadline: float,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
) -> T:
    """Run ``attempt_once`` until it succeeds, a permanent error, or ``deadline`` seconds.

    Exponential backoff with full jitter, so many sandboxes recovering at once
    do not hammer the controller in lockstep; log louder as attempts grow.
    """
    start = trio.current_time()
    attempt = 0
    while True:
        try:
            return await attempt_once()
        except _Transient as exc:
            untrusted = untrusted_certificate(exc)
            if untrusted is not None:  # retrying cannot make the certificate trusted
                raise ControllerUnavailable(
                    f"{what}: TLS certificate not trusted: {untrusted}"
                ) from exc
            attempt += 1
            elapsed = trio.current_time() - start
            delay = random.uniform(0, min(max_delay, base_delay * 2**attempt))
            if exc.retry_after is not None:
                delay = max(delay, exc.retry_after)  # the server knows when it can answer
            if elapsed + delay > deadline:
                raise ControllerUnavailable(
                    f"{what}: gave up after {attempt} attempts over {elapsed:.1f}s: {exc}"
                ) from exc
            level = logging.INFO if attempt < 3 else logging.WARNING
            log.log(
                level, "%s failed (attempt %d, retrying in %.2fs): %s", what, attempt, delay, exc
            )
            await trio.sleep(delay)


# --- HTTP --------------------------------------------------------------------


class HttpBridgeClient(BridgeClient):
    """The controller's bridge over HTTPS with the run token."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        retry_deadline: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        tls: TransportOptions | None = None,
    ) -> None:
        self._settings = (base_url, token, transport, tls)
        tls = tls or TransportOptions()
        self._http = httpx.AsyncClient(
            verify=ssl_context(tls),
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}", "User-Agent": "fsagent"},
            timeout=httpx.Timeout(30.0, connect=10.0),
            transport=transport,
        )
        self.retry_deadline = retry_deadline

    async def aclose(self) -> None:
        await self._http.aclose()

    def fork(self) -> HttpBridgeClient:
        base_url, token, transport, tls = self._settings
        return HttpBridgeClient(
            base_url, token, retry_deadline=self.retry_deadline, transport=transport, tls=tls
        )

    @staticmethod
    def _check(resp: httpx.Response, what: str) -> None:
        if resp.status_code < 400:
            return
        if resp.status_code == 429 or resp.status_code >= 500:
            retry_after = None
            if resp.status_code in (429, 503):
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            raise _Transient(f"HTTP {resp.status_code}", retry_after)
        code = None
        message = resp.reason_phrase
        try:
            body = resp.json()
            code, message = body.get("code"), body.get("error", message)
        except (ValueError, AttributeError):
            pass
        raise ControllerRefused(
            f"{what}: HTTP {resp.status_code} {code or ''} {message}".strip(),
            resp.status_code,
            code,
        )

    async def _get_json(self, url: str, what: str, params: dict[str, Any] | None = None) -> Any:
        async def once() -> Any:
            try:
                resp = await self._http.get(url, params=params)
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what)
            return resp.json()

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def get_run(self) -> RunInfo:
        return RunInfo.from_json(await self._get_json(PREFIX + "/run", "GET run"))

    async def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        cursor: int | None = since
        high_water: int | None = None
        while cursor is not None:
            body = await self._get_json(
                f"{PREFIX}/folders/{scope}/manifest",
                f"GET {scope} manifest since {cursor}",
                {"since": cursor, "limit": MANIFEST_PAGE_MAX},
            )
            # The first page's high-water mark is the baseline: later pages may
            # see newer versions, which a "since" listing will pick up again.
            if high_water is None:
                high_water = int(body["highWater"])
            cursor = body.get("nextSince")
            yield ManifestPage(
                [ManifestEntry.from_json(e) for e in body["entries"]],
                cursor,
                high_water,
            )

    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        url = f"{PREFIX}/folders/{scope}/objects/{digest}"
        what = f"GET {scope} object {digest[:12]}"

        async def once() -> tuple[str, int]:
            try:
                async with self._http.stream("GET", url) as resp:
                    if resp.status_code == 404:
                        raise ObjectUnavailable(f"{what}: not served by the controller (404)")
                    if resp.status_code >= 400:
                        await resp.aread()
                    self._check(resp, what)
                    return await copy_hashing(resp.aiter_bytes(CHUNK), dest)
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc

        return await with_retries(what, once, deadline=self.retry_deadline)

    # --- checkpoints (write side) ------------------------------------------

    async def _send_json(self, url: str, what: str, body: dict[str, Any]) -> Any:
        async def once() -> Any:
            try:
                resp = await self._http.post(
                    url, json=body, timeout=httpx.Timeout(300.0, connect=10.0)
                )
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what)
            return resp.json()

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        url = f"{PREFIX}/folders/{scope}/uploads"
        what = f"PUT {scope} upload"

        async def once() -> tuple[str, int]:
            try:
                resp = await self._http.put(
                    url, content=frames(), timeout=httpx.Timeout(300.0, connect=10.0)
                )
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what)
            body = resp.json()
            return str(body["digest"]), int(body["byteSize"])

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        url = f"{PREFIX}/folders/{scope}/uploads/batch"
        what = f"PUT {scope} batch of {len(members)}"
        # Compressing a batch is CPU work: off the trio thread (the FUSE loop).
        body = await trio.to_thread.run_sync(encode_batch, members)

        async def once() -> list[tuple[str, int]]:
            try:
                resp = await self._http.put(
                    url, content=body, timeout=httpx.Timeout(300.0, connect=10.0)
                )
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what)
            return [(str(o["digest"]), int(o["byteSize"])) for o in resp.json()["objects"]]

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._send_json(
            f"{PREFIX}/folders/{scope}/checkpoints", f"POST {scope} checkpoint", body
        )
        return result

    async def refresh_requested(self) -> bool:
        body = await self._get_json(PREFIX + "/run", "GET run")
        return bool(body.get("refreshRequested"))

    async def refresh_applied(self) -> None:
        await self._send_json(PREFIX + "/run/refresh-applied", "refresh applied", {})

    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        body: dict[str, Any] = {"state": state, "error": error}
        if scope is not None:
            body.update(scope=scope, operationId=operation_id, final=final)
        await self._send_json(PREFIX + "/run/report", f"report {state}", body)


# --- local directory ---------------------------------------------------------


class DirectoryBridgeClient(BridgeClient):
    """Serves a run from a directory, for tests and benchmarks (read-only).

    Layout::

        run.json                      GET /run body
        <scope>/manifest.json         {"entries": [ManifestEntry...], "highWater": n}
        <scope>/objects/<digest>      object bytes
        config.json (optional)        {"fetchDelay": seconds per object}
    """

    writable = False

    def __init__(self, root: Path) -> None:
        self.root = root
        cfg = root / "config.json"
        self._config: dict[str, Any] = json.loads(cfg.read_text()) if cfg.exists() else {}

    async def get_run(self) -> RunInfo:
        try:
            data = json.loads((self.root / "run.json").read_text())
        except FileNotFoundError:
            raise ControllerRefused(f"{self.root}/run.json not found", 404) from None
        return RunInfo.from_json(data)

    async def iter_manifest(self, scope: str, since: int = 0) -> AsyncIterator[ManifestPage]:
        path = self.root / scope / "manifest.json"
        if not path.exists():
            raise ControllerRefused(f"{path} not found: scope {scope} is not bound", 404)
        data = await trio.to_thread.run_sync(lambda: json.loads(path.read_text()))
        entries = [ManifestEntry.from_json(e) for e in data["entries"]]
        high = int(data.get("highWater", max((e.version for e in entries), default=0)))
        for page in manifest_pages(entries, since, high, MANIFEST_PAGE_MAX):
            yield page

    async def fetch_object(self, scope: str, digest: Digest, dest: Path) -> tuple[str, int]:
        delay = float(self._config.get("fetchDelay", 0))
        if delay:
            await trio.sleep(delay)
        src = self.root / scope / "objects" / digest
        try:
            fh = await trio.to_thread.run_sync(lambda: open(src, "rb"))  # noqa: SIM115
        except FileNotFoundError:
            raise ObjectUnavailable(f"object {digest[:12]} not in {src.parent}") from None

        async def chunks() -> AsyncIterator[bytes]:
            with fh:
                while chunk := await trio.to_thread.run_sync(fh.read, CHUNK):
                    yield chunk

        return await copy_hashing(chunks(), dest)

    async def refresh_requested(self) -> bool:
        return False

    def _read_only(self) -> ControllerRefused:
        return ControllerRefused(f"{self.root} is a read-only source", 405, "read_only_source")

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        raise self._read_only()

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        raise self._read_only()

    async def commit_checkpoint(self, scope: str, body: dict[str, Any]) -> dict[str, Any]:
        raise self._read_only()

    async def report_state(
        self,
        state: str,
        error: str | None = None,
        *,
        scope: str | None = None,
        operation_id: str | None = None,
        final: bool = False,
    ) -> None:
        raise self._read_only()

    async def refresh_applied(self) -> None:
        raise self._read_only()


def open_client(
    controller: str,
    token: str | None,
    *,
    retry_deadline: float = 60.0,
    tls: TransportOptions | None = None,
) -> BridgeClient:
    """``dir:PATH`` / ``file://PATH`` → DirectoryBridgeClient; http(s) URL → HttpBridgeClient
    (plain ``http://`` only to loopback unless ``tls.insecure_http``: :mod:`fsagent.tls`)."""
    if controller.startswith("dir:"):
        return DirectoryBridgeClient(Path(controller[4:]))
    if controller.startswith("file://"):
        return DirectoryBridgeClient(Path(controller[7:]))
    if token is None:
        raise ValueError("a run token is required for an HTTP controller")
    check_url(controller, tls or TransportOptions())
    return HttpBridgeClient(controller, token, retry_deadline=retry_deadline, tls=tls)
