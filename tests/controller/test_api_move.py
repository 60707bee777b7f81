"""Rename and move, restore under another name, conditional uploads, kept
overwrites, listing totals and filters, and "changes since", against a real
controller and PostgreSQL."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx

from tests.controller.test_api_workfolders import op, put
from tests.support.bridge import start_run
from tests.support.controller import Tenant


def entries(c: httpx.Client, folder: str, **params: str) -> list[dict[str, Any]]:
    r = c.get(folder + "/", params={"limit": "1000", **params})
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()["entries"]
    return found


def live(c: httpx.Client, folder: str) -> dict[str, dict[str, Any]]:
    return {e["path"]: e for e in entries(c, folder)}


def content(c: httpx.Client, folder: str, path: str) -> bytes:
    r = c.get(f"{folder}/content", params={"path": path})
    assert r.status_code == 200, r.text
    return r.content


def test_move_renames_a_file_and_keeps_its_id_and_bytes(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        created = put(c, f, "a.txt", b"alpha").json()["file"]
        r = op(c, f, {"action": "move", "path": "a.txt", "to": "notes/b.txt"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["applied"] is True
        assert [e["path"] for e in body["files"]] == ["notes/b.txt"]
        now = live(c, f)
        assert set(now) == {"notes", "notes/b.txt"}
        assert now["notes/b.txt"]["id"] == created["id"]
        assert now["notes/b.txt"]["version"] > created["version"]
        assert content(c, f, "notes/b.txt") == b"alpha"
        assert c.get(f"{f}/content", params={"path": "a.txt"}).status_code == 404
        # Nothing went to the trash.
        assert entries(c, f, trash="true") == []


def test_move_a_directory_subtree_in_one_transaction(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "src/x.txt", b"x")
        put(c, f, "src/deep/y.txt", b"y")
        r = op(c, f, {"action": "move", "path": "src", "to": "dst/inner"})
        assert r.status_code == 200, r.text
        assert [e["path"] for e in r.json()["files"]] == [
            "dst/inner",
            "dst/inner/deep",
            "dst/inner/deep/y.txt",
            "dst/inner/x.txt",
        ]
        now = live(c, f)
        assert sorted(now) == [
            "dst",
            "dst/inner",
            "dst/inner/deep",
            "dst/inner/deep/y.txt",
            "dst/inner/x.txt",
        ]
        assert now["dst/inner/deep"]["kind"] == "directory"
        assert content(c, f, "dst/inner/deep/y.txt") == b"y"
        # Listings by directory see the new parents.
        assert [e["path"] for e in entries(c, f, dir="dst/inner")] == [
            "dst/inner/deep",
            "dst/inner/x.txt",
        ]
        assert entries(c, f, dir="src") == []


def test_move_conflicts_are_409_and_change_nothing(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "d/a.txt", b"a")
        put(c, f, "b.txt", b"b")
        put(c, f, "file", b"f")
        before = live(c, f)

        r = op(c, f, {"action": "move", "path": "d/a.txt", "to": "b.txt"})
        assert r.status_code == 409 and r.json()["code"] == "target_exists"
        r = op(c, f, {"action": "move", "path": "d", "to": "d/sub"})
        assert r.status_code == 409 and r.json()["code"] == "move_into_itself"
        r = op(c, f, {"action": "move", "path": "d", "to": "d"})
        assert r.status_code == 409 and r.json()["code"] == "target_exists"
        r = op(c, f, {"action": "move", "path": "b.txt", "to": "file/inside.txt"})
        assert r.status_code == 409 and r.json()["code"] == "parent_is_file"
        r = op(c, f, {"action": "move", "path": "missing", "to": "x"})
        assert r.status_code == 404 and r.json()["code"] == "file_not_found"
        r = op(c, f, {"action": "move", "path": "b.txt", "to": "/abs"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_path"
        r = op(c, f, {"action": "move", "path": "b.txt", "to": 7})
        assert r.status_code == 400 and r.json()["code"] == "validation_error"
        r = op(c, f, {"action": "move", "path": "b.txt"})
        assert r.status_code == 400 and r.json()["details"][0]["field"] == "to"
        assert live(c, f) == before


def test_move_past_the_depth_limit_is_refused_whole(tenant: Tenant) -> None:
    f = tenant.my_folder
    deep = "/".join(["s"] * 60)
    with tenant.client() as c:
        put(c, f, f"top/{deep}/leaf", b"1")
        before = live(c, f)
        target = "/".join(["t"] * 10)
        r = op(c, f, {"action": "move", "path": "top", "to": target})
        assert r.status_code == 400 and r.json()["details"][0]["code"] == "too_deep"
        assert live(c, f) == before


def test_move_is_idempotent_with_its_key(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "one.txt", b"1")
        body = {"action": "move", "path": "one.txt", "to": "two.txt"}
        first = op(c, f, body, **{"Idempotency-Key": "mv-1"})
        assert first.status_code == 200 and first.json()["applied"] is True
        # Someone puts a new one.txt; the retried move must not move it.
        put(c, f, "one.txt", b"new")
        again = op(c, f, body, **{"Idempotency-Key": "mv-1"})
        assert again.status_code == 200 and again.json()["applied"] is False
        assert again.json()["files"] == first.json()["files"]
        assert content(c, f, "one.txt") == b"new" and content(c, f, "two.txt") == b"1"
        other = op(c, f, {**body, "to": "three.txt"}, **{"Idempotency-Key": "mv-1"})
        assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"


def test_a_run_sees_a_move_as_the_old_path_gone_and_the_new_one_there(tenant: Tenant) -> None:
    run = start_run(tenant)
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "d/a.txt", b"a")
    with run.client() as b:
        since = b.get("/folders/user/manifest", params={"since": 0}).json()["highWater"]
    with tenant.client() as c:
        assert op(c, f, {"action": "move", "path": "d", "to": "e"}).status_code == 200
    with run.client() as b:
        page = b.get("/folders/user/manifest", params={"since": since}).json()
    seen = [(e["path"], e["deleted"]) for e in page["entries"]]
    # Old paths leave first (lower versions), then the new ones appear.
    assert seen == [("d", True), ("d/a.txt", True), ("e", False), ("e/a.txt", False)]
    versions = [e["version"] for e in page["entries"]]
    assert versions == sorted(versions) and page["highWater"] == versions[-1]


def test_restore_as_another_name_after_a_collision(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "docs/a.txt", b"old a")
        put(c, f, "docs/b.txt", b"old b")
        deleted = op(c, f, {"action": "delete", "path": "docs"}).json()["files"]
        root = next(e for e in deleted if e["path"] == "docs")
        put(c, f, "docs/a.txt", b"new a")
        r = op(c, f, {"action": "restore", "fileId": root["id"]})
        assert r.status_code == 409 and r.json()["code"] == "restore_collision"
        # Another name that is also taken collides the same way.
        r = op(c, f, {"action": "restore", "fileId": root["id"], "to": "docs"})
        assert r.status_code == 409 and r.json()["code"] == "restore_collision"
        r = op(c, f, {"action": "restore", "fileId": root["id"], "to": "old/docs (restored)"})
        assert r.status_code == 200, r.text
        assert [e["path"] for e in r.json()["files"]] == [
            "old/docs (restored)",
            "old/docs (restored)/a.txt",
            "old/docs (restored)/b.txt",
        ]
        assert content(c, f, "old/docs (restored)/a.txt") == b"old a"
        assert content(c, f, "docs/a.txt") == b"new a"
        assert entries(c, f, trash="true") == []
        r = op(c, f, {"action": "restore", "fileId": root["id"], "to": 5})
        assert r.status_code == 400


def test_if_none_match_refuses_to_replace_and_if_match_checks_the_digest(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        r = put(c, f, "n.txt", b"first", **{"If-None-Match": "*"})
        assert r.status_code == 201, r.text
        digest = r.json()["file"]["digest"]
        r = put(c, f, "n.txt", b"second", **{"If-None-Match": "*"})
        assert r.status_code == 412 and r.json()["code"] == "precondition_failed"
        assert r.json()["details"] == [{"path": "n.txt", "exists": True, "digest": digest}]
        assert content(c, f, "n.txt") == b"first"
        # If-Match with a stale digest: 412; with the current one: replaced.
        stale = '"' + hashlib.sha256(b"other").hexdigest() + '"'
        r = put(c, f, "n.txt", b"second", **{"If-Match": stale})
        assert r.status_code == 412 and content(c, f, "n.txt") == b"first"
        r = put(c, f, "n.txt", b"second", **{"If-Match": f'"{digest}"'})
        assert r.status_code == 200 and content(c, f, "n.txt") == b"second"
        # If-Match: * needs an existing file.
        r = put(c, f, "absent.txt", b"x", **{"If-Match": "*"})
        assert r.status_code == 412
        assert c.get(f"{f}/content", params={"path": "absent.txt"}).status_code == 404
        for headers in (
            {"If-None-Match": "abc"},
            {"If-Match": "abc"},
            {"If-Match": "*", "If-None-Match": "*"},
        ):
            r = put(c, f, "n.txt", b"third", **headers)
            assert r.status_code == 400 and r.json()["details"][0]["code"] == "invalid_precondition"
        assert content(c, f, "n.txt") == b"second"


def test_a_replaced_files_old_content_is_kept_in_the_trash(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "r.txt", b"version one", **{"X-File-Content-Type": "text/plain"})
        assert put(c, f, "r.txt", b"version two").status_code == 200
        # The same bytes again keep nothing new.
        assert put(c, f, "r.txt", b"version two").status_code == 200
        trash = entries(c, f, trash="true")
        assert [(e["path"], e["byteSize"], e["contentType"]) for e in trash] == [
            ("r.txt", len(b"version one"), "text/plain")
        ]
        old = trash[0]
        assert old["trashRoot"] == old["id"]
        assert old["digest"] == hashlib.sha256(b"version one").hexdigest()
        # Restoring over the live file collides; restoring as another name works.
        r = op(c, f, {"action": "restore", "fileId": old["id"]})
        assert r.status_code == 409
        r = op(c, f, {"action": "restore", "fileId": old["id"], "to": "r (1).txt"})
        assert r.status_code == 200, r.text
        assert content(c, f, "r (1).txt") == b"version one"
        assert content(c, f, "r.txt") == b"version two"


def test_listing_total_and_name_filter(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        for name in ("Report-2024.txt", "report_final.md", "notes.txt", "100%.txt", "a_b"):
            put(c, f, f"docs/{name}", b"x")
        put(c, f, "report-top.txt", b"x")
        r = c.get(f + "/", params={"dir": "docs", "limit": "2"})
        assert r.json()["total"] == 5 and len(r.json()["entries"]) == 2
        r = c.get(f + "/", params={"dir": "docs", "name": "REPORT"})
        assert [e["path"] for e in r.json()["entries"]] == [
            "docs/Report-2024.txt",
            "docs/report_final.md",
        ]
        assert r.json()["total"] == 2
        # '%' and '_' are plain characters, and the directory part never matches.
        r = c.get(f + "/", params={"dir": "docs", "name": "%"})
        assert [e["path"] for e in r.json()["entries"]] == ["docs/100%.txt"]
        r = c.get(f + "/", params={"dir": "docs", "name": "_"})
        assert [e["path"] for e in r.json()["entries"]] == ["docs/a_b", "docs/report_final.md"]
        r = c.get(f + "/", params={"dir": "docs", "name": "docs"})
        assert r.json()["entries"] == [] and r.json()["total"] == 0
        # The filter pages with the usual keyset cursor.
        r = c.get(f + "/", params={"name": "report", "limit": "1"})
        first = r.json()
        assert first["total"] == 3 and first["nextCursor"]
        seen = [e["path"] for e in first["entries"]]
        cursor = first["nextCursor"]
        while cursor:
            page = c.get(f + "/", params={"name": "report", "limit": "1", "cursor": cursor}).json()
            seen += [e["path"] for e in page["entries"]]
            cursor = page["nextCursor"]
        assert seen == ["docs/Report-2024.txt", "docs/report_final.md", "report-top.txt"]
        for bad in ("x" * 256, "a\x01"):
            r = c.get(f + "/", params={"name": bad})
            assert r.status_code == 400
            assert r.json()["details"][0]["code"] == "invalid_name_filter"


def test_changes_since_is_cheap_and_per_directory(tenant: Tenant) -> None:
    f = tenant.my_folder
    with tenant.client() as c:
        empty = c.get(f + "/changes", params={"since": "0"}).json()
        assert empty == {"version": 0, "changed": False}
        put(c, f, "a/one.txt", b"1")
        put(c, f, "b/two.txt", b"2")
        v = c.get(f + "/changes", params={"since": "0"}).json()["version"]
        assert v > 0
        # A listing says which version it shows, to poll from.
        assert c.get(f + "/", params={"dir": "a"}).json()["version"] == v
        assert c.get(f + "/changes", params={"since": str(v)}).json() == {
            "version": v,
            "changed": False,
        }
        put(c, f, "b/three.txt", b"3")
        after = c.get(f + "/changes", params={"since": str(v), "dir": "a"}).json()
        assert after["changed"] is False and after["version"] > v
        assert c.get(f + "/changes", params={"since": str(v), "dir": "b"}).json()["changed"]
        # A move out of a directory is a change there, as is a move in.
        v = after["version"]
        op(c, f, {"action": "move", "path": "a/one.txt", "to": "b/one.txt"})
        assert c.get(f + "/changes", params={"since": str(v), "dir": "a"}).json()["changed"]
        assert c.get(f + "/changes", params={"since": str(v), "dir": "b"}).json()["changed"]
        r = c.get(f + "/changes", params={"since": "-1"})
        assert r.status_code == 400


def test_changes_with_entries_are_what_a_listing_on_screen_needs(tenant: Tenant) -> None:
    """entries=true: a changed directory's written, trashed and moved-in
    entries, the paths moved out, its total under the name filter; other
    directories' changes are not in it."""
    f = tenant.my_folder
    with tenant.client() as c:
        put(c, f, "docs/keep.md", b"k")
        put(c, f, "docs/old.md", b"o")
        put(c, f, "docs/gone.md", b"g")
        put(c, f, "docs/leaving.md", b"l")
        v = c.get(f + "/", params={"dir": "docs"}).json()["version"]

        def delta(**params: str) -> dict[str, Any]:
            r = c.get(f + "/changes", params={"since": str(v), "dir": "docs",
                                              "entries": "true", **params})  # fmt: skip
            assert r.status_code == 200, r.text
            answer: dict[str, Any] = r.json()
            return answer

        assert delta() == {"version": v, "changed": False}
        put(c, f, "docs/new.md", b"n")
        put(c, f, "docs/old.md", b"o2")
        op(c, f, {"action": "delete", "path": "docs/gone.md"})
        op(c, f, {"action": "move", "path": "docs/leaving.md", "to": "elsewhere/left.md"})
        put(c, f, "elsewhere/unrelated.md", b"u")
        got = delta()
        assert got["changed"] is True and got["complete"] is True and got["version"] > v
        by_path = {e["path"]: e for e in got["entries"]}
        assert set(by_path) == {"docs/new.md", "docs/old.md", "docs/gone.md"}
        assert by_path["docs/gone.md"]["deletedAt"] is not None
        assert (
            by_path["docs/old.md"]["byteSize"] == 2 and by_path["docs/new.md"]["deletedAt"] is None
        )
        assert got["gone"] == ["docs/leaving.md"]
        assert got["total"] == 3  # keep, old, new
        assert got["lastOperationAt"]
        # The name filter narrows the entries and the total, as in the listing.
        named = delta(name="NEW")
        assert [e["path"] for e in named["entries"]] == ["docs/new.md"]
        assert named["total"] == 1 and named["gone"] == ["docs/leaving.md"]
        # entries=true needs the directory it is about.
        r = c.get(f + "/changes", params={"since": str(v), "entries": "true"})
        assert r.status_code == 400 and r.json()["details"][0]["field"] == "dir", r.text


def test_sync_shows_each_runs_last_save_of_this_folder(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.save("task", {"t.txt": b"t"}).status_code == 200
    with tenant.client() as c:
        task_runs = c.get(tenant.folder("task", run.task or "") + "/sync").json()["runs"]
        user_runs = c.get(tenant.my_folder + "/sync").json()["runs"]
    (task_run,) = task_runs
    (user_run,) = user_runs
    assert task_run["folderSavedAt"] is not None and task_run["lastSavedAt"] is not None
    # The run saved the task folder only: the user folder has no save of it.
    assert user_run["lastSavedAt"] is not None and user_run["folderSavedAt"] is None


def test_the_directory_says_which_folders_have_files_and_an_active_run(tenant: Tenant) -> None:
    """For the home page's search: one request, no call per folder. A run sees
    names and ids only."""
    run = start_run(tenant)
    assert run.task is not None and run.project is not None
    ctl = tenant.controller
    idle_agent = ctl.admin("create-agent", tenant.company_id, "idle")["id"]
    with tenant.client() as c:
        put(c, tenant.folder("agent", idle_agent), "notes.md", b"n")
        # A folder whose only entry went to the trash has no files.
        put(c, tenant.folder("task", run.task), "gone.txt", b"g")
        op(c, tenant.folder("task", run.task), {"action": "delete", "path": "gone.txt"})
        found = c.get(f"/api/companies/{tenant.company_id}/directory").json()
    flags = {
        (kind, item["id"]): (item["hasFiles"], item["activeRun"])
        for kind in ("agents", "projects", "tasks")
        for item in found[kind]
    }
    # Every agent's folder holds its instruction entry from the start.
    assert flags == {
        ("agents", run.agent): (True, True),
        ("agents", idle_agent): (True, False),
        ("projects", run.project): (False, True),
        ("tasks", run.task): (False, True),
    }
    ctl.admin("end-run", run.run_id)
    with tenant.client() as c:
        found = c.get(f"/api/companies/{tenant.company_id}/directory").json()
    assert {t["id"]: t["activeRun"] for t in found["tasks"]} == {run.task: False}
    other = start_run(tenant)
    with other.api_client() as c:
        seen = c.get(f"/api/companies/{tenant.company_id}/directory").json()
    assert all(set(a) == {"id", "name"} for a in seen["agents"])
    assert all(set(t) == {"id", "title", "projectId"} for t in seen["tasks"])
