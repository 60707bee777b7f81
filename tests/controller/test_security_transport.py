"""Transport security against a real `controller serve`: upload frames, auth before body, limits.

One controller for the module, started with short limits so that timeouts can
be observed in seconds. Hostile requests are written on raw sockets, because
an HTTP client would not stall, trickle or lie about Content-Length.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import xxhash
import zstandard

from common.bridge import CHUNK_MAX, END_FRAME, PREFIX, encode_frame, frame_header
from common.errors import BadFrame
from common.wire import FrameSplitter, decode_frame
from controller.cli import main as controller_main
from tests.support.bridge import Run, framed, start_run
from tests.support.controller import ControllerProcess, PgCluster, Tenant, world_searchable_tmpdir

IDLE = 2.0  # --body-idle-timeout and --header-timeout of the module's controller
PER_TOKEN = 3
MAX_CONNECTIONS = 16
MIN_RATE = 2048
SLACK = 3.0  # scheduling delay on a loaded machine


@pytest.fixture(scope="module")
def strict_controller(pg_cluster: PgCluster) -> Iterator[ControllerProcess]:
    ctl = ControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-sec-"),
        [
            "--body-idle-timeout",
            str(IDLE),
            "--header-timeout",
            str(IDLE),
            "--keep-alive-timeout",
            "2",
            "--body-min-rate",
            str(MIN_RATE),
            "--max-requests-per-token",
            str(PER_TOKEN),
            "--max-connections",
            str(MAX_CONNECTIONS),
        ],
    )
    ctl.start()
    try:
        yield ctl
    finally:
        ctl.stop()


@pytest.fixture
def stenant(strict_controller: ControllerProcess) -> Tenant:
    out = strict_controller.admin(
        "bootstrap",
        "--company-name",
        f"co-{uuid.uuid4().hex[:8]}",
        "--email",
        f"owner-{uuid.uuid4().hex[:10]}@example.com",
    )
    return Tenant(strict_controller, out["company_id"], out["user_id"], out["token"])


# --- raw HTTP ----------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float

    def json(self) -> dict[str, object]:
        data: dict[str, object] = json.loads(self.body)
        return data


@contextlib.contextmanager
def raw_connection(ctl: ControllerProcess) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", ctl.port), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: controller",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket, started: float, timeout: float) -> Answer:
    """One HTTP answer; fails if none arrives within ``timeout`` of ``started``."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += recv_some(sock, started + timeout)
    raw_head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        rest += recv_some(sock, started + timeout)
    return Answer(int(status_line.split()[1]), headers, rest[:length], time.monotonic() - started)


def recv_some(sock: socket.socket, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    assert remaining > 0, "no answer before the deadline"
    ready, _, _ = select.select([sock], [], [], remaining)
    assert ready, "no answer before the deadline"
    data = sock.recv(65536)
    assert data, "connection closed without an answer"
    return data


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], remaining)
        if not ready:
            return False
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
    return False


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def run_uploads(ctl: ControllerProcess, run: Run) -> int:
    with ctl.db() as conn:
        row = conn.execute("SELECT count(*) FROM run_uploads WHERE run_id = %s", (run.run_id,))
        return int(row.fetchone()[0])  # type: ignore[index]


def spool_files(ctl: ControllerProcess) -> list[str]:
    return sorted(p.name for p in (ctl.data_dir / "spool").iterdir())


def put_frames(run: Run, body: bytes) -> httpx.Response:
    with run.client() as c:
        return c.put("/folders/task/uploads", content=body)


# --- upload frames -----------------------------------------------------------


def rle_bomb(declared: int, blocks: int) -> bytes:
    """A zstd frame declaring ``declared`` bytes, made of 128 KiB RLE blocks (4 bytes each)."""
    parts = [(0xFD2FB528).to_bytes(4, "little"), bytes([0xE0]), declared.to_bytes(8, "little")]
    for i in range(blocks):
        last = 1 if i == blocks - 1 else 0
        parts.append((last | (1 << 1) | ((128 << 10) << 3)).to_bytes(3, "little") + b"\0")
    return b"".join(parts)


@pytest.mark.parametrize("declared", [256 << 20, 8 << 30], ids=["256MiB", "8GiB"])
def test_decompression_bomb_refused_with_bounded_memory(stenant: Tenant, declared: int) -> None:
    ctl = stenant.controller
    assert ctl.proc is not None
    run = start_run(stenant)
    bomb = rle_bomb(declared, 2048)  # 8 KiB that expands to 256 MiB
    assert len(bomb) < 9000
    body = frame_header(len(bomb), CHUNK_MAX, 0) + bomb + END_FRAME
    # Reset the peak RSS to the current RSS so the peak measures this request alone.
    Path(f"/proc/{ctl.proc.pid}/clear_refs").write_text("5")
    before = vm_kib(ctl.proc.pid, "VmHWM")
    r = put_frames(run, body)
    grew = vm_kib(ctl.proc.pid, "VmHWM") - before
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "bad_frame"
    assert grew < 64 * 1024, f"controller peak RSS grew by {grew} KiB"
    assert run_uploads(ctl, run) == 0


def _one_frame(payload: bytes, raw: bytes) -> bytes:
    return frame_header(len(payload), len(raw), xxhash.xxh64_intdigest(raw)) + payload + END_FRAME


def test_malformed_frames_refused_and_nothing_published(stenant: Tenant) -> None:
    ctl = stenant.controller
    run = start_run(stenant)
    cctx = zstandard.ZstdCompressor()
    a, b = os.urandom(3000), os.urandom(2000)
    streamed = cctx.compressobj()
    unknown_size = streamed.compress(a) + streamed.flush()
    assert zstandard.frame_content_size(unknown_size) == -1  # not declared
    cases = {
        # The header describes `a` truthfully; the payload carries more than one frame.
        "trailing junk": _one_frame(cctx.compress(a) + b"junk", a),
        "two zstd frames": _one_frame(cctx.compress(a) + cctx.compress(b), a),
        "two frames, joint length": _one_frame(cctx.compress(a) + cctx.compress(b), a + b),
        "no declared size": _one_frame(unknown_size, a),
        "declared size differs": _one_frame(cctx.compress(a + b), a),
        "not zstd": _one_frame(b"\x00" * 64, a),
        "bad checksum": frame_header(len(cctx.compress(a)), len(a), 1)
        + cctx.compress(a)
        + END_FRAME,
        "after end frame": _one_frame(cctx.compress(a), a) + b"x",
        "no end frame": _one_frame(cctx.compress(a), a)[: -len(END_FRAME)],
        "end frame not zero": _one_frame(cctx.compress(a), a)[: -len(END_FRAME)]
        + frame_header(0, 0, 7),
        "oversized frame": frame_header(10, CHUNK_MAX + 1, 0) + b"\0" * 10 + END_FRAME,
    }
    for name, body in cases.items():
        r = put_frames(run, body)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["code"] == "bad_frame", (name, r.text)
    assert run_uploads(ctl, run) == 0
    assert spool_files(ctl) == []
    # The same bytes, properly framed, are accepted.
    ok = put_frames(run, framed(a + b))
    assert ok.status_code == 200 and ok.json()["byteSize"] == 5000
    assert run_uploads(ctl, run) == 1


def test_frame_reader_in_process() -> None:
    data = os.urandom(100_000) + b"\0" * 200_000
    body = framed(data, chunk=70_000)
    splitter = FrameSplitter()
    out = b""
    for i in range(0, len(body), 777):  # arbitrary cuts, across headers and payloads
        for frame in splitter.feed(body[i : i + 777]):
            out += decode_frame(frame)
    splitter.finish()
    assert out == data
    with pytest.raises(BadFrame):
        splitter.feed(b"\0")
    cut = FrameSplitter()
    cut.feed(body[:-1])
    with pytest.raises(BadFrame):
        cut.finish()
    cctx = zstandard.ZstdCompressor()
    frame = encode_frame(b"abc", cctx)
    (parsed,) = FrameSplitter().feed(frame)
    assert decode_frame(parsed) == b"abc"


# --- authentication before the body -----------------------------------------


def unauthenticated_targets(t: Tenant) -> list[tuple[str, str, str]]:
    folder = t.folder("user", t.user_id)
    return [
        ("PUT", PREFIX + "/folders/task/uploads", "application/octet-stream"),
        ("POST", PREFIX + "/folders/task/checkpoints", "application/json"),
        ("POST", PREFIX + "/run/report", "application/json"),
        ("PUT", folder + "/content?path=big.bin", "application/octet-stream"),
        ("POST", folder + "/operations", "application/json"),
        ("POST", folder + "/refresh", "application/json"),
    ]


@pytest.mark.parametrize("auth", [None, "Bearer not-a-real-token"], ids=["no-token", "bad-token"])
def test_unauthenticated_large_body_cut_at_once(stenant: Tenant, auth: str | None) -> None:
    ctl = stenant.controller
    for method, path, ctype in unauthenticated_targets(stenant):
        headers = {"Content-Type": ctype, "Content-Length": str(60 << 20)}
        if auth:
            headers["Authorization"] = auth
        with raw_connection(ctl) as sock:
            started = time.monotonic()
            sock.sendall(head(method, path, headers) + b"{" + b" " * 1000)
            answer = read_answer(sock, started, timeout=SLACK)
            assert answer.status == 401, (path, answer)
            assert answer.json()["code"] == "unauthenticated"
            assert answer.headers.get("connection") == "close", (path, answer.headers)
            # The server does not keep reading the 60 MiB it was promised.
            assert closed_within(sock, SLACK), path
    assert spool_files(ctl) == []


# --- body deadlines ----------------------------------------------------------


def test_stalled_upload_times_out_and_publishes_nothing(stenant: Tenant) -> None:
    ctl = stenant.controller
    run = start_run(stenant)
    body = framed(os.urandom(1 << 20))
    headers = {"Authorization": f"Bearer {run.token}", "Content-Length": str(len(body))}
    with raw_connection(ctl) as sock:
        sock.sendall(head("PUT", PREFIX + "/folders/task/uploads", headers) + body[:5000])
        started = time.monotonic()
        answer = read_answer(sock, started, timeout=IDLE + SLACK)
        assert answer.status == 408 and answer.json()["code"] == "request_timeout", answer
        assert answer.seconds >= IDLE - 0.5
        assert closed_within(sock, SLACK)
    assert run_uploads(ctl, run) == 0
    assert spool_files(ctl) == []


def test_stalled_checkpoint_times_out(stenant: Tenant) -> None:
    run = start_run(stenant)
    headers = {
        "Authorization": f"Bearer {run.token}",
        "Content-Type": "application/json",
        "Content-Length": "5000",
    }
    with raw_connection(stenant.controller) as sock:
        sock.sendall(head("POST", PREFIX + "/folders/task/checkpoints", headers) + b'{"oper')
        answer = read_answer(sock, time.monotonic(), timeout=IDLE + SLACK)
        assert answer.status == 408 and answer.json()["code"] == "request_timeout", answer
        assert closed_within(sock, SLACK)
    with stenant.controller.db() as conn:
        row = conn.execute("SELECT last_saved_at FROM runs WHERE id = %s", (run.run_id,))
        assert row.fetchone()[0] is None  # type: ignore[index]


def test_trickled_body_refused_by_minimum_rate(stenant: Tenant) -> None:
    """One byte every 0.3 s never trips the idle timeout; the rate rule ends it."""
    run = start_run(stenant)
    headers = {
        "Authorization": f"Bearer {run.token}",
        "Content-Type": "application/json",
        "Content-Length": "100000",
    }
    with raw_connection(stenant.controller) as sock:
        sock.sendall(head("POST", PREFIX + "/folders/task/checkpoints", headers))
        started = time.monotonic()
        while time.monotonic() - started < 20:
            ready, _, _ = select.select([sock], [], [], 0.3)
            if ready:
                break
            sock.sendall(b" ")
        answer = read_answer(sock, started, timeout=30)
        assert answer.status == 408 and answer.json()["code"] == "request_timeout", answer
        assert "slower than" in answer.json()["error"]  # type: ignore[operator]
        assert answer.seconds < IDLE + 2 * SLACK


# --- head limits and connections -----------------------------------------------


def test_stalled_headers_time_out(strict_controller: ControllerProcess) -> None:
    for first in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        with raw_connection(strict_controller) as sock:
            started = time.monotonic()
            sock.sendall(first)
            answer = read_answer(sock, started, timeout=IDLE + SLACK)
            assert answer.status == 408 and answer.json()["code"] == "request_timeout"
            assert answer.seconds >= IDLE - 0.5
            assert closed_within(sock, SLACK)
    # Trickling the head does not extend its deadline.
    with raw_connection(strict_controller) as sock:
        started = time.monotonic()
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        for byte in request:
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready:
                break
            sock.sendall(bytes([byte]))
        answer = read_answer(sock, started, timeout=IDLE + SLACK)
        assert answer.status == 408
        assert answer.seconds < IDLE + SLACK


def test_oversized_head_refused(strict_controller: ControllerProcess) -> None:
    with raw_connection(strict_controller) as sock:
        sock.sendall(head("GET", "/healthz", {"X-Big": "a" * (40 << 10)}))
        answer = read_answer(sock, time.monotonic(), timeout=SLACK)
        assert answer.status == 431 and answer.json()["code"] == "request_head_too_large"
    r = httpx.get(strict_controller.url + "/healthz", headers={"X-Fine": "a" * 8000})
    assert r.status_code == 200


def test_connection_cap(strict_controller: ControllerProcess) -> None:
    socks = [
        socket.create_connection(("127.0.0.1", strict_controller.port), timeout=5)
        for _ in range(MAX_CONNECTIONS + 8)
    ]
    try:
        time.sleep(0.5)  # well inside the header timeout
        refused = []
        for s in socks:
            ready, _, _ = select.select([s], [], [], 0)
            if ready:
                refused.append(read_answer(s, time.monotonic(), timeout=SLACK))
        assert len(refused) >= 8
        assert all(a.status == 503 for a in refused), refused
        assert refused[0].json()["code"] == "too_many_connections"
        assert refused[0].headers.get("retry-after") == "1"
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the server notices the closed sockets shortly
        if httpx.get(strict_controller.url + "/healthz").status_code == 200:
            break
        assert time.monotonic() < deadline


def test_per_token_request_cap(stenant: Tenant) -> None:
    ctl = stenant.controller
    run, other = start_run(stenant), start_run(stenant)
    headers = {"Authorization": f"Bearer {run.token}", "Content-Length": str(1 << 20)}
    stalled = [
        socket.create_connection(("127.0.0.1", ctl.port), timeout=5) for _ in range(PER_TOKEN)
    ]
    try:
        for s in stalled:
            s.sendall(head("PUT", PREFIX + "/folders/task/uploads", headers) + b"\0" * 10)
        time.sleep(0.5)  # in flight, each waiting for its body
        with run.client() as c:
            r = c.get("/run")
        assert r.status_code == 429, r.text
        assert r.json()["code"] == "too_many_requests"
        assert r.headers["retry-after"] == "1"
        with other.client() as c:  # another token is not affected
            assert c.get("/run").status_code == 200
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 5
    while True:
        with run.client() as c:
            if c.get("/run").status_code == 200:
                break
        assert time.monotonic() < deadline, "slots were not released"
        time.sleep(0.1)
    assert run_uploads(ctl, run) == 0


# --- configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    "flag", ["--body-idle-timeout", "--max-connections", "--max-requests-per-token"]
)
def test_serve_refuses_a_disabled_limit(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = controller_main(["serve", "--data-dir", str(tmp_path), flag, "0"])
    assert code == 1
    assert f"{flag} must be positive" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before touching the data dir


def test_large_checkpoint_is_parsed_off_the_event_loop(stenant: Tenant) -> None:
    """While a 100,000-entry checkpoint is validated, other requests are still answered."""
    import threading

    run = start_run(stenant)
    deep = "/".join(f"seg{j}" for j in range(60))  # path checks dominate: ~2 s of CPU
    entries: list[dict[str, object]] = [
        {"op": "mkdir", "path": f"{deep}/{i}"} for i in range(100_000 - 1)
    ]
    entries.append({"op": "link", "path": "x"})  # refused only after every entry was checked
    gaps: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=stenant.controller.url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert c.get("/openapi.json").status_code == 200
                gaps.append(time.monotonic() - t0)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.3)
        started = time.monotonic()
        r = run.commit("task", entries)
        took = time.monotonic() - started
    finally:
        stop.set()
        poller.join()
    assert r.status_code == 400, r.text
    assert r.json()["details"][0]["code"] == "invalid_op"
    assert len(gaps) > 5
    # Parsing on the loop would stall it for about the whole commit; on a
    # loaded machine the GIL still costs the poller some time, so the bound
    # scales with how long the commit took (never below 0.5 s).
    bound = max(0.5, 0.35 * took)
    assert max(gaps) < bound, f"event loop stalled {max(gaps):.2f} s of a {took:.2f} s commit"
