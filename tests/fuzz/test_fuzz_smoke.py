"""Run the upload fuzz target briefly, so a reader crash fails `make test`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET = Path(__file__).with_name("fuzz_upload.py")


def test_fuzz_upload_frames_and_checkpoints_briefly(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(TARGET),
            "-max_total_time=5",
            "-rss_limit_mb=1024",
            "-timeout=10",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Done" in out, out[-4000:]
    assert len(list(corpus.iterdir())) >= 8  # the seeds were used and the corpus grew or held
    assert not list(tmp_path.glob("crash-*")), out[-4000:]
