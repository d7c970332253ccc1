"""A reproduction's stage as a child process (dsl_lit.reproduce.stage_process): forked from the
runner or a fresh interpreter, the stage sees the same thing (its directory, environment, arguments,
log) and the runner sees the same exit status, a SIGTERM included. Each case runs in a fresh
single-threaded interpreter (a pytest-xdist worker has threads, where the runner would not fork).
The whole chain forking its stages: tests/e2e/recipes/test_reproduce.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

STAGE = """
import json, os, signal, sys, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("STAGE_VALUE"),
                  "main": __name__}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""

RUNNER = """
import json, os, signal, sys, time
from pathlib import Path
from dsl_lit.reproduce.stage_process import ForkedStage, start_stage
script, log, cwd, fork, arg = sys.argv[1:]
env = {**os.environ, "STAGE_VALUE": "from the runner"}
child = start_stage([script, arg], cwd=Path(cwd), env=env, log_path=Path(log), keep_fd=None, fork=fork == "1")
if arg == "sleep":
    time.sleep(1.0)
    child.send_signal(signal.SIGTERM)
while (code := child.poll()) is None:
    time.sleep(0.05)
print(json.dumps({"code": code, "forked": isinstance(child, ForkedStage)}))
"""


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
@pytest.mark.parametrize(("arg", "code"), [("0", 0), ("3", 3), ("a message", 1), ("sleep", -15)])
def test_a_stage_sees_and_returns_the_same_forked_or_fresh(tmp_path: Path, fork: bool, arg: str, code: int) -> None:
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(STAGE))
    log, cwd = tmp_path / "stage.log", tmp_path / "work"
    cwd.mkdir()
    log.write_text("$ the command\n")
    result = subprocess.run([sys.executable, "-c", RUNNER, str(script), str(log), str(cwd), str(int(fork)), arg],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome == {"code": code, "forked": fork}
    lines = log.read_text().splitlines()
    assert lines[0] == "$ the command"  # appended to, not truncated
    seen = json.loads(lines[1])
    assert seen == {"argv": [arg], "cwd": str(cwd), "env": "from the runner", "main": "__main__"}
    if arg == "a message":  # sys.exit("...") prints it and exits 1, as python does
        assert lines[2] == "a message"
