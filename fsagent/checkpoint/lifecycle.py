"""A collection's run lifecycle, one implementation for FUSE mode
(fsagent.fuse.mount) and dir mode (fsagent.dirmode.serve).

The states and transitions are drawn in ARCHITECTURE.md ("Lifecycle"). What
a mode supplies: its shipper (the shared :class:`~fsagent.checkpoint.ship.Shipper`, on a
thread of its own in FUSE mode, with a scan first in dir mode) and how it
applies the server's changes (``take_incoming``: into LMDB before the mount,
or into the plain directory while no agent runs). What is decided here, once:

* **warm start**: a start on a state dir that was hydrated before saves the
  local changes first, under the run that now holds the sandbox (a stored
  request of an earlier run is listed again, never replayed: fsagent.checkpoint.ship),
  then takes the server's changes to paths not changed locally;
* **final save** at the stop boundary: tried ``stop.attempts`` times while it
  fails on the way, once when refused; a refusal over the agent folder's
  storage limit is a warning, not a failure; every part of it says it is
  part of the final save, so a refused part is the final save's receipt,
  and a save given up for any other cause gets an explicit, final failure
  receipt (the run's status then shows the folder stopped, with its failure);
* **what the stop keeps**: every collection keeps its state dir when the
  final save did not succeed, except the agent folder under its contract,
  whose local copy goes at the stop boundary whatever the outcome
  (the agent folder contract) -- unless the run was fenced off (a newer run holds
  the sandbox's lease, or this one ended): then the bytes stay pending for
  that newer run, whose warm start saves them;
* **refresh after stop**: an explicit refresh request is applied only after a
  final save that succeeded.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from fsagent.bridge.base import BridgeClient
from fsagent.checkpoint.ship import Checkpoints, FinalSave, SaveResult, limit_warning
from fsagent.errors import FsagentError, SaveFailed
from fsagent.state.records import Binding
from fsagent.state.statedir import MARKER, StateDir

log = logging.getLogger("fsagent.lifecycle")

FINAL_PAUSE_SECONDS = 2.0
"""The pause before the final save's second attempt; it doubles before each
further one, up to :data:`FINAL_PAUSE_MAX_SECONDS`."""
FINAL_PAUSE_MAX_SECONDS = 30.0
FINAL_PAUSE_ENV = "FSAGENT_TEST_FINAL_PAUSE"
"""Shortens the first of those pauses (tests: three attempts without 6 s of
waiting); never lengthens it."""


def refuse_other_binding(state_dir: Path, binding: Binding) -> None:
    """A collection this run does not bind (served empty and read-only) may
    not pick up another binding's state: a state dir left at ``state_dir``
    is opened only to check that it is ``binding``'s (``StateDir.bind``
    raises ``StateBindingMismatch`` otherwise) and is left as it was."""
    if (state_dir / MARKER).exists():
        existing = StateDir.open(state_dir)
        try:
            existing.bind(binding)
        finally:
            existing.close()


def final_pause(attempt: int) -> float:
    """The pause after failed attempt ``attempt`` (1-based) of a final save:
    2 s, 4 s, ... at most 30 s; the first is ``$FSAGENT_TEST_FINAL_PAUSE``
    seconds instead where that names a shorter one (any other value is
    ignored, so a stop can never be made to wait longer by it)."""
    first = FINAL_PAUSE_SECONDS
    try:
        value = float(os.environ.get(FINAL_PAUSE_ENV, ""))
    except ValueError:
        value = first
    if 0 <= value < first:
        first = value
    return min(FINAL_PAUSE_MAX_SECONDS, first * 2.0 ** (attempt - 1))


AGENT_FINAL_ATTEMPTS = 3
"""Final saves of the agent folder tried at the stop boundary, then a failure receipt."""

TakeIncoming = Callable[[], Awaitable[int]]
"""Applies the server's changes since the baseline to paths not changed
locally; returns how many were applied (a mode's ``take_incoming``)."""


@dataclass
class StopBoundary(FinalSave):
    """How a daemon's stop boundary ended (fsagent.checkpoint.ship.FinalSave), how a
    given-up final save gets its explicit failure receipt, and whether the
    run was fenced off."""

    report_failed: Callable[[str], Awaitable[None]] | None = None
    """Records the explicit failure receipt of a given-up final save."""
    fenced: str | None = None
    """Why the controller fenced this run off at its final save (a newer run
    holds the lease, or the run ended); the state is then kept for the run
    that holds the sandbox now."""

    def hold_agent_contract(self, scope: str, warnings: Iterable[dict[str, Any]]) -> None:
        """Under the agent folder contract the final save is tried
        :data:`AGENT_FINAL_ATTEMPTS` times and a given-up one is reported
        for ``scope``; the run's agent-folder warnings (a storage limit
        reached by an earlier run) are shown on stderr as the daemon starts."""
        self.attempts, self.report_scope = AGENT_FINAL_ATTEMPTS, scope
        for warning in warnings:
            if warning.get("scope") == "agent":
                print(f"fsagent: warning: {warning.get('message')}", file=sys.stderr)

    def keeps_local_copy(self, contract: bool) -> bool:
        """Whether the state (and, in dir mode, the directory) outlives the
        stop: always, except for the agent folder under its contract once its
        stop boundary was reached, and a fenced run's bytes stay pending."""
        return not (contract and self.final_done) or self.fenced is not None


class HasPending(Protocol):
    def pending_checkpoint(self) -> dict[str, Any] | None: ...


def failure_reporter(
    store: HasPending, client: BridgeClient, scope: str
) -> Callable[[str], Awaitable[None]]:
    """The explicit failure receipt of a given-up final save (the agent folder
    contract), naming the operation id of the request that did not make it."""

    async def report_failed(message: str) -> None:
        pending = store.pending_checkpoint() or {}
        await client.report_state(
            "failed", message, scope=scope, operation_id=pending.get("operationId"), final=True
        )

    return report_failed


async def warm_start(shipper: Checkpoints, take_incoming: TakeIncoming) -> None:
    """Ship what was never checkpointed, then take the server's newer changes."""
    try:
        result = await shipper.ship_checkpoint()
        if result.entries:
            print(f"fsagent: warm start saved {result.entries} earlier change(s)", file=sys.stderr)
    except SaveFailed as exc:
        # The local copy stays authoritative: incoming changes skip every path
        # changed locally anyway, and the error stays visible.
        print(f"fsagent: warm start could not save earlier changes: {exc}", file=sys.stderr)
    applied = await take_incoming()
    if applied:
        print(
            f"fsagent: warm start took {applied} newer change(s) from the server", file=sys.stderr
        )


async def refresh_after_stop(client: BridgeClient, take_incoming: TakeIncoming) -> None:
    """An explicit refresh waits for the run to stop and its final save to succeed."""
    try:
        if not await client.refresh_requested():
            return
        applied = await take_incoming()
        await client.refresh_applied()
        print(f"fsagent: refresh applied ({applied} change(s) from the server)", file=sys.stderr)
    except FsagentError as exc:
        print(f"fsagent: refresh not applied, next start takes the changes: {exc}", file=sys.stderr)


def _saved_line(result: SaveResult) -> str:
    return f"final save: {result.entries} change(s) saved"


async def final_save(
    shipper: Checkpoints | None,
    stop: StopBoundary,
    *,
    kept: str = "state kept",
    saved_line: Callable[[SaveResult], str] = _saved_line,
) -> None:
    """The final save of the stop boundary (once per daemon)."""
    if shipper is None or stop.final_done:
        return
    stop.final_done = True
    recorded = False
    attempt = 0
    for attempt in range(1, stop.attempts + 1):
        try:
            result = await shipper.ship_checkpoint(final=True)
        except SaveFailed as exc:
            stop.saved, stop.error, recorded = False, str(exc), exc.recorded
            stop.fenced = getattr(shipper, "fenced", None)
            stop.limit_warning = limit_warning(exc, stop.report_scope is not None)
            if stop.limit_warning is not None:
                print(f"fsagent: warning: {stop.limit_warning}", file=sys.stderr)
                return  # the controller's refusal is its receipt already
            if exc.refused or attempt == stop.attempts:
                break
            print(
                f"fsagent: final save attempt {attempt} failed, trying again: {exc}",
                file=sys.stderr,
            )
            await trio.sleep(final_pause(attempt))
            continue
        stop.saved, stop.error = True, None
        print(f"fsagent: {saved_line(result)}", file=sys.stderr)
        return
    if stop.fenced is not None:
        print(
            f"fsagent: final save FENCED, state kept for the run that holds the sandbox now: "
            f"{stop.error}",
            file=sys.stderr,
        )
        return
    if stop.report_scope is None:
        print(f"fsagent: final save FAILED, {kept}: {stop.error}", file=sys.stderr)
    else:
        print(f"fsagent: final save FAILED: {stop.error}", file=sys.stderr)
    if recorded or stop.report_failed is None:
        return  # a refused commit is the final save's receipt already
    with trio.move_on_after(30):
        try:
            # The explicit failure receipt, final: the run's status shows the
            # folder stopped with its final save failed.
            await stop.report_failed(
                f"final save given up after {attempt} attempt(s): {stop.error}"
            )
        except FsagentError as report_exc:
            log.warning("could not report the failed final save: %s", report_exc)
