"""The bridge client over HTTP: the controller's ``/bridge/v1`` routes
(:mod:`common.bridge`) with the run token, retrying transient failures
(honouring ``Retry-After`` on 429 and 503, at most :data:`RETRY_AFTER_MAX`),
and the reader of batch answers (:func:`read_batch`, over :mod:`common.wire`).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import httpx
import trio

from common.bridge import MANIFEST_PAGE_MAX, PREFIX, encode_batch
from common.errors import BadFrame, DigestMismatch, PayloadTooLarge, WorkFolderError
from common.repos import FETCH_BATCH_MAX, MISSING_MAX
from common.text import clean_text
from common.types import Digest
from common.wire import BatchSplitter, Frame, Member, MemberEnd, decode_frame
from fsagent.bridge.base import (
    ALLOWANCE_CODES,
    CHUNK,
    BadBatch,
    BridgeClient,
    DestFor,
    Frames,
    ManifestEntry,
    ManifestPage,
    RepoList,
    RepoManifest,
    RunInfo,
    UploadAllowanceRefused,
    _positive_int,
    copy_hashing,
)
from fsagent.bridge.requestlog import event_hooks, request_fields
from fsagent.bridge.tls import TransportOptions, ssl_context, untrusted_certificate
from fsagent.errors import (
    ControllerRefused,
    ControllerUnavailable,
    ObjectUnavailable,
)

log = logging.getLogger("fsagent.client")
T = TypeVar("T")
RETRY_AFTER_MAX = 60.0
"""Longest wait a ``Retry-After`` header can ask for between two attempts."""


WRITE_BATCH_BYTES = 4 << 20
"""Compressed bytes handed to one worker-thread call of a batch fetch: one
thread round trip per file would cost more than writing a small file."""


def _reason(exc: WorkFolderError) -> str:
    """What the wire reader (:mod:`common.wire`) refused, in its own words."""
    if exc.details and isinstance(exc.details[0], dict) and "message" in exc.details[0]:
        return str(exc.details[0]["message"])
    return exc.text


class _BatchWriter:
    """The worker-thread half of :func:`read_batch`: decodes and checks frames
    (:func:`common.wire.decode_frame`), writes members to their files,
    verifies each member's size and SHA-256. Runs one list of items per call,
    in order; at most one file is open."""

    def __init__(self, dest_for: DestFor) -> None:
        self.dest_for = dest_for
        self.results: list[tuple[str, int]] = []
        self._fh: BinaryIO | None = None
        self._sha = hashlib.sha256()
        self._written = 0
        self._index = -1
        self._member = Member(0, b"")

    def run(self, items: list[Member | Frame | MemberEnd]) -> None:
        for item in items:
            if isinstance(item, Frame):
                try:
                    raw = decode_frame(item)
                except BadFrame as exc:
                    raise BadBatch(f"batch frame: {_reason(exc)}") from None
                self._sha.update(raw)
                self._written += item.raw_len
                assert self._fh is not None
                self._fh.write(raw)
            elif isinstance(item, Member):
                self._index += 1
                self._member = item
                self._sha = hashlib.sha256()
                self._written = 0
                self._fh = open(self.dest_for(self._index), "wb")  # noqa: SIM115 - closed at the end
            else:
                assert self._fh is not None
                self._fh.close()
                self._fh = None
                size, declared = self._member.raw_len, self._member.sha256
                if self._written != size or self._sha.digest() != declared:
                    raise BadBatch(
                        f"batch member {self._index}, object {declared.hex()[:12]}, does not "
                        f"match its declared size and SHA-256 ({self._written} of {size} bytes, "
                        f"SHA-256 {self._sha.hexdigest()[:12]})",
                        declared.hex(),
                    )
                self.results.append((self._sha.hexdigest(), self._written))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


async def read_batch(
    chunks: AsyncIterator[bytes], count: int, dest_for: DestFor
) -> list[tuple[str, int]]:
    """Write the members of a batch body (:func:`common.bridge.encode_batch`)
    to ``dest_for(i)``; (sha256, size) of what was written per member. Every
    frame's bounds, declared size and xxh64 and every member's declared size
    and SHA-256 are checked; the caller still compares each digest with the
    one it asked for (a member may be a different object than requested).

    :class:`common.wire.BatchSplitter` cuts the stream here (cheap), and a
    worker thread decodes and writes about :data:`WRITE_BATCH_BYTES` of it
    per call: memory stays bounded whatever the objects' sizes or what a
    frame claims. Every refusal is a :class:`BadBatch`.
    """
    splitter = BatchSplitter(expect=count, member_max=None, max_bytes=None)
    source = chunks.__aiter__()
    writer = _BatchWriter(dest_for)
    items: list[Member | Frame | MemberEnd] = []
    pending = 0

    async def flush() -> None:
        nonlocal items, pending
        if items:
            work, items, pending = items, [], 0
            await trio.to_thread.run_sync(writer.run, work)

    try:
        try:
            async for chunk in source:
                for item in splitter.feed(chunk):
                    items.append(item)
                    if isinstance(item, Frame):
                        pending += len(item.payload)
                        if pending >= WRITE_BATCH_BYTES:
                            await flush()
                    elif isinstance(item, MemberEnd) and len(items) >= 4096:
                        await flush()
            if not splitter.done:
                raise BadBatch("batch answer ended early, before its last member")
        except DigestMismatch as exc:
            # The member's frames do not add up to its declared size: name it.
            member = splitter.member
            digest = member.sha256.hex() if member is not None else None
            raise BadBatch(f"batch answer: {_reason(exc)}", digest) from None
        except (BadFrame, PayloadTooLarge) as exc:
            raise BadBatch(f"batch answer: {_reason(exc)}") from None
        await flush()
    finally:
        writer.close()
        aclose = getattr(source, "aclose", None)  # an async generator: close it now
        if aclose is not None:
            await aclose()
    return writer.results


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
                level,
                "%s failed (attempt %d, retrying in %.2fs): %s",
                what,
                attempt,
                delay,
                exc,
                extra=request_fields(),
            )
            await trio.sleep(delay)


# --- HTTP --------------------------------------------------------------------


def _check_allowance(resp: httpx.Response, what: str) -> None:
    """Raise :class:`UploadAllowanceRefused` when ``resp`` is a refusal by the
    run's upload allowance (by its code; a 429 of the request limits is not)."""
    try:
        body = resp.json()
        code = body.get("code")
    except (ValueError, AttributeError):
        return
    if code not in ALLOWANCE_CODES:
        return
    details = body.get("details")
    first = details[0] if isinstance(details, list) and details else {}
    first = first if isinstance(first, dict) else {}
    raise UploadAllowanceRefused(
        f"{what}: HTTP {resp.status_code} {code} {body.get('error', '')}".strip(),
        resp.status_code,
        str(code),
        limit=_positive_int(first.get("limit")),
        pending=_nonnegative_int(first.get("pending")),
        size=_nonnegative_int(first.get("size")),
    )


def _nonnegative_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


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
            event_hooks=event_hooks(),
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
    def _check(resp: httpx.Response, what: str, *, allowance: bool = False) -> None:
        """Raise for a failed answer: ``_Transient`` for what a retry may cure
        (network, 5xx, 429), ControllerRefused otherwise; with ``allowance``
        (a folder upload), a refusal by the run's upload allowance is
        :class:`UploadAllowanceRefused`, never retried here."""
        if resp.status_code < 400:
            return
        if allowance and resp.status_code in (413, 429):
            _check_allowance(resp, what)
        if resp.status_code == 429 or resp.status_code >= 500:
            retry_after = None
            if resp.status_code in (429, 503):
                retry_after = parse_retry_after(resp.headers.get("Retry-After"))
            raise _Transient(f"HTTP {resp.status_code}", retry_after)
        code = None
        message = resp.reason_phrase
        details: list[dict[str, Any]] = []
        try:
            body = resp.json()
            code, message = body.get("code"), body.get("error", message)
            found = body.get("details")
            if isinstance(found, list):
                details = [d for d in found if isinstance(d, dict)]
        except (ValueError, AttributeError):
            pass
        raise ControllerRefused(
            f"{what}: HTTP {resp.status_code} {code or ''} {message}".strip(),
            resp.status_code,
            code,
            details,
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

    async def _put_frames(
        self, url: str, what: str, frames: Frames, *, allowance: bool = False
    ) -> tuple[str, int]:
        async def once() -> tuple[str, int]:
            try:
                resp = await self._http.put(
                    url, content=frames(), timeout=httpx.Timeout(300.0, connect=10.0)
                )
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what, allowance=allowance)
            body = resp.json()
            return str(body["digest"]), int(body["byteSize"])

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def _put_batch(
        self, url: str, what: str, members: list[bytes], *, allowance: bool = False
    ) -> list[tuple[str, int]]:
        # Compressing a batch is CPU work: off the trio thread (the FUSE loop).
        body = await trio.to_thread.run_sync(encode_batch, members)

        async def once() -> list[tuple[str, int]]:
            try:
                resp = await self._http.put(
                    url, content=body, timeout=httpx.Timeout(300.0, connect=10.0)
                )
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            self._check(resp, what, allowance=allowance)
            return [(str(o["digest"]), int(o["byteSize"])) for o in resp.json()["objects"]]

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def upload_object(self, scope: str, frames: Frames) -> tuple[str, int]:
        return await self._put_frames(
            f"{PREFIX}/folders/{scope}/uploads", f"PUT {scope} upload", frames, allowance=True
        )

    async def upload_batch(self, scope: str, members: list[bytes]) -> list[tuple[str, int]]:
        return await self._put_batch(
            f"{PREFIX}/folders/{scope}/uploads/batch",
            f"PUT {scope} batch of {len(members)}",
            members,
            allowance=True,
        )

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
        # The error is built from exceptions and tool output: made to follow
        # the controller's text rule, so the report is never refused for it.
        body: dict[str, Any] = {
            "state": state,
            "error": None if error is None else clean_text(error),
        }
        if scope is not None:
            body.update(scope=scope, operationId=operation_id, final=final)
        await self._send_json(PREFIX + "/run/report", f"report {state}", body)

    # --- repositories ---------------------------------------------------------

    async def list_repos(self) -> RepoList:
        return RepoList.from_json(await self._get_json(PREFIX + "/repos", "GET repos"))

    async def repo_missing(self, workspace_id: str, digests: list[str]) -> set[str]:
        missing: set[str] = set()
        for i in range(0, len(digests), MISSING_MAX):
            chunk = digests[i : i + MISSING_MAX]
            body = await self._send_json(
                f"{PREFIX}/repos/{workspace_id}/missing",
                f"POST repo {workspace_id} missing ({len(chunk)})",
                {"digests": chunk},
            )
            missing.update(str(d) for d in body["missing"])
        return missing

    async def upload_repo_object(self, workspace_id: str, frames: Frames) -> tuple[str, int]:
        return await self._put_frames(
            f"{PREFIX}/repos/{workspace_id}/uploads", f"PUT repo {workspace_id} upload", frames
        )

    async def upload_repo_batch(
        self, workspace_id: str, members: list[bytes]
    ) -> list[tuple[str, int]]:
        return await self._put_batch(
            f"{PREFIX}/repos/{workspace_id}/uploads/batch",
            f"PUT repo {workspace_id} batch of {len(members)}",
            members,
        )

    async def commit_repo_checkpoint(
        self, workspace_id: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self._send_json(
            f"{PREFIX}/repos/{workspace_id}/checkpoints",
            f"POST repo {workspace_id} checkpoint",
            body,
        )
        return result

    async def repo_manifest(
        self, workspace_id: str, checkpoint_id: str = "current"
    ) -> RepoManifest:
        return RepoManifest.from_json(
            await self._get_json(
                f"{PREFIX}/repos/{workspace_id}/checkpoints/{checkpoint_id}/manifest",
                f"GET repo {workspace_id} manifest {checkpoint_id}",
            )
        )

    async def fetch_repo_objects(
        self, workspace_id: str, digests: list[str], dest_for: DestFor
    ) -> list[tuple[str, int]]:
        if len(digests) > FETCH_BATCH_MAX:
            raise ValueError(f"at most {FETCH_BATCH_MAX} objects per batch fetch")
        url = f"{PREFIX}/repos/{workspace_id}/objects/batch"
        what = f"POST repo {workspace_id} objects ({len(digests)})"

        async def once() -> list[tuple[str, int]]:
            try:
                async with self._http.stream(
                    "POST",
                    url,
                    json={"digests": digests},
                    timeout=httpx.Timeout(300.0, connect=10.0),
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                    self._check(resp, what)
                    return await read_batch(resp.aiter_bytes(CHUNK), len(digests), dest_for)
            except httpx.TransportError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc

        return await with_retries(what, once, deadline=self.retry_deadline)

    async def report_repo_state(
        self, workspace_id: str, state: str, error: str | None = None
    ) -> None:
        body: dict[str, Any] = {"state": state}
        if error is not None:
            body["error"] = clean_text(error)
        await self._send_json(
            f"{PREFIX}/repos/{workspace_id}/report", f"report repo {workspace_id} {state}", body
        )


# --- local directory ---------------------------------------------------------
