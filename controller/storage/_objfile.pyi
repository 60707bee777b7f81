import asyncio
from collections.abc import Sequence

def put_new(root: str, parts: Sequence[str], name: str, data: bytes, /) -> int: ...
def start(threads: int, /) -> int: ...
def submit(
    token: asyncio.Future[tuple[int, int]],
    root: str,
    parts: Sequence[str],
    name: str,
    data: bytes,
    /,
) -> None: ...
def collect() -> list[tuple[asyncio.Future[tuple[int, int]], int, int]]: ...
