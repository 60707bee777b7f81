"""`--log-format json`: one JSON object per line, with request id, run id and route."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common import logs
from common.bridge import PREFIX
from tests.support.bridge import start_run
from tests.support.constants import REPO
from tests.support.controller import (
    ControllerProcess,
    PgCluster,
    Tenant,
    bootstrap_tenant,
    world_searchable_tmpdir,
)
from tests.support.endpoint import start_endpoint
from tests.support.mount import MountFactory


@pytest.fixture(scope="module")
def json_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-ctl-logs-"),
        extra_args=["--log-format", "json", "-v"],
    )
    try:
        yield ctl
    finally:
        ctl.stop()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)


def json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("controller listening on"):  # the start banner, on stdout
            continue
        out.append(json.loads(line))  # every other line is one JSON object
    return out


def test_controller_json_lines_name_request_run_and_route(
    json_controller: ControllerProcess,
) -> None:
    ctl = json_controller
    ctl.start()
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    with run.client() as c:
        r = c.get("/run", headers={"X-Request-Id": "req-logs-1"})
    assert r.status_code == 200
    httpx.get(ctl.url + "/healthz", headers={"X-Request-Id": "req-logs-2"})
    ctl.stop()
    lines = json_lines(ctl.log())
    assert lines, ctl.log()
    for line in lines:
        assert {"ts", "level", "logger", "msg"} <= line.keys()
    (bridge,) = [x for x in lines if x.get("requestId") == "req-logs-1"]
    assert bridge["runId"] == run.run_id
    assert bridge["route"] == "/bridge/v1/run"
    assert bridge["status"] == 200
    assert bridge["logger"] == "uvicorn.access"
    (health,) = [x for x in lines if x.get("requestId") == "req-logs-2"]
    assert health["route"] == "/healthz" and "runId" not in health


def test_fsagent_json_lines(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "-v", "doctor", "--log-format", "json",
         "--controller", "http://127.0.0.1:9", "--token-file", str(token)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    plain = [line for line in out.stderr.splitlines() if not line.startswith("{")]
    assert plain == ["fsagent: 1 check(s) failed: controller"]  # the command's own error line
    retries = [x for x in lines if "GET run failed" in x["msg"]]
    assert retries and retries[0]["level"] == "INFO", out.stderr  # louder from the third
    # Each attempt's line names that attempt's request id.
    ids = [x["requestId"] for x in retries]
    assert all(re.fullmatch(r"fsa-[0-9a-f]{16}", i) for i in ids) and len(set(ids)) == len(ids)


@pytest.mark.fuse
def test_fsagent_mount_lines_name_run_and_scope(tenant: Tenant, mounts: MountFactory) -> None:
    run = start_run(tenant)
    token = mounts.base / "token"
    token.write_text(run.token)
    m = mounts.mount(
        tenant.controller.url, "task", token_file=token, extra=["--log-format", "json", "-v"]
    )
    (m.mountpoint / "a.txt").write_bytes(b"a")
    assert m.fsagent("flush")["ok"]
    assert m.stop() == 0
    lines = [json.loads(x) for x in m.stderr().splitlines() if x.startswith("{")]
    saved = [x for x in lines if "saved" in x["msg"] and x["logger"] == "fsagent.ship"]
    assert saved, m.stderr()
    assert all(x["runId"] == run.run_id and x["scope"] == "task" for x in saved)


def template_matches(route: str, path: str) -> bool:
    """Whether the controller's route template names this URL path."""
    pattern = re.escape(route.removesuffix("/…")).replace(r"\{", "{").replace(r"\}", "}")
    pattern = re.sub(r"\{[A-Za-z]+:path\}", ".+", pattern)
    pattern = re.sub(r"\{[A-Za-z]+\}", "[^/]+", pattern)
    return re.fullmatch(pattern + ("(/.*)?" if route.endswith("/…") else ""), path) is not None


@pytest.mark.fuse
def test_fsagent_and_controller_lines_share_request_ids(
    json_controller: ControllerProcess, mounts: MountFactory
) -> None:
    """Every request fsagent sends carries an ``X-Request-Id``; fsagent's line
    about the answer and the controller's line about the same request name
    it, with the same status, and the controller's route names fsagent's
    path. The local API endpoint passes a caller's id on and makes one for a
    caller that sends none."""
    ctl = json_controller
    ctl.start()
    tenant = bootstrap_tenant(ctl)
    run = start_run(tenant)
    assert run.task is not None
    token = mounts.base / "token"
    token.write_text(run.token)
    m = mounts.mount(ctl.url, "task", token_file=token, extra=["--log-format", "json", "-v"])
    (m.mountpoint / "a.txt").write_bytes(b"logged")
    assert m.fsagent("flush")["ok"]
    assert m.stop() == 0
    ep = start_endpoint(ctl.url, run.token, "--log-format", "json", "-v")
    try:
        listing = tenant.folder("task", run.task) + "/"
        with ep.tcp() as tcp:
            assert tcp.get(listing, headers={"X-Request-Id": "caller-req-7"}).status_code == 200
            assert tcp.get(listing).status_code == 200
        assert ep.stop() == 0
        bridge_lines = [json.loads(x) for x in ep.stderr().splitlines() if x.startswith("{")]
    finally:
        ep.stop()
        shutil.rmtree(ep.dir, ignore_errors=True)
    ctl.stop()
    served: dict[str, list[dict[str, Any]]] = {}
    for line in json_lines(ctl.log()):
        if line["logger"] == "uvicorn.access":
            served.setdefault(line["requestId"], []).append(line)

    mount_lines = [json.loads(x) for x in m.stderr().splitlines() if x.startswith("{")]
    sent = [x for x in mount_lines if x["logger"] == "fsagent.http"]
    paths = {(x["method"], x["path"]) for x in sent}
    assert ("GET", "/bridge/v1/run") in paths, m.stderr()
    assert ("POST", "/bridge/v1/folders/task/checkpoints") in paths, m.stderr()
    for x in sent:
        assert re.fullmatch(r"fsa-[0-9a-f]{16}", x["requestId"]), x
        if x["path"] != "/bridge/v1/run":  # the run is known once it answered
            assert x["runId"] == run.run_id and x["scope"] == "task", x
        (theirs,) = served[x["requestId"]]
        assert (theirs["method"], theirs["status"]) == (x["method"], x["status"])
        assert template_matches(theirs["route"], x["path"]), (theirs, x)
        assert theirs["runId"] == run.run_id
    assert len({x["requestId"] for x in sent}) == len(sent)

    forwarded = [x for x in bridge_lines if x["logger"] == "fsagent.http"]
    (given, made) = [x["requestId"] for x in forwarded]
    assert given == "caller-req-7", ep.stderr()
    assert re.fullmatch(r"fsa-[0-9a-f]{16}", made)
    for x in forwarded:
        (theirs,) = served[x["requestId"]]
        assert x["path"] == PREFIX + "/api" + listing.removeprefix("/api")
        assert x["status"] == theirs["status"] == 200
        assert template_matches(theirs["route"], x["path"]), (theirs, x)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_is_the_default_on_a_terminal() -> None:
    assert logs.resolve(None, Tty()) == "text"
    assert logs.resolve(None, io.StringIO()) == "json"
    assert logs.resolve("text", io.StringIO()) == "text"
