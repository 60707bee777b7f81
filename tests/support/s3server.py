"""Start an S3-protocol server (moto in server mode, :mod:`tests.support.motoserver`)
as a subprocess for tests.

A real HTTP server rather than moto's in-process mocking: the provider then
goes through botocore's whole stack (signing, retries, streaming bodies,
connection errors), which is what production exercises too.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from tests.support.procs import free_port

# moto's server, reporting real initiation times of multipart uploads.
_MOTO_SERVER = Path(__file__).with_name("motoserver.py")

# Fake credentials: moto accepts anything, and botocore refuses to sign without some.
FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3ServerError(RuntimeError):
    """The server process died or did not answer before the deadline."""


class S3Server:
    """One moto server process on 127.0.0.1; ``start()`` returns once it answers HTTP."""

    def __init__(self, port: int | None = None, startup_timeout: float = 30.0) -> None:
        self.port = port if port is not None else free_port()
        self.startup_timeout = startup_timeout
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: nobody drains a pipe while tests run, and a full
        # pipe would stall the server mid-request.
        self._log: IO[bytes] | None = None

    def start(self) -> S3Server:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the server; stop() closes it
        env = {**os.environ, **FAKE_CREDENTIALS}
        self._process = subprocess.Popen(
            [sys.executable, str(_MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self._wait_until_answering()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_until_answering(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            # Fail at once if the process died (port taken, import error) instead
            # of waiting out the deadline against a server that cannot come.
            code = self._process.poll()
            if code is not None:
                raise S3ServerError(
                    f"S3 server on port {self.port} exited with status {code}:\n{self.output()}"
                )
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"S3 server on port {self.port} did not answer within "
                    f"{self.startup_timeout:.0f}s:\n{self.output()}"
                )
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/", timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP status means something is serving
        except OSError:
            return False

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None


@contextlib.contextmanager
def running_s3_server(port: int | None = None, startup_timeout: float = 30.0) -> Iterator[S3Server]:
    server = S3Server(port, startup_timeout).start()
    try:
        yield server
    finally:
        server.stop()


__all__ = ["FAKE_CREDENTIALS", "S3Server", "S3ServerError", "free_port", "running_s3_server"]
