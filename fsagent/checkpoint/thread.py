"""Checkpoints on a thread of their own, with their own trio loop and HTTP client.

The mount's trio thread serves every FUSE request. When a checkpoint's work
(building batch and commit bodies, httpx, the JSON of requests and receipts,
the change listing) ran on that loop too, a FUSE request that arrived while
several of those steps were ready waited behind all of them. Here the
:class:`~fsagent.checkpoint.ship.Shipper` runs on a loop of its own (:class:`ShipThread`)
and reaches the state dir through :class:`ThreadState`, which keeps the
contract of :class:`~fsagent.checkpoint.ship.ShipState`:

* On the ship thread, touching only LMDB (one snapshot per read, never the
  mount's in-memory inodes): listing the change set, reading each upload's
  write generation and inline contents (a write commits both together),
  persisting and syncing the pending record before any byte is sent, and the
  save status. LMDB orders these few short write transactions with the
  mount's own commits.
* On the mount's loop, each as one short call between two FUSE handlers
  (:func:`call_on`), so atomic with respect to them exactly as before: the
  generation check after an upload (snapshot rule: a write handler puts its
  bytes in the upper file and bumps the generation without yielding, so a
  write that raced the read has bumped it by the time the check runs), and
  the acknowledgement, in parts of :data:`ACK_PART` changes (it reads live
  generations and forgets the fsync fast path; a crash between two parts
  leaves the pending record, whose replay acknowledges again, idempotently).

One checkpoint stays in flight (the shipper's lock, now on the ship loop),
the cadence loop runs there too, and the final save at stop goes through the
same thread before it is stopped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self, TypeVar

import outcome
import trio

from fsagent.bridge.base import BridgeClient
from fsagent.checkpoint.ship import (
    SaveResult,
    Shipped,
    Shipper,
    ShipState,
    checkpoint_loop,
    live_unchanged,
)
from fsagent.errors import SaveFailed
from fsagent.state.store import Change, Store

log = logging.getLogger("fsagent.shipthread")
T = TypeVar("T")

GIL_SWITCH_SECONDS = 0.0005
"""How long a thread may keep the GIL while another waits for it (CPython's
default is 5 ms). A FUSE request arriving while the ship thread runs Python
waits for the GIL: with the default, up to 5 ms per request."""

ACK_PART = 128
"""Changes acknowledged per call on the mount's loop: about a millisecond of
LMDB work, so a FUSE request waits at most that long behind one part."""


class LoopGone(RuntimeError):
    """The loop a call was sent to has ended."""


async def call_on(token: trio.lowlevel.TrioToken, fn: Callable[[], T]) -> T:
    """Run ``fn()`` on the loop of ``token``, between two of its tasks' steps,
    and await its result (or exception) here without blocking this loop.

    ``fn`` runs whatever happens to the caller: if the caller is cancelled
    meanwhile, its result is dropped.
    """
    here = trio.lowlevel.current_trio_token()
    done = trio.Event()
    box: list[outcome.Outcome[T]] = []

    def deliver(result: outcome.Outcome[T]) -> None:
        box.append(result)
        done.set()

    def run() -> None:
        result = outcome.capture(fn)
        with contextlib.suppress(trio.RunFinishedError):  # the caller's loop is gone
            here.run_sync_soon(deliver, result)

    try:
        token.run_sync_soon(run)
    except trio.RunFinishedError:
        raise LoopGone("the loop to call has ended") from None
    await done.wait()
    return box[0].unwrap()


class ThreadState(ShipState):
    """The shipper's view of the state dir from the ship thread (see the module)."""

    store: Store
    """A FUSE mount's store: only its committed records are read from this thread."""

    def __init__(self, store: Store, mount: trio.lowlevel.TrioToken) -> None:
        super().__init__(store)
        self.mount = mount

    async def pending(self) -> dict[str, Any] | None:
        return self.store.journal.pending_checkpoint()

    async def changes(self) -> list[Change]:
        # What the mount keeps in memory for a while first (a durable file's
        # size and generation after a WRITE): the listing reads committed records.
        await call_on(self.mount, self.store.commit_behind)
        return self.store.changes_since_baseline(committed=True)

    async def set_pending(self, record: dict[str, Any] | None) -> None:
        self.store.journal.set_pending_checkpoint(record)

    async def contents(self, changes: list[Change]) -> list[tuple[Change, bytes | None]]:
        inos = []
        for change in changes:
            assert change.inode is not None
            inos.append(change.inode)
        out: list[tuple[Change, bytes | None]] = []
        for change, seen in zip(changes, self.store.tree.committed_contents(inos), strict=True):
            if seen is not None and seen[0] == change.generation:
                out.append((change, seen[1]))
        return out

    async def unchanged(self, changes: list[Change]) -> list[bool]:
        return await call_on(self.mount, functools.partial(live_unchanged, self.store, changes))

    async def finish(self, shipped: Shipped, receipt: dict[str, Any]) -> None:
        high_water = self.store.journal.baseline().high_water
        for first in range(0, len(shipped), ACK_PART):
            part = shipped[first : first + ACK_PART]
            await call_on(self.mount, functools.partial(self.store.acknowledge, part, high_water))
        if not shipped:
            await call_on(self.mount, functools.partial(self.store.acknowledge, [], high_water))
        self.store.journal.close_checkpoint(receipt)

    async def record_error(self, message: str, code: str | None = None) -> None:
        self.store.journal.record_save_error(message, code)


class ShipThread:
    """A shipper on its own thread and trio loop, driven from the mount's loop.

    ``async with ShipThread(...) as shipper`` starts the thread and stops it
    on exit; :meth:`ship_checkpoint` has the :class:`~fsagent.checkpoint.ship.Shipper`
    contract and :meth:`start_cadence` starts the checkpoint cadence there.
    ``client`` is used only on the ship thread (a :meth:`BridgeClient.fork`).
    """

    def __init__(self, store: Store, client: BridgeClient, scope: str, lease_epoch: int) -> None:
        self.store = store
        self.client = client
        self.scope = scope
        self.lease_epoch = lease_epoch
        self._shipper: Shipper | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None

    # --- seen from the mount's loop ------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Checkpoints in flight or waiting (read across threads: a snapshot)."""
        return 0 if self._shipper is None else self._shipper.queue_depth

    @property
    def last_checkpoint(self) -> dict[str, Any] | None:
        return None if self._shipper is None else self._shipper.last_checkpoint

    @property
    def fenced(self) -> str | None:
        """Why the controller fenced this run off (fsagent.checkpoint.ship.Shipper.fenced)."""
        return None if self._shipper is None else self._shipper.fenced

    async def __aenter__(self) -> Self:
        mount = trio.lowlevel.current_trio_token()
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_SECONDS))
        ready = trio.Event()
        started: list[BaseException | None] = []

        def signal(error: BaseException | None) -> None:
            started.append(error)
            ready.set()

        def tell(error: BaseException | None) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                mount.run_sync_soon(signal, error)

        self._thread = threading.Thread(
            target=self._run, args=(mount, tell), name=f"fsagent-ship-{self.scope}", daemon=True
        )
        self._thread.start()
        await ready.wait()
        if started[0] is not None:
            raise started[0]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None and self._nursery is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._nursery.cancel_scope.cancel)
        if self._thread is not None:
            # Joining is a blocking wait: a worker thread, shielded so that a
            # cancelled mount still waits for the client to close.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._thread.join)

    async def ship_checkpoint(self, *, final: bool = False) -> SaveResult:
        """Save everything changed since the baseline (on the ship thread); raises SaveFailed."""
        shipper = self._shipper
        assert shipper is not None, "the ship thread has not started"
        return await self._run_there(functools.partial(shipper.ship_checkpoint, final=final))

    def start_cadence(self, interval: float) -> None:
        """A checkpoint every ``interval`` seconds on the ship thread, from now on."""
        token, nursery, shipper = self._token, self._nursery, self._shipper
        if token is None or nursery is None or shipper is None:
            raise SaveFailed("the checkpoint thread is not running")
        token.run_sync_soon(lambda: nursery.start_soon(checkpoint_loop, shipper, interval))

    async def _run_there(self, afn: Callable[[], Awaitable[T]]) -> T:
        """Run ``afn`` as a task of the ship loop; its result or error here."""
        token, nursery = self._token, self._nursery
        if token is None or nursery is None:
            raise SaveFailed("not saved: the checkpoint thread is not running")
        here = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        def send(result: outcome.Outcome[T]) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                here.run_sync_soon(deliver, result)

        async def task() -> None:
            result = await outcome.acapture(afn)
            if isinstance(result, outcome.Error) and isinstance(result.error, trio.Cancelled):
                # A Cancelled belongs to the ship loop: the caller gets a failure,
                # and the cancellation goes on here.
                send(outcome.Error(SaveFailed("not saved: the checkpoint thread stopped")))
                result.unwrap()
            send(result)

        def spawn() -> None:
            try:
                nursery.start_soon(task)
            except RuntimeError:  # the nursery closed: the thread is stopping
                send(outcome.Error(SaveFailed("not saved: the checkpoint thread stopped")))

        try:
            token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise SaveFailed("not saved: the checkpoint thread has ended") from None
        await done.wait()
        return box[0].unwrap()

    # --- on the ship thread ----------------------------------------------------

    def _run(
        self, mount: trio.lowlevel.TrioToken, tell: Callable[[BaseException | None], None]
    ) -> None:
        try:
            trio.run(self._main, mount, tell)
        except BaseException as exc:  # a thread must not die silently
            log.exception("the checkpoint thread failed")
            tell(exc)  # harmless once started: only the first report counts

    async def _main(
        self, mount: trio.lowlevel.TrioToken, tell: Callable[[BaseException | None], None]
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._shipper = Shipper(
            self.store,
            self.client,
            self.scope,
            self.lease_epoch,
            state=ThreadState(self.store, mount),
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                tell(None)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.client.aclose()
