"""`make demo`: a controller on its embedded defaults and a demo sandbox.

Starts `controller serve` (embedded PostgreSQL, local_disk), creates a demo
company, user, project, task and agent once (kept in ``<data-dir>/demo.json``
so the next `make demo` reuses them and the same token; the agent's folder
starts with its instruction entry, ``AGENTS.md``, which the demo fills with a
few lines the Files page's editor opens from "Instructions"), and a local bare
Git repository (``<data-dir>/demo-app.git``, no network needed) bound to the
project as its primary workspace. It starts a run for them and runs
`fsagent up` on ``demo-home/``: the four folders are mounted, the task's
checkout is prepared in ``demo-home/repos/demo-app`` (cloned the first time,
kept as it is at the next start, restored from its last checkpoint when
``demo-home`` was deleted) and saved every ``--checkpoint-interval`` seconds
and at stop; `fsagent up` also serves the run's local API endpoint
(``fsagent bridge``) and writes the sandbox's env file
(``PAPERCLIP_API_URL``, ``PAPERCLIP_PRIMARY_REPO``, ...). The printed
``curl`` lines under "Inside the sandbox" use only that env file: no token
of their own. Ctrl-C stops fsagent (final saves) and then the controller.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from controller import admin, agentfiles
from controller.cli import database
from controller.config import Settings

DEMO_REPO = "demo-app"
DEMO_INSTRUCTIONS = (
    "# Demo agent\n\n"
    "These are the demo agent's instructions (its AGENTS.md). Edit them on the Files\n"
    "page: open the agent's folder and choose Instructions.\n"
)
EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def ensure_demo_account(data_dir: Path) -> dict[str, str]:
    saved = data_dir / "demo.json"
    if saved.exists():
        account: dict[str, str] = json.loads(saved.read_text())
    else:
        with database(Settings(data_dir=data_dir)) as url:
            boot = admin.bootstrap(url, "Demo company", "demo@example.com")
            company = boot["company_id"]
            project = admin.create_owner(url, "projects", company, "Demo project")["id"]
            task = admin.create_owner(url, "tasks", company, "Demo task", project=project)
            agent = admin.create_owner(url, "agents", company, "Demo agent")["id"]
        account = {**boot, "project_id": project, "task_id": task["id"], "agent_id": agent}
    if "workspace_id" not in account:  # also for a demo.json from before repositories
        origin = ensure_demo_repo(data_dir)
        with database(Settings(data_dir=data_dir)) as url:
            workspace = admin.add_workspace(
                url,
                account["project_id"],
                repo_url=str(origin),
                name=DEMO_REPO,
                ref=None,
                primary=True,
                setup_command=None,
            )
        account["workspace_id"] = workspace["workspace_id"]
    saved.write_text(json.dumps(account, indent=2))
    os.chmod(saved, 0o600)
    return account


def ensure_demo_repo(data_dir: Path) -> Path:
    """A local bare repository with one commit: the demo's origin (no network)."""
    origin = data_dir / f"{DEMO_REPO}.git"
    if origin.exists():
        return origin
    seed = data_dir / f"{DEMO_REPO}-seed"
    seed.mkdir(parents=True, exist_ok=True)
    (seed / "README.md").write_text("# Demo app\n\nCommit here; stop and start the demo again.\n")
    identity = ["-c", "user.name=Demo", "-c", "user.email=demo@example.com"]
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "README.md"],
        [*identity, "commit", "-q", "-m", "Initial commit"],
        ["clone", "-q", "--bare", str(seed), str(origin)],
    ):
        subprocess.run(["git", *args], cwd=seed, check=True, capture_output=True)
    shutil.rmtree(seed)
    return origin


def wait_until(check: Any, what: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            raise SystemExit(f"demo: {what} failed (exit {proc.returncode})")
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: {what} did not happen within {timeout:.0f}s")
        time.sleep(0.1)


def fsagent_command() -> str:
    """fsagent as an absolute command line, so that each printed line works
    from any directory (the sandbox's shell starts in its home, not here):
    the script next to this Python (the virtualenv's), else this Python
    running the module."""
    python = Path(os.path.abspath(sys.executable))
    script = python.parent / "fsagent"
    if os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return shlex.join([str(python), "-m", "fsagent.cli"])


def sandbox_lines(env_file: Path, acc: dict[str, str], home: Path) -> list[str]:
    """Lines to paste into a shell "inside the sandbox": its env file, then the
    API through the local endpoint (which adds the run token). They say where
    the API's write shows: on the controller at once, in the mounted task
    folder only at the next run (no incoming
    refresh during a run; fsagent is the mount's only writer)."""
    task = f"/api/companies/{acc['company_id']}/work-folders/task/{acc['task_id']}"
    url = f'"$PAPERCLIP_API_URL{task}/content?path=notes.md"'
    env, where = shlex.quote(str(env_file)), shlex.quote(str(home))
    return [
        "",
        "Inside the sandbox (its env file, then the API through the local endpoint; no token).",
        "An API write is saved on the controller at once and reaches the mounted folders at",
        f"the next run (no refresh during a run): `ls {where}/task` shows notes.md after",
        "Ctrl-C and `make demo` again:",
        f"  set -a; . {env}; set +a",
        "  curl -sS -X PUT -H 'Content-Type: application/octet-stream'"
        f" --data-binary 'written from the sandbox' {url}",
        f"  curl -sS {url}",
        f"  {fsagent_command()} launch --home {where} --env-file {env} -- 'curl -sS {url}'",
    ]


def write_instructions(base: str, acc: dict[str, str]) -> None:
    """Fill the demo agent's empty AGENTS.md once; never over someone's edit
    (If-Match: the empty file's digest)."""
    folder = f"{base}/api/companies/{acc['company_id']}/work-folders/agent/{acc['agent_id']}"
    resp = httpx.put(
        f"{folder}/content",
        params={"path": "AGENTS.md"},
        content=DEMO_INSTRUCTIONS.encode(),
        headers={
            "Authorization": f"Bearer {acc['token']}",
            "Content-Type": "application/octet-stream",
            "X-File-Content-Type": "text/markdown",
            "If-Match": f'"{EMPTY_DIGEST}"',
        },
        timeout=30,
    )
    if resp.status_code not in (200, 201, 412):
        print(f"demo: could not write the agent's instructions: {resp.text}", file=sys.stderr)


def healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(prog="controller-demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".demo"))
    parser.add_argument("--home", type=Path, default=Path("demo-home"))
    parser.add_argument("--listen", default="127.0.0.1:8750")
    parser.add_argument("--checkpoint-interval", type=float, default=30.0)
    parser.add_argument("--no-mount", action="store_true", help="only the controller")
    args = parser.parse_args()
    data_dir, home = args.data_dir.resolve(), args.home.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    acc = ensure_demo_account(data_dir)
    base = f"http://{args.listen}"
    task_state = shlex.quote(str(data_dir / "fsagent" / "task"))
    fsagent_cmd = fsagent_command()

    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    controller = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "serve",
            "--data-dir",
            str(data_dir),
            "--listen",
            args.listen,
        ],
        start_new_session=True,
    )
    fsagent: subprocess.Popen[bytes] | None = None
    run_id: str | None = None
    try:
        wait_until(lambda: healthy(base), "controller start", 120, controller)
        lines = []
        with database(Settings(data_dir=data_dir)) as url:
            # An agent of an older demo.json gets its (empty) entry here.
            admin.in_transaction(
                url, lambda c: agentfiles.ensure_entry(c, acc["company_id"], acc["agent_id"])
            )
        write_instructions(base, acc)
        if not args.no_mount:
            with database(Settings(data_dir=data_dir)) as url:
                run = admin.start_run(
                    url,
                    acc["company_id"],
                    agent=acc["agent_id"],
                    task=acc["task_id"],
                    project=acc["project_id"],
                    user=acc["user_id"],
                    sandbox="demo-sandbox",
                    home=str(home),
                )
            run_id = run["run_id"]
            token_file = data_dir / "run-token"
            token_file.write_text(run["token"])
            os.chmod(token_file, 0o600)
            home.mkdir(parents=True, exist_ok=True)
            fsagent = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fsagent.cli",
                    "up",
                    "--home",
                    str(home),
                    "--controller",
                    base,
                    "--token-file",
                    str(token_file),
                    "--state-root",
                    str(data_dir / "fsagent"),
                    "--checkpoint-interval",
                    str(args.checkpoint_interval),
                    # The demo shows the FUSE mounts; a sandbox without FUSE
                    # would use plain directories (fsagent up --mode auto).
                    "--mode",
                    "fuse",
                ],
                start_new_session=True,
            )
            env_file = data_dir / "fsagent" / "env"
            env_file.unlink(missing_ok=True)
            # up writes the env file once every collection is mounted.
            wait_until(env_file.exists, "mounting", 300, fsagent)
            checkout = home / "repos" / DEMO_REPO
            lines = [
                f"Sandbox:     {home}/{{task,agent,user,project}} (run {run['run_id']})",
                f"             saved every {args.checkpoint_interval:.0f}s and at Ctrl-C;"
                f" save now: {fsagent_cmd} flush task --state-dir {task_state}",
                f"Repository:  {checkout} (the task's clone of {data_dir}/{DEMO_REPO}.git)",
                f"             saved every {args.checkpoint_interval:.0f}s and at Ctrl-C;"
                f" save now: {fsagent_cmd} repos checkpoint"
                f" --home {shlex.quote(str(home))}"
                f" --state-root {shlex.quote(str(data_dir / 'fsagent'))} --controller {base}"
                f" --token-file {shlex.quote(str(data_dir / 'run-token'))}",
                f"             commit there, Ctrl-C, `make demo` again: the commit is there;"
                f" then delete {home} and `make demo`: restored from its checkpoint",
            ]
            lines += sandbox_lines(env_file, acc, home)
        folder = f"{base}/api/companies/{acc['company_id']}/work-folders/user/{acc['user_id']}"
        task_folder = f"{base}/api/companies/{acc['company_id']}/work-folders/task/{acc['task_id']}"
        print(
            f"""
Controller:  {base}   (data in {data_dir})
API token:   {acc["token"]}
Files page:  {base}/files/   (sign in with the API token above)
Agent:       {base}/files/{acc["company_id"]}/agent/{acc["agent_id"]}   ("Instructions" edits its AGENTS.md)
{chr(10).join(lines)}

Try:
  T={acc["token"]}
  echo hello > {shlex.quote(str(home / "task" / "hello.txt"))} && {fsagent_cmd} flush task --state-dir {task_state}
  curl -sS -H "Authorization: Bearer $T" '{task_folder}/'
  curl -sS -H "Authorization: Bearer $T" '{task_folder}/content?path=hello.txt'
  curl -sS -X PUT -H "Authorization: Bearer $T" -H 'Content-Type: application/octet-stream' \\
       --data-binary 'hi' '{folder}/content?path=notes/hi.txt'
  curl -sS -X POST -H "Authorization: Bearer $T" -H 'Content-Type: application/json' \\
       -d '{{"action":"delete","path":"notes"}}' '{folder}/operations'
  curl -sS -H "Authorization: Bearer $T" '{folder}/?trash=true'

Press Ctrl-C to stop (fsagent saves, then the controller stops).
""",
            flush=True,
        )
        while (
            not stopping
            and controller.poll() is None
            and (fsagent is None or fsagent.poll() is None)
        ):
            time.sleep(0.2)
    finally:
        code = 0
        if fsagent is not None and fsagent.poll() is None:
            fsagent.send_signal(signal.SIGTERM)
            code = fsagent.wait(timeout=300)
            print(
                f"demo: fsagent stopped (exit {code}{', saved' if code == 0 else ', SAVE FAILED'})"
            )
            # The demo's sandbox is done: its folders' directories are given
            # back (fsagent keeps a stopped mountpoint immutable), so the home
            # can be deleted and restored by the next `make demo`.
            subprocess.run([sys.executable, "-m", "fsagent.cli", "release",
                            *(str(home / s) for s in ("task", "agent", "user", "project"))],
                           check=False)  # fmt: skip
        if run_id is not None and controller.poll() is None:
            # The sandbox is gone: end the run so /sync shows it stopped.
            with database(Settings(data_dir=data_dir)) as url:
                admin.end_run(url, run_id)
        if controller.poll() is None:
            controller.send_signal(signal.SIGTERM)
            controller.wait(timeout=60)
        print("demo: controller stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
