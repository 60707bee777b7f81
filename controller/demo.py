"""`make demo`: the controller on its embedded defaults, with a ready token.

Credentials are created once and kept in ``<data-dir>/demo.json`` so a second
`make demo` reuses the same company, user and token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from controller import admin
from controller.cli import database
from controller.cli import main as controller_main
from controller.config import Settings


def ensure_demo_account(data_dir: Path) -> dict[str, str]:
    saved = data_dir / "demo.json"
    if saved.exists():
        account: dict[str, str] = json.loads(saved.read_text())
        return account
    with database(Settings(data_dir=data_dir)) as url:
        boot = admin.bootstrap(url, "Demo company", "demo@example.com")
        project = admin.create_owner(url, "projects", boot["company_id"], "Demo project")["id"]
        task = admin.create_owner(url, "tasks", boot["company_id"], "Demo task", project=project)
        agent = admin.create_owner(url, "agents", boot["company_id"], "Demo agent")["id"]
    account = {**boot, "project_id": project, "task_id": task["id"], "agent_id": agent}
    saved.write_text(json.dumps(account, indent=2))
    os.chmod(saved, 0o600)
    return account


def main() -> int:
    parser = argparse.ArgumentParser(prog="controller-demo")
    parser.add_argument("--data-dir", type=Path, default=Path(".demo"))
    parser.add_argument("--listen", default="127.0.0.1:8750")
    args = parser.parse_args()
    data_dir = args.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    acc = ensure_demo_account(data_dir)
    base = f"http://{args.listen}"
    folder = f"{base}/api/companies/{acc['company_id']}/work-folders/user/{acc['user_id']}"
    task_folder = f"{base}/api/companies/{acc['company_id']}/work-folders/task/{acc['task_id']}"
    print(
        f"""
Controller:   {base}   (data in {data_dir})
API token:    {acc["token"]}
Files page:   {base}/files/   (sign in with the API token above)
Company:      {acc["company_id"]}
Task folder:  {task_folder}

Try:
  T={acc["token"]}
  curl -sS -X PUT -H "Authorization: Bearer $T" -H 'Content-Type: application/octet-stream' \\
       --data-binary 'hello' '{folder}/content?path=notes/hello.txt'
  curl -sS -H "Authorization: Bearer $T" '{folder}/'
  curl -sS -H "Authorization: Bearer $T" '{folder}/content?path=notes/hello.txt'
  curl -sS -X POST -H "Authorization: Bearer $T" -H 'Content-Type: application/json' \\
       -d '{{"action":"delete","path":"notes"}}' '{folder}/operations'
  curl -sS -H "Authorization: Bearer $T" '{folder}/?trash=true'

Press Ctrl-C to stop.
""",
        flush=True,
    )
    return controller_main(["serve", "--data-dir", str(data_dir), "--listen", args.listen])


if __name__ == "__main__":
    sys.exit(main())
