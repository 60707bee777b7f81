"""Test-time certificates made with the ``openssl`` CLI, and a ``controller
serve`` over HTTPS with them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.controller import ControllerProcess, PgCluster, world_searchable_tmpdir


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN={name}", "-keyout", key, "-out", cert)  # fmt: skip
    return key, cert


def make_server_cert(d: Path, ca_key: Path, ca_cert: Path) -> tuple[Path, Path]:
    key, csr, cert, ext = d / "server.key", d / "server.csr", d / "server.pem", d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", key, "-out", csr)  # fmt: skip
    openssl("x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
            "-days", "2", "-extfile", ext, "-out", cert)  # fmt: skip
    return cert, key


@dataclass
class Pki:
    ca: Path
    other_ca: Path
    cert: Path
    """Issued by ``ca`` for 127.0.0.1 and localhost."""
    key: Path


def made_pki() -> Iterator[Pki]:
    """A test CA, another CA, and a server certificate of the first; removed after."""
    d = world_searchable_tmpdir("fsa-pki-")
    try:
        ca_key, ca = make_ca(d, "test-ca")
        _, other_ca = make_ca(d, "other-ca")
        cert, key = make_server_cert(d, ca_key, ca)
        yield Pki(ca, other_ca, cert, key)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class TlsControllerProcess(ControllerProcess):
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


def running_tls_controller(pg_cluster: PgCluster, pki: Pki) -> Iterator[TlsControllerProcess]:
    """``controller serve --tls-cert --tls-key`` with ``pki``'s server certificate."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SSL_CERT_FILE", str(pki.ca))  # the readiness poll trusts the test CA
    ctl = TlsControllerProcess(
        pg_cluster.create_database(),
        world_searchable_tmpdir("fsa-ctl-tls-"),
        extra_args=["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)],
    )
    try:
        yield ctl.start()
    finally:
        ctl.stop()
        mp.undo()
        shutil.rmtree(ctl.data_dir, ignore_errors=True)
