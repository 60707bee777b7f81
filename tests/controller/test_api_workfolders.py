"""The work-folder REST API against a real controller and PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import select
import socket
import time
import uuid
from pathlib import Path

import httpx

from common.limits import MAX_FILE_BYTES, MAX_PREVIEW_BYTES
from tests.support.controller import ControllerProcess, Tenant, parse_api_time

OCTET = {"Content-Type": "application/octet-stream"}


def put(c: httpx.Client, folder: str, path: str, data: bytes, **headers: str) -> httpx.Response:
    return c.put(
        f"{folder}/content", params={"path": path}, content=data, headers={**OCTET, **headers}
    )


def op(c: httpx.Client, folder: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return c.post(f"{folder}/operations", json=body, headers=headers)


def listing(c: httpx.Client, folder: str, **params: str) -> list[dict[str, object]]:
    r = c.get(folder + "/", params=params)
    assert r.status_code == 200, r.text
    entries: list[dict[str, object]] = r.json()["entries"]
    return entries


def live_rows(ctl: ControllerProcess, company: str, path: str) -> list[tuple[object, ...]]:
    with ctl.db() as conn:
        return conn.execute(
            "SELECT f.digest, f.version FROM files f JOIN folders d ON d.id = f.folder_id"
            " WHERE d.company_id = %s AND f.path = %s AND f.deleted_at IS NULL",
            (company, path),
        ).fetchall()


def spool_files(ctl: ControllerProcess) -> list[Path]:
    spool = ctl.data_dir / "spool"
    return list(spool.iterdir()) if spool.exists() else []


def test_put_then_get_round_trip_with_headers(tenant: Tenant) -> None:
    data = os.urandom(300_000)
    with tenant.client() as c:
        r = put(
            c,
            tenant.my_folder,
            "dir/sub/data.bin",
            data,
            **{"X-File-Content-Type": "image/png", "X-File-Executable": "true"},
        )
        assert r.status_code == 201, r.text
        f = r.json()["file"]
        assert f["byteSize"] == len(data)
        assert f["digest"] == hashlib.sha256(data).hexdigest()
        assert f["executable"] is True and f["contentType"] == "image/png"
        # Missing parents were created as directories.
        kinds = {e["path"]: e["kind"] for e in listing(c, tenant.my_folder)}
        assert kinds == {"dir": "directory", "dir/sub": "directory", "dir/sub/data.bin": "file"}
        g = c.get(f"{tenant.my_folder}/content", params={"path": "dir/sub/data.bin"})
        assert g.status_code == 200 and g.content == data
        assert g.headers["content-type"] == "image/png"
        assert g.headers["content-length"] == str(len(data))
        assert g.headers["cache-control"] == "private, no-store"
        assert g.headers["x-content-type-options"] == "nosniff"
        assert g.headers["content-security-policy"] == "sandbox; default-src 'none'"
        assert g.headers["content-disposition"] == "attachment; filename*=UTF-8''data.bin"


def test_bodies_either_side_of_the_in_memory_bound_round_trip(tenant: Tenant) -> None:
    """A body of up to 64 KiB is kept in memory, a longer one spooled: both
    store exactly their bytes once, and neither leaves a spool file."""
    bound = 64 * 1024
    sizes = [0, 1, bound - 1, bound, bound + 1, 3 * bound]
    with tenant.client() as c:
        for size in sizes:
            for kind, data in (("random", os.urandom(size)), ("text", b"line\n" * (size // 5))):
                path = f"bound/{kind}-{size}.bin"
                r = put(c, tenant.my_folder, path, data)
                assert r.status_code == 201, r.text
                assert r.json()["file"]["digest"] == hashlib.sha256(data).hexdigest()
                g = c.get(f"{tenant.my_folder}/content", params={"path": path})
                assert g.status_code == 200 and g.content == data, (path, len(g.content))
                again = put(c, tenant.my_folder, path + ".copy", data)
                assert again.status_code == 201, again.text
                assert again.json()["file"]["digest"] == r.json()["file"]["digest"]
    assert spool_files(tenant.controller) == []


def test_executable_only_when_exactly_true(tenant: Tenant) -> None:
    with tenant.client() as c:
        for value in ("True", "1", "yes", "false"):
            r = put(c, tenant.my_folder, f"x-{value}", b"x", **{"X-File-Executable": value})
            assert r.status_code == 201 and r.json()["file"]["executable"] is False


def test_unicode_name_download_disposition(tenant: Tenant) -> None:
    with tenant.client() as c:
        assert put(c, tenant.my_folder, "résumé ü.txt", b"cv").status_code == 201
        g = c.get(f"{tenant.my_folder}/content", params={"path": "résumé ü.txt"})
        assert g.headers["content-disposition"] == (
            "attachment; filename*=UTF-8''r%C3%A9sum%C3%A9%20%C3%BC.txt"
        )


def test_range_requests(tenant: Tenant) -> None:
    data = bytes(range(256)) * 40
    with tenant.client() as c:
        put(c, tenant.my_folder, "r.bin", data)
        url = f"{tenant.my_folder}/content"
        r = c.get(url, params={"path": "r.bin"}, headers={"Range": "bytes=10-19"})
        assert r.status_code == 206 and r.content == data[10:20]
        assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
        r = c.get(url, params={"path": "r.bin"}, headers={"Range": "bytes=-5"})
        assert r.status_code == 206 and r.content == data[-5:]
        r = c.get(url, params={"path": "r.bin"}, headers={"Range": "bytes=10000-"})
        assert r.status_code == 206 and r.content == data[10000:]
        r = c.get(url, params={"path": "r.bin"}, headers={"Range": f"bytes={len(data)}-"})
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
        assert r.json()["code"] == "range_not_satisfiable"


def test_content_errors(tenant: Tenant) -> None:
    with tenant.client() as c:
        put(c, tenant.my_folder, "d/f", b"1")
        r = c.get(f"{tenant.my_folder}/content", params={"path": "missing"})
        assert r.status_code == 404 and r.json()["code"] == "file_not_found"
        r = c.get(f"{tenant.my_folder}/content", params={"path": "d"})
        assert r.status_code == 400 and r.json()["code"] == "is_directory"
        r = c.put(
            f"{tenant.my_folder}/content",
            params={"path": "t.txt"},
            content=b"x",
            headers={"Content-Type": "text/plain"},
        )
        assert r.status_code == 400 and r.json()["error"] == "Validation error"
        r = put(c, tenant.my_folder, "t.txt", b"x", **{"X-File-Content-Type": "a" * 257})
        assert r.status_code == 400
        r = put(c, tenant.my_folder, "t.txt", b"x", **{"Idempotency-Key": "k" * 257})
        assert r.status_code == 400
        assert listing(c, tenant.my_folder, dir="") == listing(c, tenant.my_folder, dir="")
        assert [e["path"] for e in listing(c, tenant.my_folder)] == ["d", "d/f"]


def test_preview_limit(tenant: Tenant) -> None:
    with tenant.client() as c:
        put(c, tenant.my_folder, "small.txt", b"hello")
        r = c.get(f"{tenant.my_folder}/content", params={"path": "small.txt", "preview": "true"})
        assert r.status_code == 200 and r.content == b"hello"
        big = b"\0" * (MAX_PREVIEW_BYTES + 1)
        put(c, tenant.my_folder, "big.bin", big)
        r = c.get(f"{tenant.my_folder}/content", params={"path": "big.bin", "preview": "true"})
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
        r = c.get(f"{tenant.my_folder}/content", params={"path": "big.bin"})
        assert r.status_code == 200 and len(r.content) == len(big)


def test_idempotent_retry_and_conflicting_reuse(tenant: Tenant) -> None:
    with tenant.client() as c:
        key = {"Idempotency-Key": "op-1"}
        first = put(c, tenant.my_folder, "a.txt", b"one", **key)
        assert first.status_code == 201 and first.json()["applied"] is True
        again = put(c, tenant.my_folder, "a.txt", b"one", **key)
        assert again.status_code == 200 and again.json()["applied"] is False
        assert again.json()["file"]["version"] == first.json()["file"]["version"]
        other = put(c, tenant.my_folder, "a.txt", b"two", **key)
        assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
        assert c.get(f"{tenant.my_folder}/content", params={"path": "a.txt"}).content == b"one"
        # Operations honour keys as well.
        k2 = {"Idempotency-Key": "op-2"}
        assert op(c, tenant.my_folder, {"action": "mkdir", "path": "m"}, **k2).json()["applied"]
        assert (
            op(c, tenant.my_folder, {"action": "mkdir", "path": "m"}, **k2).json()["applied"]
            is False
        )
        r = op(c, tenant.my_folder, {"action": "delete", "path": "m"}, **k2)
        assert r.status_code == 409


def test_stale_retry_cannot_overwrite_newer_content(tenant: Tenant) -> None:
    with tenant.client() as c:
        assert put(c, tenant.my_folder, "f", b"old", **{"Idempotency-Key": "A"}).status_code == 201
        assert put(c, tenant.my_folder, "f", b"new", **{"Idempotency-Key": "B"}).status_code == 200
        # The response to A was "lost"; the client retries A.
        retry = put(c, tenant.my_folder, "f", b"old", **{"Idempotency-Key": "A"})
        assert retry.status_code == 200 and retry.json()["applied"] is False
        assert c.get(f"{tenant.my_folder}/content", params={"path": "f"}).content == b"new"


def test_versions_increase_and_last_write_wins(tenant: Tenant) -> None:
    with tenant.client() as c:
        versions = [
            put(c, tenant.my_folder, "v", str(i).encode()).json()["file"]["version"]
            for i in range(5)
        ]
        assert versions == sorted(versions) and len(set(versions)) == 5
        assert c.get(f"{tenant.my_folder}/content", params={"path": "v"}).content == b"4"


def test_concurrent_writes_leave_one_current_row(tenant: Tenant) -> None:
    payloads = [f"writer-{i}".encode() * 100 for i in range(12)]

    def write(data: bytes) -> int:
        with tenant.client() as c:
            r = put(c, tenant.my_folder, "hot/path.txt", data)
            assert r.status_code in (200, 201), r.text
            return int(r.json()["file"]["version"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(write, payloads))
    rows = live_rows(tenant.controller, tenant.company_id, "hot/path.txt")
    assert len(rows) == 1
    digest, version = rows[0]
    assert version == max(versions)
    winner = payloads[versions.index(max(versions))]
    assert digest == hashlib.sha256(winner).hexdigest()
    with tenant.client() as c:
        assert (
            c.get(f"{tenant.my_folder}/content", params={"path": "hot/path.txt"}).content == winner
        )


def test_parent_file_child_file_race(tenant: Tenant) -> None:
    for attempt in range(6):
        base = f"race{attempt}"

        def write(path: str, data: bytes) -> int:
            with tenant.client() as c:
                return put(c, tenant.my_folder, path, data).status_code

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(write, base, b"file")
            b = pool.submit(write, f"{base}/child", b"child")
            codes = sorted([a.result(), b.result()])
        assert codes == [201, 409]
        with tenant.client() as c:
            paths = {
                e["path"]: e["kind"]
                for e in listing(c, tenant.my_folder)
                if str(e["path"]).startswith(base)
            }
        assert paths in ({base: "file"}, {base: "directory", f"{base}/child": "file"})


def test_kind_changes_are_conflicts(tenant: Tenant) -> None:
    with tenant.client() as c:
        put(c, tenant.my_folder, "f", b"x")
        op(c, tenant.my_folder, {"action": "mkdir", "path": "d"})
        r = put(c, tenant.my_folder, "d", b"x")
        assert r.status_code == 409 and r.json()["code"] == "kind_conflict"
        r = op(c, tenant.my_folder, {"action": "mkdir", "path": "f"})
        assert r.status_code == 409 and r.json()["code"] == "kind_conflict"
        r = put(c, tenant.my_folder, "f/child", b"x")
        assert r.status_code == 409 and r.json()["code"] == "parent_is_file"
        r = op(c, tenant.my_folder, {"action": "mkdir", "path": "f/sub/deeper"})
        assert r.status_code == 409 and r.json()["code"] == "parent_is_file"
        assert sorted(e["path"] for e in listing(c, tenant.my_folder)) == ["d", "f"]


def test_subtree_delete_restore_and_collision(tenant: Tenant) -> None:
    with tenant.client() as c:
        for p in ("proj/a.txt", "proj/src/b.txt", "proj/src/c.txt", "other.txt"):
            put(c, tenant.my_folder, p, p.encode())
        r = op(c, tenant.my_folder, {"action": "delete", "path": "proj"})
        assert r.status_code == 200
        trashed = r.json()["files"]
        assert {f["path"] for f in trashed} == {
            "proj",
            "proj/a.txt",
            "proj/src",
            "proj/src/b.txt",
            "proj/src/c.txt",
        }
        assert len({f["deletedAt"] for f in trashed}) == 1
        assert [e["path"] for e in listing(c, tenant.my_folder)] == ["other.txt"]
        trash = listing(c, tenant.my_folder, trash="true")
        assert {e["path"] for e in trash} == {f["path"] for f in trashed}
        root_id = next(f["id"] for f in trashed if f["path"] == "proj")

        # Occupy the path: restore must refuse and change nothing.
        put(c, tenant.my_folder, "proj/src/b.txt", b"squatter")
        r = op(c, tenant.my_folder, {"action": "restore", "fileId": root_id})
        assert r.status_code == 409 and r.json()["code"] == "restore_collision"
        assert (
            c.get(f"{tenant.my_folder}/content", params={"path": "proj/src/b.txt"}).content
            == b"squatter"
        )
        assert len(listing(c, tenant.my_folder, trash="true")) == 5

        op(c, tenant.my_folder, {"action": "delete", "path": "proj"})
        r = op(c, tenant.my_folder, {"action": "restore", "fileId": root_id})
        assert r.status_code == 200, r.text
        assert {f["path"] for f in r.json()["files"]} == {f["path"] for f in trashed}
        g = c.get(f"{tenant.my_folder}/content", params={"path": "proj/src/c.txt"})
        assert g.content == b"proj/src/c.txt"
        unknown = op(c, tenant.my_folder, {"action": "restore", "fileId": str(uuid.uuid4())})
        assert unknown.status_code == 404


def test_delete_missing_is_404(tenant: Tenant) -> None:
    with tenant.client() as c:
        r = op(c, tenant.my_folder, {"action": "delete", "path": "nope"})
        assert r.status_code == 404 and r.json()["code"] == "file_not_found"


def test_subtree_delete_does_not_touch_prefix_siblings(tenant: Tenant) -> None:
    with tenant.client() as c:
        for p in ("a/x", "ab/y", "a_b/z", "a%/w"):
            put(c, tenant.my_folder, p, b"1")
        op(c, tenant.my_folder, {"action": "delete", "path": "a"})
        assert sorted(e["path"] for e in listing(c, tenant.my_folder)) == [
            "a%",
            "a%/w",
            "a_b",
            "a_b/z",
            "ab",
            "ab/y",
        ]


def test_purge_then_gc_removes_object_but_never_a_referenced_one(tenant: Tenant) -> None:
    ctl = tenant.controller
    shared, lonely = os.urandom(1000), os.urandom(1000)
    with tenant.client() as c:
        put(c, tenant.my_folder, "keep/shared.bin", shared)
        put(c, tenant.my_folder, "gone/shared-copy.bin", shared)
        put(c, tenant.my_folder, "gone/lonely.bin", lonely)
        trashed = op(c, tenant.my_folder, {"action": "delete", "path": "gone"}).json()["files"]
        root = next(f["id"] for f in trashed if f["path"] == "gone")
        # Trash still references its objects: a sweep must keep them.
        ctl.gc_now()
        lonely_key = ctl.data_dir / "objects" / "objects" / tenant.company_id
        assert any(p.name == hashlib.sha256(lonely).hexdigest() for p in lonely_key.rglob("*"))
        r = op(c, tenant.my_folder, {"action": "purge", "fileId": root})
        assert r.status_code == 200 and r.json()["purged"] == 3
        assert listing(c, tenant.my_folder, trash="true") == []
    report = ctl.gc_now()
    assert report["deleted"] >= 1
    names = {p.name for p in (ctl.data_dir / "objects").rglob("*") if p.is_file()}
    assert hashlib.sha256(lonely).hexdigest() not in names
    assert hashlib.sha256(shared).hexdigest() in names
    with tenant.client() as c:
        g = c.get(f"{tenant.my_folder}/content", params={"path": "keep/shared.bin"})
        assert g.status_code == 200 and g.content == shared


def test_superseded_object_is_collected_and_rewrite_after_gc_works(tenant: Tenant) -> None:
    ctl = tenant.controller
    v1, v2 = b"version one" * 10, b"version two" * 10
    with tenant.client() as c:
        put(c, tenant.my_folder, "doc", v1)
        put(c, tenant.my_folder, "doc", v2)
        # The replaced content is kept in the trash, so GC leaves it alone...
        ctl.gc_now()
        names = {p.name for p in (ctl.data_dir / "objects").rglob("*") if p.is_file()}
        assert hashlib.sha256(v1).hexdigest() in names
        # ...until that trash entry is purged.
        (kept,) = listing(c, tenant.my_folder, trash="true")
        r = op(c, tenant.my_folder, {"action": "purge", "fileId": str(kept["id"])})
        assert r.status_code == 200, r.text
        ctl.gc_now()
        names = {p.name for p in (ctl.data_dir / "objects").rglob("*") if p.is_file()}
        assert hashlib.sha256(v1).hexdigest() not in names
        assert hashlib.sha256(v2).hexdigest() in names
        # The collected content can be written again: the object comes back.
        put(c, tenant.my_folder, "doc-again", v1)
        assert c.get(f"{tenant.my_folder}/content", params={"path": "doc-again"}).content == v1


def test_pagination_is_stable_and_complete(tenant: Tenant) -> None:
    with tenant.client() as c:
        for i in range(25):
            op(c, tenant.my_folder, {"action": "mkdir", "path": f"d{i:02d}"})
        seen: list[str] = []
        cursor = None
        while True:
            params = {"limit": "7", **({"cursor": cursor} if cursor else {})}
            body = c.get(tenant.my_folder + "/", params=params).json()
            seen += [e["path"] for e in body["entries"]]
            cursor = body["nextCursor"]
            if cursor is None:
                break
        assert seen == [f"d{i:02d}" for i in range(25)]
        for bad in (
            {"limit": "0"},
            {"limit": "1001"},
            {"limit": "x"},
            {"cursor": "!!"},
            {"trash": "yes"},
        ):
            r = c.get(tenant.my_folder + "/", params=bad)
            assert r.status_code == 400, bad
            assert r.json()["error"] == "Validation error"


def test_trash_pagination(tenant: Tenant) -> None:
    with tenant.client() as c:
        for i in range(5):
            put(c, tenant.my_folder, f"t{i}", b"x")
            op(c, tenant.my_folder, {"action": "delete", "path": f"t{i}"})
        pages, cursor = [], None
        while True:
            params = {"trash": "true", "limit": "2", **({"cursor": cursor} if cursor else {})}
            body = c.get(tenant.my_folder + "/", params=params).json()
            pages += [e["path"] for e in body["entries"]]
            cursor = body["nextCursor"]
            if cursor is None:
                break
        assert pages == [f"t{i}" for i in reversed(range(5))]


def test_dir_listing(tenant: Tenant) -> None:
    with tenant.client() as c:
        for p in ("a/1", "a/2", "a/b/3", "top"):
            put(c, tenant.my_folder, p, b"x")
        assert [e["path"] for e in listing(c, tenant.my_folder, dir="")] == ["a", "top"]
        assert [e["path"] for e in listing(c, tenant.my_folder, dir="a")] == ["a/1", "a/2", "a/b"]


def test_interrupted_upload_publishes_nothing(tenant: Tenant) -> None:
    ctl = tenant.controller
    path = f"{tenant.my_folder}/content?path=partial.bin"
    with socket.create_connection(("127.0.0.1", ctl.port)) as s:
        s.sendall(
            f"PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenant.token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {10 << 20}\r\n\r\n".encode()
        )
        s.sendall(os.urandom(1 << 20))
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while spool_files(ctl) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spool_files(ctl) == []
    with tenant.client() as c:
        assert (
            c.get(f"{tenant.my_folder}/content", params={"path": "partial.bin"}).status_code == 404
        )
        assert listing(c, tenant.my_folder) == []


def test_oversize_upload_rejected_early_and_publishes_nothing(tenant: Tenant) -> None:
    ctl = tenant.controller
    with tenant.client() as c:
        # Declared too large: answered 413 before a single body byte is sent.
        with socket.create_connection(("127.0.0.1", ctl.port), timeout=10) as s:
            s.sendall(
                f"PUT {tenant.my_folder}/content?path=huge HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {tenant.token}\r\n"
                f"Content-Type: application/octet-stream\r\n"
                f"Content-Length: {MAX_FILE_BYTES + 1}\r\n\r\n".encode()
            )
            head = ""
            while "payload_too_large" not in head:
                more = s.recv(65536).decode("latin-1")
                if not more:
                    break
                head += more
        assert head.startswith("HTTP/1.1 413"), head
        assert "payload_too_large" in head

        # Streamed without a length: refused once the limit is crossed. A raw socket,
        # because the server may close the connection as soon as it answers 413: an
        # HTTP client still writing the body would then raise before it ever saw the
        # status. Here the body stops as soon as the answer is readable, and the
        # answer is always read and checked.
        sent = 0
        chunk = b"\0" * (4 << 20)
        frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        with socket.create_connection(("127.0.0.1", ctl.port), timeout=60) as s:
            s.sendall(
                f"PUT {tenant.my_folder}/content?path=huge HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {tenant.token}\r\n"
                f"Content-Type: application/octet-stream\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n".encode()
            )
            while sent <= MAX_FILE_BYTES + len(chunk):
                if select.select([s], [], [], 0)[0]:
                    break  # the answer is there: stop sending
                try:
                    s.sendall(frame)
                except (BrokenPipeError, ConnectionResetError):
                    break  # closed after answering; the answer is still in our buffer
                sent += len(chunk)
            answer = b""
            with contextlib.suppress(ConnectionResetError):
                while b"payload_too_large" not in answer and (more := s.recv(65536)):
                    answer += more
        head = answer.decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head[:500]
        assert "payload_too_large" in head, head[:500]
        assert sent <= MAX_FILE_BYTES + 3 * len(chunk)
        assert c.get(f"{tenant.my_folder}/content", params={"path": "huge"}).status_code == 404
        assert listing(c, tenant.my_folder) == []
    assert spool_files(ctl) == []


def test_sync_and_refresh_without_runs(tenant: Tenant) -> None:
    with tenant.client() as c:
        r = c.get(f"{tenant.my_folder}/sync")
        assert r.status_code == 200 and r.json() == {"runs": [], "lastOperationAt": None}
        r = c.post(f"{tenant.my_folder}/refresh", json={"runId": str(uuid.uuid4())})
        assert r.status_code == 404 and r.json()["code"] == "run_not_found"
        r = c.post(f"{tenant.my_folder}/refresh", json={"runId": "nope"})
        assert r.status_code == 400


def test_last_operation_at_tracks_direct_operations(tenant: Tenant) -> None:
    with tenant.client() as c:
        assert c.get(tenant.my_folder + "/").json()["lastOperationAt"] is None
        put(c, tenant.my_folder, "x", b"1")
        first = c.get(tenant.my_folder + "/").json()["lastOperationAt"]
        assert first is not None
        time.sleep(0.01)
        op(c, tenant.my_folder, {"action": "delete", "path": "x"})
        later = c.get(tenant.my_folder + "/").json()["lastOperationAt"]
        # Parsed, not compared as strings: "12:00:05Z" (microseconds 0) sorts after
        # "12:00:05.000100Z".
        assert parse_api_time(later) > parse_api_time(first), (first, later)


def test_a_put_answers_the_entry_as_stored(tenant: Tenant) -> None:
    """A new file under new folders, an overwrite with new bytes and one with
    the same bytes and a new mode, each without and with an Idempotency-Key
    (the PUT writes its row without reading it back in the first case, reads
    it in the second): every answer is the entry as the listing shows it."""
    with tenant.client() as c:
        for n, keyed in enumerate((False, True)):
            path = f"answers{n}/deep/f.txt"
            steps = [(b"one", {}), (b"two", {}), (b"two", {"X-File-Executable": "true"})]
            for i, (data, headers) in enumerate(steps):
                if keyed:
                    headers = {**headers, "Idempotency-Key": f"answer-{n}-{i}"}
                r = put(c, tenant.my_folder, path, data, **headers)
                assert r.status_code == (201 if i == 0 else 200), r.text
                answered = r.json()["file"]
                listed = {e["path"]: e for e in listing(c, tenant.my_folder)}
                assert answered == listed[path], (keyed, i)
                assert answered["digest"] == hashlib.sha256(data).hexdigest()
            versions = [listed[p]["version"] for p in (f"answers{n}", f"answers{n}/deep", path)]
            assert versions == sorted(versions) and len(set(versions)) == 3


def test_a_replayed_put_whose_bytes_were_swept_leaves_no_orphan(tenant: Tenant) -> None:
    """A PUT replayed (same Idempotency-Key) after its file was purged and its
    object swept stores the bytes again, writes nothing, and answers the
    first answer; the bytes it stored are collected like any orphan."""
    ctl = tenant.controller
    data = os.urandom(1000)
    digest = hashlib.sha256(data).hexdigest()
    key = {"Idempotency-Key": "replayed-after-a-sweep"}

    def stored() -> bool:
        return any(p.name == digest for p in (ctl.data_dir / "objects").rglob("*"))

    with tenant.client() as c:
        first = put(c, tenant.my_folder, "once/f.bin", data, **key)
        assert first.status_code == 201, first.text
        trashed = op(c, tenant.my_folder, {"action": "delete", "path": "once"}).json()["files"]
        root = next(f["id"] for f in trashed if f["path"] == "once")
        assert op(c, tenant.my_folder, {"action": "purge", "fileId": root}).status_code == 200
        ctl.gc_now()
        assert not stored()
        again = put(c, tenant.my_folder, "once/f.bin", data, **key)
        assert again.status_code == 200 and again.json()["applied"] is False, again.text
        assert again.json()["file"] == first.json()["file"]
        assert stored()  # the replay's body, stored before the receipt was found
        assert listing(c, tenant.my_folder) == []
    ctl.gc_now()
    assert not stored()
