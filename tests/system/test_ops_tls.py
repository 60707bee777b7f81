"""`controller serve --tls-cert/--tls-key` and fsagent's `--ca-file` and plain-HTTP rule.

The CAs and the server certificate are made at test time with the `openssl` CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fsagent.bridge.tls import EXIT_INSECURE, InsecureController, TransportOptions, check_url
from tests.support.bridge import start_run
from tests.support.constants import REPO
from tests.support.controller import ControllerProcess, PgCluster, bootstrap_tenant
from tests.support.mount import MountFactory
from tests.support.pki import Pki, TlsControllerProcess, made_pki, running_tls_controller

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    yield from made_pki()


@pytest.fixture(scope="module")
def tls_controller(pg_cluster: PgCluster, pki: Pki) -> Iterator[TlsControllerProcess]:
    yield from running_tls_controller(pg_cluster, pki)


def test_controller_serves_https_only_to_clients_trusting_its_ca(
    tls_controller: TlsControllerProcess, pki: Pki
) -> None:
    assert "listening on https://" in tls_controller.log()
    r = httpx.get(tls_controller.url + "/readyz", verify=trusting(pki.ca))
    assert r.status_code == 200
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls_controller.url + "/healthz", verify=trusting(pki.other_ca))
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
        httpx.get(f"http://127.0.0.1:{tls_controller.port}/healthz")


@pytest.mark.fuse
def test_fsagent_saves_over_tls_with_ca_file(
    tls_controller: TlsControllerProcess, pki: Pki, mounts: MountFactory
) -> None:
    tenant = bootstrap_tenant(tls_controller)
    run = start_run(tenant)
    token_file = mounts.base / "token"
    token_file.write_text(run.token)
    m = mounts.mount(
        tls_controller.url, "task", token_file=token_file, extra=["--ca-file", str(pki.ca)]
    )
    (m.mountpoint / "hello.txt").write_bytes(b"over tls\n")
    reply = m.fsagent("flush")
    assert reply["ok"], reply
    with httpx.Client(
        base_url=tls_controller.url,
        verify=trusting(pki.ca),
        headers={"Authorization": f"Bearer {tenant.token}"},
    ) as c:
        r = c.get(tenant.folder("task", str(run.task)) + "/content", params={"path": "hello.txt"})
    assert r.status_code == 200
    assert r.content == b"over tls\n"


def fsagent_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "doctor", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_fsagent_refuses_a_wrong_ca(
    tls_controller: TlsControllerProcess, pki: Pki, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    out = fsagent_doctor("--controller", tls_controller.url, "--token-file", str(token),
                         "--ca-file", str(pki.other_ca))  # fmt: skip
    assert out.returncode == 6
    assert "TLS certificate not trusted" in out.stdout
    assert "CERTIFICATE_VERIFY_FAILED" in out.stdout


def test_fsagent_trusts_the_system_store_unless_given_a_ca_file(
    tls_controller: TlsControllerProcess, pki: Pki, tmp_path: Path
) -> None:
    """Without ``--ca-file`` fsagent verifies against the system trust store
    (OpenSSL's default paths, which ``SSL_CERT_FILE`` points at the test CA);
    with one, against that file alone."""
    tenant = bootstrap_tenant(tls_controller)
    run = start_run(tenant)
    token = tmp_path / "token"
    token.write_text(run.token)
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}

    def controller_check(extra_env: dict[str, str], *args: str) -> dict[str, str]:
        out = subprocess.run(
            [sys.executable, "-m", "fsagent.cli", "doctor", "--json", "--controller",
             tls_controller.url, "--token-file", str(token), *args],
            capture_output=True, text=True, cwd=REPO, timeout=60, env={**env, **extra_env},
        )  # fmt: skip
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        found: dict[str, str] = checks["controller"]
        return found

    trusted = controller_check({"SSL_CERT_FILE": str(pki.ca)})
    assert trusted["status"] == "ok", trusted
    assert run.run_id in trusted["detail"]
    default = controller_check({})
    assert default["status"] == "fail" and "CERTIFICATE_VERIFY_FAILED" in default["detail"]
    only_file = controller_check({"SSL_CERT_FILE": str(pki.ca)}, "--ca-file", str(pki.other_ca))
    assert only_file["status"] == "fail" and "CERTIFICATE_VERIFY_FAILED" in only_file["detail"]


@pytest.mark.parametrize("host", ["192.0.2.1", "controller.example"])
def test_fsagent_refuses_plain_http_off_loopback(host: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    (tmp_path / "m").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "fsagent.cli", "mount", "task", str(tmp_path / "m"),
         "--controller", f"http://{host}:8750", "--token-file", str(token),
         "--state-dir", str(tmp_path / "s"), "--foreground"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert out.returncode == EXIT_INSECURE
    line = out.stderr.strip()
    assert "\n" not in line
    assert line.startswith(f"fsagent: refusing plain http:// to {host}")


def test_insecure_http_flag_and_loopback_pass_the_rule() -> None:
    check_url("http://192.0.2.1:8750", TransportOptions(insecure_http=True))
    for url in ("http://127.0.0.1:1", "http://127.8.0.1", "http://localhost:1", "http://[::1]:1"):
        check_url(url, TransportOptions())
    check_url("https://controller.example", TransportOptions())
    with pytest.raises(InsecureController, match="must be https"):
        check_url("ftp://controller.example", TransportOptions())


def test_serve_refuses_an_unusable_certificate(controller: ControllerProcess, pki: Pki) -> None:
    code, _, err = controller.cli(
        "serve", "--tls-cert", str(pki.ca), "--tls-key", str(pki.key), "--listen", "127.0.0.1:1"
    )
    assert code == 1
    assert err.startswith("controller: cannot load --tls-cert/--tls-key:")
    assert err.count("\n") == 1
    code, _, err = controller.cli("serve", "--tls-cert", str(pki.cert), "--listen", "127.0.0.1:1")
    assert code == 1
    assert "--tls-cert and --tls-key go together" in err
