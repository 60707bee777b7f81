"""Test support shared by ``tests/`` and ``bench/``: one way to start each real part.

* :mod:`tests.support.constants` — the repository root and the four scopes.
* :mod:`tests.support.procs` — free ports, stopping and polling subprocesses,
  running a CLI that answers JSON.
* :mod:`tests.support.gitrepos` — real Git repositories: a bare origin with
  history, a checkout's local state (branch, staged, unstaged, untracked,
  exec bit, symlink) and the checks of its restore; a task with workspaces
  on a real controller.
* :mod:`tests.support.smallfs` — a small tmpfs that can be filled to ENOSPC.
* :mod:`tests.support.tmp` — private temp dirs (reachable by the embedded
  PostgreSQL's own user when running as root).
* :mod:`tests.support.controller` — embedded PostgreSQL, ``controller serve``
  in a subprocess, a tenant with its HTTP client.
* :mod:`tests.support.source` — DirectoryBridgeClient sources (run, manifests,
  objects) written from plain data.
* :mod:`tests.support.mount` — ``fsagent mount --foreground`` in a subprocess
  and a factory that tears every mount down.
* :mod:`tests.support.storage` — storage-provider helpers: S3 clients and
  providers on the moto server, objects stored from plain bytes, a source that
  fails mid-read, what a failed put left behind.
* :mod:`tests.support.checkpoints` — a checkpoint observed from outside:
  receipts and versions in PostgreSQL, a state dir's change set and status,
  ``fsagent flush`` as a subprocess.
* :mod:`tests.support.endpoint` — ``fsagent bridge`` (the sandbox's local API
  endpoint) as a subprocess, and a stand-in controller that records requests.
* :mod:`tests.support.threaded` — an ASGI app served by uvicorn on a thread
  (stand-ins and proxies the test inspects directly).
* :mod:`tests.support.bridge`, :mod:`tests.support.web`,
  :mod:`tests.support.s3server`, :mod:`tests.support.lossy_proxy` — a minimal
  bridge client, the headless browser, moto as an S3 server, a proxy that
  loses responses.

pytest plugins (registered by ``tests/conftest.py`` through ``pytest_plugins``):

* :mod:`tests.support.fixtures` — ``pg_cluster``, ``controller``, ``tenant``,
  ``mounts``, ``module_mounts``, ``mnt``, and the storage providers'
  ``s3_server`` (one per session), ``s3_bucket``, ``s3_provider``,
  ``local_provider``.
* :mod:`tests.support.browser` — ``browser`` (headless Chromium per module),
  ``page`` (a context per test, sized by the ``viewport`` fixture), ``views``
  (screenshots).
* :mod:`tests.support.session` — a per-session temp root that must be empty
  when the session ends, and the check that fails a test on unexpected
  WARNING log records.

Nothing here imports pytest except the two plugins, so the benchmarks can use
the same helpers the tests prove.
"""
