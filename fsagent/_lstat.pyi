def lstat_keys(
    dir_fd: int,
    paths: list[str],
    previous: list[tuple[int, int, int, int, int, int] | None] | None = None,
    /,
) -> list[tuple[int, int, int, int, int, int] | None]: ...
