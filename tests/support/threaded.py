"""An ASGI app served by uvicorn on a thread of the test process (stand-ins and
proxies that tests inspect directly)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn


@dataclass
class ThreadedServer:
    """``uvicorn`` serving ``app`` on ``127.0.0.1:port`` until :meth:`stop`."""

    app: Any
    port: int
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self, timeout: float = 10.0) -> ThreadedServer:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            interface="asgi3",
            lifespan="off",
            loop="asyncio",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
