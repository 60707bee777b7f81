"""What a person's upload over an existing file must respect and keep.

``If-None-Match: *`` and ``If-Match`` (HTTP's conditions: 412 when they do
not hold) and ``X-Base-Digest`` (the Files page editor's base version: 409
``stale_save`` when it is stale) are checked under the
folder lock,
inside the transaction that writes, so no other writer can slip in between
the check and the write. A replaced file's previous content is not lost: it
goes to the trash as an entry of its own, in the same transaction, and can be
restored (under another name while the path is taken) until it is purged.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import AsyncConnection

from common.errors import PreconditionFailed, StaleSave, ValidationError

if TYPE_CHECKING:
    from controller.foldercore import Folder

Row = dict[str, Any]

_ETAG = re.compile(r'^"([0-9a-f]{64})"$')
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
BASE_NONE = "none"
"""``X-Base-Digest: none``: the editor read no file at the path."""


@dataclass(frozen=True)
class Precondition:
    """``exists``: True (``If-Match: *``), False (``If-None-Match: *``) or None;
    ``digest``: the file must currently have this content (``If-Match: "<digest>"``)."""

    exists: bool | None = None
    digest: str | None = None
    editor_base: bool = False
    """Sent as the editor's ``X-Base-Digest``: a stale one is 409 ``stale_save``."""


def parse_precondition(
    if_match: str | None, if_none_match: str | None, base_digest: str | None = None
) -> Precondition | None:
    if (if_match is not None) + (if_none_match is not None) + (base_digest is not None) > 1:
        raise ValidationError.single(
            "If-Match",
            "invalid_precondition",
            "send one of If-Match, If-None-Match and X-Base-Digest",
        )
    if base_digest is not None:
        value = base_digest.strip()
        if value == BASE_NONE:
            return Precondition(exists=False, editor_base=True)
        if _DIGEST.match(value) is None:
            raise ValidationError.single(
                "X-Base-Digest",
                "invalid_precondition",
                "X-Base-Digest must be the SHA-256 the editor read (64 hex digits) or none",
            )
        return Precondition(digest=value, editor_base=True)
    if if_none_match is not None:
        if if_none_match.strip() != "*":
            raise ValidationError.single(
                "If-None-Match", "invalid_precondition", "If-None-Match must be *"
            )
        return Precondition(exists=False)
    if if_match is not None:
        value = if_match.strip()
        if value == "*":
            return Precondition(exists=True)
        m = _ETAG.match(value)
        if m is None:
            raise ValidationError.single(
                "If-Match",
                "invalid_precondition",
                'If-Match must be * or the quoted SHA-256 ETag ("<64 hex digits>")',
            )
        return Precondition(digest=m.group(1))
    return None


def check_precondition(existing: Row | None, path: str, pre: Precondition | None) -> None:
    """PreconditionFailed (StaleSave for the editor's base) unless the entry
    now at ``path`` satisfies ``pre``."""
    if pre is None:
        return
    current = None if existing is None else existing["digest"]
    held = (
        (pre.exists is False and existing is not None)
        or (pre.exists is True and existing is None)
        or (pre.digest is not None and current != pre.digest)
    )
    if held:
        detail: dict[str, Any] = {"path": path, "exists": existing is not None}
        if current is not None:
            detail["digest"] = current
        raise (StaleSave if pre.editor_base else PreconditionFailed)(details=[detail])


async def keep_replaced(
    conn: AsyncConnection[Any], folder: Folder, existing: Row | None, digest: str
) -> None:
    """Put a copy of the file about to be replaced in the trash (a batch of its own).

    Nothing is kept when there is no file or its content stays the same. The
    copy keeps the replaced row's version, which the live row gives up: a run
    that already has that version is not told about a deletion that never
    happened at a live path (the live row's new version says what changed).
    """
    if existing is None or existing["kind"] != "file" or existing["digest"] == digest:
        return
    copy_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO files (id, folder_id, path, parent, kind, digest, byte_size, executable,"
        " content_type, version, updated_at, deleted_at, trash_root)"
        " VALUES (%s, %s, %s, %s, 'file', %s, %s, %s, %s, %s, %s, now(), %s)",
        (
            copy_id,
            folder.id,
            existing["path"],
            existing["parent"],
            existing["digest"],
            existing["byte_size"],
            existing["executable"],
            existing["content_type"],
            existing["version"],
            existing["updated_at"],
            copy_id,
        ),
    )
