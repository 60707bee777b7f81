"""``fsagent bridge``, the sandbox's local API endpoint, as a real process.

First against a recording stand-in for the controller (what is forwarded,
what comes back, streaming in bounded memory, early errors, an unreachable
controller), then against a real controller through ``/bridge/v1/api``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fsagent.commands.envfile import read_env_file
from tests.support.bridge import Run, start_run
from tests.support.constants import REPO
from tests.support.controller import Tenant
from tests.support.demo import check_demo_agent
from tests.support.endpoint import TOKEN, LocalEndpoint, MiB, Upstream, start_endpoint
from tests.support.procs import free_port
from tests.support.tmp import private_tmpdir, world_searchable_tmpdir


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def endpoint(upstream: Upstream) -> Iterator[LocalEndpoint]:
    ep = start_endpoint(upstream.url)
    yield ep
    assert ep.stop() == 0, ep.stderr()
    assert not Path(ep.socket).exists()  # the socket goes with the endpoint


def test_forwards_over_tcp_and_socket_adding_the_run_token(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    for client in (endpoint.tcp(), endpoint.unix()):
        with client:
            res = client.put(
                "/api/companies/c1/work-folders/task/t1/content?path=a%20b%2Fc.txt&x=1",
                content=b"hello",
                headers={
                    "Authorization": "Bearer user-token-smuggled",
                    "Cookie": "fsa_session=abc",
                    "X-Forwarded-For": "10.0.0.1",
                    "Forwarded": "for=10.0.0.1",
                    "X-CSRF-Token": "csrf",
                    "Idempotency-Key": "k1",
                    "If-Match": '"v0"',
                    "X-File-Executable": "true",
                    "Content-Type": "text/plain",
                    "Connection": "keep-alive, X-Hop",
                    "X-Hop": "this connection only",
                },
            )
        assert res.status_code == 200, res.text
        assert "set-cookie" not in res.headers
        assert res.headers["x-upstream"] == "yes" and res.headers["etag"] == '"v1"'
        assert TOKEN not in res.text and TOKEN not in str(res.headers)
        seen = upstream.seen[-1]
        assert (seen.method, seen.path, seen.query) == (
            "PUT", "/bridge/v1/api/companies/c1/work-folders/task/t1/content", "path=a%20b%2Fc.txt&x=1",
        )  # fmt: skip
        assert seen.headers["authorization"] == f"Bearer {TOKEN}"  # replaced, not added to
        assert seen.body_len == 5 and seen.body_sha == hashlib.sha256(b"hello").hexdigest()
        assert "cookie" not in seen.headers and "x-hop" not in seen.headers
        # The rest goes on as sent: the controller's allowlist decides what the API sees.
        for name in ("x-forwarded-for", "forwarded", "x-csrf-token", "idempotency-key", "if-match",
                     "x-file-executable", "content-type"):  # fmt: skip
            assert name in seen.headers, (name, seen.headers)
    assert len(upstream.seen) == 2


def test_the_target_reaches_the_controller_as_sent(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    """Paths and queries are passed on byte for byte: escapes as the caller wrote
    them, never decoded and encoded again."""
    with socket.create_connection(("127.0.0.1", int(endpoint.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(b"GET /api/caf%C3%A9/x%2Fy?path=na%C3%AFve%E2%80%AE.txt&q=a%20b+c HTTP/1.1\r\n"
                     b"Host: x\r\nConnection: close\r\n\r\n")  # fmt: skip
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer
    seen = upstream.seen[-1]
    assert seen.path == "/bridge/v1/api/caf%C3%A9/x%2Fy"
    assert seen.query == "path=na%C3%AFve%E2%80%AE.txt&q=a%20b+c"


def test_early_errors_never_reach_the_controller(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.tcp() as client:
        assert client.get("/healthz").json() == {"ok": True}
        for path in ("/bridge/v1/run", "/run", "/api/../bridge/v1/run", "/api/%2e%2e/run",
                     "/api/x/%2E/y", "/files/"):  # fmt: skip
            res = client.get(path)
            assert res.status_code == 404 and res.json()["code"] == "route_not_found", path
        res = client.request("TRACE", "/api/companies")
        assert res.status_code == 405 and res.json()["code"] == "method_not_allowed"
    assert upstream.seen == []


def test_controller_refusal_comes_back_unchanged(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.unix() as client:
        res = client.post("/api/companies/c1/denied", json={"a": 1})
    assert res.status_code == 403 and res.json() == {"code": "bridge_route_denied"}


def test_a_caller_hanging_up_stops_the_download(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.tcp() as client, client.stream("GET", "/api/slow") as stream:
        first = next(stream.iter_raw())
        assert first
    deadline = time.monotonic() + 20
    while not upstream.trickled:
        assert time.monotonic() < deadline, "the controller's answer was not cut short"
        time.sleep(0.05)
    assert upstream.trickled[0] < 500, upstream.trickled


def test_chunked_upload_is_streamed_on(upstream: Upstream, endpoint: LocalEndpoint) -> None:
    with endpoint.unix() as client:
        res = client.post("/api/companies/c1/x", content=iter([b"ab", b"", b"cd"]))
    assert res.status_code == 200
    seen = upstream.seen[-1]
    assert seen.body_len == 4 and seen.headers.get("transfer-encoding") == "chunked"


def test_token_file_is_read_again_when_it_changes(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    with endpoint.tcp() as client:
        client.get("/api/companies")
        endpoint.token_file.write_text("next-run-token")
        client.get("/api/companies")
        endpoint.token_file.unlink()
        res = client.get("/api/companies")
    assert [s.headers["authorization"] for s in upstream.seen] == [
        f"Bearer {TOKEN}",
        "Bearer next-run-token",
    ]
    assert res.status_code == 503 and res.json()["code"] == "run_token_unavailable"


@pytest.mark.allow_warning_logs
def test_unreachable_controller_is_502(tmp_path: Path) -> None:
    ep = start_endpoint(f"http://127.0.0.1:{free_port()}")
    try:
        with ep.tcp() as client:
            res = client.get("/api/companies")
        assert res.status_code == 502 and res.json()["code"] == "controller_unreachable"
    finally:
        assert ep.stop() == 0
    assert "controller unreachable for GET /api/companies" in ep.stderr()


def test_bodies_stream_both_ways_in_bounded_memory(
    upstream: Upstream, endpoint: LocalEndpoint
) -> None:
    size = 256 * MiB
    block = bytes(range(256)) * (MiB // 256)
    expected = hashlib.sha256()
    for _ in range(size // MiB):
        expected.update(block)

    def upload() -> Iterator[bytes]:
        for _ in range(size // MiB):
            yield block

    with endpoint.tcp() as client:
        started = time.monotonic()
        res = client.put("/api/companies/c1/work-folders/task/t1/content?path=big", content=upload(),
                         headers={"Content-Length": str(size)})  # fmt: skip
        up_s = time.monotonic() - started
        assert res.status_code == 200
        assert upstream.seen[-1].body_len == size
        assert upstream.seen[-1].body_sha == expected.hexdigest()
        started = time.monotonic()
        got = hashlib.sha256()
        with client.stream("GET", f"/api/big?n={size}") as stream:
            assert stream.headers["content-length"] == str(size)
            for chunk in stream.iter_raw():
                got.update(chunk)
        down_s = time.monotonic() - started
    assert got.hexdigest() == expected.hexdigest()
    peak = endpoint.peak_rss()
    print(f"256 MiB through the endpoint: up {size / MiB / up_s:.0f} MiB/s, "
          f"down {size / MiB / down_s:.0f} MiB/s, peak RSS {peak / MiB:.0f} MiB")  # fmt: skip
    assert peak < 100 * MiB, f"endpoint peak RSS {peak / MiB:.0f} MiB: a body was buffered"


# --- against a real controller ----------------------------------------------------

OCTET = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def run_endpoint(tenant: Tenant) -> Iterator[tuple[Run, LocalEndpoint]]:
    run = start_run(tenant)
    ep = start_endpoint(tenant.controller.url, run.token)
    yield run, ep
    assert ep.stop() == 0, ep.stderr()


def test_allowed_calls_work_with_the_agents_authority(
    tenant: Tenant, run_endpoint: tuple[Run, LocalEndpoint]
) -> None:
    run, ep = run_endpoint
    assert run.task is not None
    task = tenant.folder("task", run.task)
    mine = tenant.folder("agent", run.agent)
    with ep.tcp() as tcp, ep.unix() as unix:
        put = tcp.put(
            f"{task}/content", params={"path": "notes.md"}, content=b"from tcp", headers=OCTET
        )
        assert put.status_code == 201, put.text
        got = unix.get(f"{task}/content", params={"path": "notes.md"})
        assert got.status_code == 200 and got.content == b"from tcp"
        put = unix.put(
            f"{mine}/content", params={"path": "a/b.txt"}, content=b"from socket", headers=OCTET
        )
        assert put.status_code == 201, put.text
        listing = tcp.get(mine + "/", params={"recursive": "true"})
        assert listing.status_code == 200, listing.text
        assert "a/b.txt" in [e["path"] for e in listing.json()["entries"]]
        ranged = tcp.get(
            f"{mine}/content", params={"path": "a/b.txt"}, headers={"Range": "bytes=5-10"}
        )
        assert ranged.status_code == 206 and ranged.content == b"socket"
        # The agent's authority, not the user's: another agent's folder is hidden
        # although the responsible user (an owner) could read it.
        other = tenant.controller.admin("create-agent", tenant.company_id, "other")["id"]
        with tenant.client() as owner:
            r = owner.put(f"{tenant.folder('agent', other)}/content", params={"path": "x"},
                          content=b"theirs", headers=OCTET)  # fmt: skip
            assert r.status_code == 201, r.text
        for client in (tcp, unix):
            hidden = client.get(f"{tenant.folder('agent', other)}/content", params={"path": "x"})
            assert hidden.status_code == 404 and hidden.json()["code"] == "not_found"
        directory = unix.get(f"/api/companies/{tenant.company_id}/directory")
        assert directory.status_code == 200, directory.text
        assert "@example.com" not in directory.text  # member ids only for a run
    with tenant.client() as owner:
        assert owner.get(f"{task}/content", params={"path": "notes.md"}).content == b"from tcp"
        assert owner.get(f"{mine}/content", params={"path": "a/b.txt"}).content == b"from socket"


def test_credentials_the_caller_smuggles_change_nothing(
    tenant: Tenant, run_endpoint: tuple[Run, LocalEndpoint]
) -> None:
    """The owner's own API token sent through the endpoint does not lend the run
    the owner's authority: the run token replaces it."""
    _, ep = run_endpoint
    other = tenant.controller.admin("create-agent", tenant.company_id, "other")["id"]
    theirs = f"{tenant.folder('agent', other)}/content"
    with tenant.client() as owner:
        assert (
            owner.put(theirs, params={"path": "x"}, content=b"t", headers=OCTET).status_code == 201
        )
        session = owner.post("/files/api/session", json={"token": tenant.token})
        assert session.status_code == 200 and session.cookies, session.text
    smuggled = {"Authorization": f"Bearer {tenant.token}", "Cookie": "; ".join(
        f"{k}={v}" for k, v in session.cookies.items()), "X-Forwarded-For": "127.0.0.1"}  # fmt: skip
    with ep.tcp() as client:
        read = client.get(theirs, params={"path": "x"}, headers=smuggled)
        assert read.status_code == 404 and read.json()["code"] == "not_found", read.text
        write = client.put(
            theirs, params={"path": "y"}, content=b"no", headers={**OCTET, **smuggled}
        )
        assert write.status_code == 404, write.text
    assert tenant.file_rows("y") == 0


def test_a_denied_route_is_the_controllers_403_and_changes_nothing(
    tenant: Tenant, run_endpoint: tuple[Run, LocalEndpoint]
) -> None:
    run, ep = run_endpoint
    assert run.task is not None
    task = tenant.folder("task", run.task)
    with ep.unix() as client:
        r = client.put(f"{task}/content", params={"path": "keep"}, content=b"kept", headers=OCTET)
        assert r.status_code == 201
        for method, path in (("DELETE", f"{task}/content?path=keep"),
                             ("GET", f"/api/companies/{tenant.company_id}/runs/{run.run_id}/audit")):  # fmt: skip
            denied = client.request(method, path)
            assert denied.status_code == 403, (method, path, denied.text)
            assert denied.json()["code"] == "bridge_route_denied"
    assert tenant.file_rows("keep") == 1


def test_the_token_is_never_exposed_to_launched_code(
    tenant: Tenant, run_endpoint: tuple[Run, LocalEndpoint]
) -> None:
    run, ep = run_endpoint
    assert run.task is not None
    home = ep.dir / "home"
    home.mkdir()
    env_file = ep.dir / "env"
    env_file.write_text(f"PAPERCLIP_API_URL={ep.url}\nPAPERCLIP_API_SOCKET={ep.socket}\n")
    url = f"{tenant.folder('task', run.task)}/content?path=hello.txt"
    script = (
        "import json, os, urllib.request as u\n"
        f"req = u.Request(os.environ['PAPERCLIP_API_URL'] + {url!r}, data=b'hi', method='PUT',"
        " headers={'Content-Type': 'application/octet-stream'})\n"
        "with u.urlopen(req) as r: put = [r.status, dict(r.headers), r.read().decode()]\n"
        f"with u.urlopen(os.environ['PAPERCLIP_API_URL'] + {url!r}) as r:\n"
        "    got = [r.status, dict(r.headers), r.read().decode()]\n"
        "print(json.dumps({'env': dict(os.environ), 'put': put, 'got': got}))\n"
    )
    (home / "probe.py").write_text(script)
    res = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "launch", "--home", str(home), "--env-file",
         str(env_file), "--", sys.executable, "probe.py"],
        capture_output=True, text=True, cwd=REPO, check=False, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["put"][0] == 201 and out["got"][0] == 200 and out["got"][2] == "hi"
    assert out["env"]["PAPERCLIP_API_URL"] == ep.url
    assert run.token not in res.stdout and run.token not in res.stderr
    assert TOKEN not in res.stdout


@pytest.mark.fuse
def test_up_serves_the_endpoint_and_doctor_finds_everything_healthy(tenant: Tenant) -> None:
    run = start_run(tenant)
    assert run.task is not None
    base = private_tmpdir("fsa-up-")
    token_file = base / "token"
    token_file.write_text(run.token)
    home, state_root, env_file = base / "home", base / "state", base / "env"
    with open(base / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(home), "--controller",
             tenant.controller.url, "--token-file", str(token_file), "--state-root", str(state_root),
             "--env-file", str(env_file)],
            cwd=REPO, stdout=log, stderr=log,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not env_file.exists():
            assert proc.poll() is None, (base / "up.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        env = read_env_file(env_file)
        assert env["PAPERCLIP_API_SOCKET"] == str(state_root / "run" / "api.sock")
        assert env["PAPERCLIP_API_URL"].startswith("http://127.0.0.1:")
        assert run.token not in env_file.read_text()
        (home / "task" / "saved.txt").write_bytes(b"through the mount")
        with httpx.Client(base_url=env["PAPERCLIP_API_URL"], timeout=60) as api:
            url = f"{tenant.folder('task', run.task)}/content"
            r = api.put(url, params={"path": "api.txt"}, content=b"through the api", headers=OCTET)
            assert r.status_code == 201, r.text
            assert api.get(url, params={"path": "api.txt"}).content == b"through the api"
        doc = subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "doctor", "--home", str(home), "--env-file",
             str(env_file), "--controller", tenant.controller.url, "--token-file", str(token_file),
             "--json"],
            capture_output=True, text=True, cwd=REPO, check=False, timeout=120,
        )  # fmt: skip
        assert doc.returncode == 0, doc.stdout + doc.stderr
        checks = {c["name"]: c for c in json.loads(doc.stdout)["checks"]}
        assert {n: c["status"] for n, c in checks.items() if c["status"] != "ok"} == {}
        assert checks["controller"]["detail"].endswith(f"run {run.run_id} active")
        assert set(checks) >= {"bridge tcp", "bridge socket", "controller", "node", "/dev/fuse"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (base / "up.log").read_text()
        assert not Path(env["PAPERCLIP_API_SOCKET"]).exists()
        with tenant.client() as owner:
            saved = owner.get(
                f"{tenant.folder('task', run.task)}/content", params={"path": "saved.txt"}
            )
            assert saved.content == b"through the mount"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for scope in ("task", "agent", "user", "project"):
            subprocess.run(["fusermount3", "-u", "-z", str(home / scope)], capture_output=True,
                           check=False)  # fmt: skip


def start_demo(base: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """``make demo`` (controller.demo) on ``base``; its output once it says
    how to stop it."""
    with open(base / "demo.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.demo", "--data-dir", str(base / "data"), "--home",
             str(base / "home"), "--listen", f"127.0.0.1:{port}", "--checkpoint-interval", "600"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        text = ""
        while "Press Ctrl-C" not in text:
            assert proc.poll() is None, text
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
            text = (base / "demo.out").read_text(errors="replace")
    except BaseException:
        stop_demo(base, proc)
        raise
    return proc, text


def stop_demo(base: Path, proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C, as a person stops the demo; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for scope in ("task", "agent", "user", "project"):
        subprocess.run(["fusermount3", "-u", "-z", str(base / "home" / scope)],
                       capture_output=True, check=False)  # fmt: skip
    return proc.returncode


@pytest.mark.fuse
def test_demo_prints_curl_lines_that_work_inside_the_sandbox() -> None:
    base = world_searchable_tmpdir("fsa-demo-")
    port = free_port()
    proc, text = start_demo(base, port)
    try:
        check_demo_agent(text, base / "home")
        # make demo serves the four collections as FUSE mounts, never plain directories.
        fstypes = {}
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields, _, rest = line.partition(" - ")
            fstypes[fields.split()[4]] = rest.split()[0]
        for scope in ("task", "agent", "user", "project"):
            assert fstypes.get(str(base / "home" / scope)) == "fuse.fsagent", (scope, fstypes)
        block = text.split("Inside the sandbox", 1)[1].split("\n\n", 1)[0].splitlines()
        # Where the API's write shows is said before the lines that make it.
        said = " ".join(line for line in block if not line.startswith("  "))
        assert (
            "An API write is saved on the controller at once and reaches the mounted folders at"
            f" the next run (no refresh during a run): `ls {base / 'home'}/task` shows notes.md"
            " after Ctrl-C and `make demo` again:"
        ) in said, said
        setup, put, get, launched = (line.strip() for line in block if line.startswith("  "))
        assert setup.startswith("set -a; . ") and "Bearer" not in "".join(block)
        assert get.startswith('curl -sS "$PAPERCLIP_API_URL/api/companies/')
        assert shlex.split(launched)[0].startswith("/"), launched
        clean_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(base / "home")}

        def sandbox_sh(*lines: str) -> subprocess.CompletedProcess[str]:
            # In the sandbox's home, not this checkout: every line must work from anywhere.
            return subprocess.run(["sh", "-c", "\n".join(lines)], capture_output=True, text=True,
                                  cwd=base / "home", env=clean_env, check=False, timeout=60)  # fmt: skip

        wrote = sandbox_sh(setup, put)
        assert wrote.returncode == 0, wrote
        assert json.loads(wrote.stdout)["file"]["path"] == "notes.md", wrote.stdout
        read = sandbox_sh(setup, get)
        assert read.returncode == 0 and read.stdout == "written from the sandbox", read
        via_launch = sandbox_sh(launched)
        assert via_launch.returncode == 0 and via_launch.stdout == "written from the sandbox", (
            via_launch
        )
        # As printed: not in the mounted task folder during this run...
        assert "notes.md" not in [p.name for p in (base / "home" / "task").iterdir()]
    finally:
        code = stop_demo(base, proc)
    assert code == 0, (base / "demo.out").read_text(errors="replace")
    # ...and there after Ctrl-C and `make demo` again.
    proc, _ = start_demo(base, port)
    try:
        assert (base / "home" / "task" / "notes.md").read_bytes() == b"written from the sandbox"
    finally:
        code = stop_demo(base, proc)
    assert code == 0, (base / "demo.out").read_text(errors="replace")


def test_the_systemd_unit_command_line_serves_and_writes_the_env_file(upstream: Upstream) -> None:
    unit = (REPO / "packaging" / "systemd" / "fsagent-bridge.service").read_text()
    exec_start = unit.split("\nExecStart=", 1)[1].split("\n\n", 1)[0].split("\nKillSignal", 1)[0]
    words = shlex.split(exec_start.replace("\\\n", " "))
    assert words[:2] == ["/opt/fsagent/venv/bin/fsagent", "bridge"]
    # A home whose path the env file must quote (spaces, both quotes).
    d = private_tmpdir("fsa-unit-") / 'agent\'s "home" dir'
    d.mkdir()
    (d / "token").write_text(TOKEN)
    port = free_port()
    config = {"FSAGENT_CONTROLLER": upstream.url, "FSAGENT_TOKEN_FILE": str(d / "token"),
              "FSAGENT_BRIDGE_PORT": str(port), "FSAGENT_HOME": str(d)}  # fmt: skip
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: config[m.group(1)], w) for w in words[2:]]
    env_file = d / ".local" / "state" / "fsagent" / "env"
    env_file.parent.mkdir(parents=True)
    # A line of its own is kept; the endpoint's and the collections' are rewritten.
    env_file.write_text("OWNER_SETTING='kept as is'\nPAPERCLIP_API_URL=http://127.0.0.1:1\n")
    proc = subprocess.Popen([sys.executable, "-m", "fsagent.cli", "bridge", *argv], cwd=REPO,
                            stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        sock = d / ".local" / "state" / "fsagent" / "run" / "api.sock"
        q = str(d).replace('"', '\\"')
        expected = (
            f'OWNER_SETTING="kept as is"\nPAPERCLIP_API_URL="http://127.0.0.1:{port}"\n'
            f'AGENT_HOME="{q}/agent"\nPAPERCLIP_TASK_DIR="{q}/task"\n'
            f'PAPERCLIP_AGENT_DIR="{q}/agent"\nPAPERCLIP_PROJECT_DIR="{q}/project"\n'
            f'PAPERCLIP_REPOS_DIR="{q}/repos"\nPAPERCLIP_PRIMARY_REPO="{q}/repos/app"\n'
            f'PAPERCLIP_API_SOCKET="{q}/.local/state/fsagent/run/api.sock"\n'
        )  # the stand-in's run is bound to a task, its agent, a project and one repository
        deadline = time.monotonic() + 30
        while env_file.read_text() != expected:
            assert proc.poll() is None and time.monotonic() < deadline, env_file.read_text()
            time.sleep(0.05)
        # What an agent's shell (or a unit's EnvironmentFile=) gets from it.
        sourced = subprocess.run(
            ["sh", "-c", 'set -a; . "$1"; printf %s "$AGENT_HOME|$PAPERCLIP_API_SOCKET"', "sh",
             str(env_file)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert sourced == f"{d}/agent|{sock}"
        assert read_env_file(env_file)["PAPERCLIP_PROJECT_DIR"] == f"{d}/project"
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as client:
            assert client.get("http://bridge/api/companies").status_code == 200
        assert [(x.method, x.path) for x in upstream.seen] == [
            ("GET", "/bridge/v1/run"), ("GET", "/bridge/v1/repos"),
            ("GET", "/bridge/v1/api/companies"),
        ]  # fmt: skip
        assert all(x.headers["authorization"] == f"Bearer {TOKEN}" for x in upstream.seen)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_doctor_reports_a_refused_run_token(tenant: Tenant) -> None:
    """Without flags doctor checks the controller and token file the systemd
    units are configured with (/etc/fsagent/fsagent.env, here --config)."""
    run = start_run(tenant)
    d = private_tmpdir("fsa-doc-")
    (d / "token").write_text(run.token)
    config = d / "fsagent.env"
    config.write_text(
        f'FSAGENT_CONTROLLER="{tenant.controller.url}"\nFSAGENT_TOKEN_FILE="{d / "token"}"\n'
    )

    def doctor() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "doctor", "--home", str(d), "--env-file",
             str(d / "no-env"), "--config", str(config), "--json"],
            capture_output=True, text=True, cwd=REPO, check=False, timeout=120,
        )  # fmt: skip

    healthy = {c["name"]: c for c in json.loads(doctor().stdout)["checks"]}
    assert healthy["controller"] == {
        "name": "controller",
        "status": "ok",
        "detail": f"{tenant.controller.url} reachable, run {run.run_id} active",
    }
    assert healthy["bridge"]["detail"] == f"the env file {d / 'no-env'} does not exist"
    tenant.controller.admin("end-run", run.run_id)
    res = doctor()
    assert res.returncode == 6, res.stdout + res.stderr
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    assert checks["controller"] == {
        "name": "controller",
        "status": "fail",
        "detail": f"{tenant.controller.url} refused the run token (401 unauthenticated)",
    }
    assert res.stderr.splitlines() == ["fsagent: 1 check(s) failed: controller"]


def test_up_stops_with_exit_5_when_the_endpoint_cannot_listen(tenant: Tenant) -> None:
    run = start_run(tenant)
    d = private_tmpdir("fsa-up-")
    (d / "token").write_text(run.token)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "up", "--home", str(d / "home"), "--controller",
             tenant.controller.url, "--token-file", str(d / "token"), "--state-root", str(d / "state"),
             "--bridge-port", str(port)],
            capture_output=True, text=True, cwd=REPO, check=False, timeout=120,
        )  # fmt: skip
    assert res.returncode == 5, res.stderr
    assert res.stderr.splitlines() == [
        f"fsagent: cannot listen on 127.0.0.1:{port}: Address already in use",
        "fsagent: fsagent up: the bridge exited with 1",
    ]
    assert not (d / "state" / "env").exists()
    assert not (d / "home" / "task").exists()  # nothing was mounted
