"""A file whose stored object is gone (lost data, a GC bug) is an error the
reader sees, never a download that looks whole: every content route opens the
object before it sends a head, so it answers 500 ``object_missing`` (without
this host's paths) and logs the key. A truncated object cuts the connection.
Real controller, PostgreSQL and local-disk storage, with the object removed
from the disk under the controller."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from controller.storage.base import object_key
from tests.support.agentfiles import OCTET
from tests.support.bridge import start_run
from tests.support.controller import Tenant
from tests.support.repos import repo_run, sha, small_repo


def stored_path(tenant: Tenant, data: bytes) -> Path:
    digest = hashlib.sha256(data).hexdigest()
    path = tenant.controller.data_dir / "objects" / object_key(tenant.company_id, digest)
    assert path.is_file(), path
    return path


def assert_object_missing(r: httpx.Response, tenant: Tenant) -> None:
    assert r.status_code == 500, r.text
    if r.request.method != "HEAD":
        assert r.json() == {"error": "Stored object is missing", "code": "object_missing"}
    assert str(tenant.controller.data_dir) not in r.text


def test_content_routes_answer_object_missing_before_any_byte(tenant: Tenant) -> None:
    data = os.urandom(300_000)
    digest = hashlib.sha256(data).hexdigest()
    run = start_run(tenant)
    assert run.task is not None
    folder = tenant.folder("task", run.task)
    attachments = f"/api/companies/{tenant.company_id}/tasks/{run.task}/attachments"
    with tenant.client() as c:
        assert c.put(folder + "/content", params={"path": "a.bin"}, content=data,
                     headers=OCTET).status_code == 201  # fmt: skip
        added = c.post(attachments, params={"name": "a.bin"}, content=data, headers=OCTET)
        assert added.status_code == 201, added.text
        attachment = added.json()["attachment"]["id"]
        whole = c.get(folder + "/content", params={"path": "a.bin"})
        assert whole.status_code == 200 and whole.content == data

        stored_path(tenant, data).unlink()
        for method, url, params, headers in (
            ("GET", folder + "/content", {"path": "a.bin"}, {}),
            ("GET", folder + "/content", {"path": "a.bin"}, {"Range": "bytes=1000-1999"}),
            ("HEAD", folder + "/content", {"path": "a.bin"}, {}),
            ("GET", f"{attachments}/{attachment}", {}, {}),
            ("HEAD", f"{attachments}/{attachment}", {}, {}),
        ):
            r = c.request(method, url, params=params, headers=headers)
            assert_object_missing(r, tenant)
    with run.client() as bridge:
        r = bridge.get(f"/folders/task/objects/{digest}")
        assert_object_missing(r, tenant)
    # Through the API bridge (sandbox code's downloads) too.
    with run.api_client() as sandbox:
        r = sandbox.get(folder + "/content", params={"path": "a.bin"})
        assert_object_missing(r, tenant)
    key = object_key(tenant.company_id, digest)
    log = tenant.controller.log()
    assert f"GET {folder}/content failed: Stored object is missing (object {key}" in log, log[
        -3000:
    ]

    # An empty file needs no object: it is still served.
    with tenant.client() as c:
        assert c.put(folder + "/content", params={"path": "empty"}, content=b"",
                     headers=OCTET).status_code == 201  # fmt: skip
        r = c.get(folder + "/content", params={"path": "empty"})
        assert r.status_code == 200 and r.content == b""


def test_a_truncated_object_cuts_the_download_and_is_logged(tenant: Tenant) -> None:
    data = os.urandom(3 << 20)
    folder = tenant.folder("user", tenant.user_id)
    with tenant.client() as c:
        assert c.put(folder + "/content", params={"path": "big.bin"}, content=data,
                     headers=OCTET).status_code == 201  # fmt: skip
        path = stored_path(tenant, data)
        os.chmod(path, 0o644)
        os.truncate(path, len(data) // 2)
        r = c.head(folder + "/content", params={"path": "big.bin"})
        assert_object_missing(r, tenant)
        # A GET has sent its head when the short read shows: the connection is
        # cut, so no client takes the half for the file.
        with pytest.raises(httpx.RemoteProtocolError):
            c.get(folder + "/content", params={"path": "big.bin"})
    key = object_key(tenant.company_id, hashlib.sha256(data).hexdigest())
    assert f"object {key} ended after {len(data) // 2} of {len(data)} bytes" in (
        tenant.controller.log()
    )


def test_streamed_repository_answers_are_cut_where_an_object_is_missing(tenant: Tenant) -> None:
    """The tar download and the batched fetch stream many objects with no
    Content-Length; checking each one first would cost a request per member on
    S3. A missing member ends the stream without its final chunk instead: the
    client gets an error, never a well-formed tar or batch without the file."""
    run = repo_run(tenant)
    ws = run.ws()
    lost = os.urandom(200_000)
    run.save(ws, {**small_repo(), "data/lost.bin": lost})
    stored_path(tenant, lost).unlink()
    repos = f"/api/companies/{tenant.company_id}/tasks/{run.task}/repos"
    archive = f"{repos}/{ws}/archive"
    with tenant.client() as c:
        with pytest.raises(httpx.RemoteProtocolError), c.stream("GET", archive) as r:
            assert r.status_code == 200  # the head went before the member was reached
            b"".join(r.iter_bytes())
        assert c.get(repos).status_code == 200  # the controller serves on
    fetch = {"digests": [sha(lost)]}
    with (
        run.client() as c,
        pytest.raises(httpx.RemoteProtocolError),
        c.stream("POST", f"/repos/{ws}/objects/batch", json=fetch) as r,
    ):
        assert r.status_code == 200
        b"".join(r.iter_bytes())
    key = object_key(tenant.company_id, sha(lost))
    assert f"object {key} is missing" in tenant.controller.log()
