"""Issue 43, point 10: a Makefile variable reaches its command as literal text, never as code.

Each target runs for real in a copy of the Makefile and cluster/ scripts, with VENV,
HELM and the interpreters replaced by a stub that logs its argv and environment; every
variable the target reads carries quotes, ``;``, backticks and ``$(...)``, each of which
would run ``touch pwned`` if the value were pasted into shell or Python source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: As typed on make's command line ($$ is make's escape for a literal $).
EVIL = "x\"; touch pwned; # ' ; touch pwned; # `touch pwned` $$(touch pwned) a b"
LITERAL = EVIL.replace("$$", "$")
STUB = """#!{python}
import json, os, sys
keys = ("RAY_ADDRESS", "RAY_PORT", "DASHBOARD_PORT", "TARGET", "CONFIG", "DEMO_STORE")
entry = {{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
         "env": {{k: os.environ[k] for k in keys if k in os.environ}}}}
with open(os.environ["STUB_LOG"], "a") as fh:
    fh.write(json.dumps(entry) + "\\n")
"""


@pytest.fixture
def work(tmp_path):
    """A copy of the Makefile and cluster/ scripts, and a stub venv whose tools log their argv."""
    work = tmp_path / "work"
    shutil.copytree(REPO / "cluster", work / "cluster")
    shutil.copy(REPO / "Makefile", work / "Makefile")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "privcode", "pytest", "helm"):
        (bin_dir / name).write_text(STUB.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    return work


def _make(work: Path, target: str, **variables: str) -> list[dict]:
    log = work / "stub.log"
    log.unlink(missing_ok=True)
    venv = work.parent / "venv"
    cmd = ["make", "-s", "-C", str(work), target, f"VENV={venv}", f"HELM={venv}/bin/helm"]
    cmd += [f"{name}={value}" for name, value in variables.items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MAKE"))}
    env.update(STUB_LOG=str(log), PRIVCODE_API_KEY="k")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(work.rglob("pwned")), f"a value ran as code in make {target}"
    return [json.loads(line) for line in log.read_text().splitlines()]


def _calls(log: list[dict], prog: str, first: str) -> list[list[str]]:
    return [e["argv"] for e in log if e["prog"] == prog and e["argv"][:1] == [first]]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_demo_passes_config_store_and_ports_as_literal_values(work):
    log = _make(work, "demo", CONFIG=EVIL, DEMO_STORE=EVIL, RAY_PORT=EVIL, DASHBOARD_PORT=EVIL)
    (init,) = _calls(log, "privcode", "budget")
    assert _after(init, "--store") == LITERAL
    (run,) = [e for e in log if e["prog"] == "privcode" and e["argv"][:1] == ["run"]]
    assert _after(run["argv"], "--config") == LITERAL
    assert f"privacy.store={LITERAL}" in run["argv"]
    assert run["env"]["RAY_ADDRESS"] == f"127.0.0.1:{LITERAL}"
    (up,) = [e for e in log if e["prog"] == "python" and "cluster" in e["argv"]]
    assert up["env"]["RAY_PORT"] == LITERAL and up["env"]["DASHBOARD_PORT"] == LITERAL


def test_sweep_and_study_pass_epsilons_prefix_and_notes_literally(work):
    log = _make(work, "sweep", CONFIG=EVIL, EPSILONS=EVIL)
    # SWEEP_PREFIX's default reads CONFIG's run name: CONFIG is an argv value there too.
    (prefix_call,) = [e["argv"] for e in log if e["prog"] == "python" and e["argv"][0] == "-c"]
    assert prefix_call[-1] == LITERAL and LITERAL not in prefix_call[1]
    runs = _calls(log, "privcode", "run")
    assert [_after(r, "--config") for r in runs] == [LITERAL] * len(LITERAL.split())
    assert [r[r.index("--set", 4) + 3] for r in runs] == [
        f"train.epsilon={word}" for word in LITERAL.split()
    ]

    log = _make(
        work, "study", STUDY_EPSILONS="1", SWEEP_PREFIX=EVIL, STUDY_OUT=EVIL, STUDY_NOTES=EVIL
    )
    (study,) = _calls(log, "privcode", "study")
    assert _after(study, "--reference") == LITERAL and _after(study, "--out") == LITERAL
    assert _after(study, "--notes") == LITERAL and _after(study, "--runs") == "study-eps1"


def test_serve_reads_config_through_argv_and_quotes_the_key_file(work):
    log = _make(work, "serve", CONFIG=EVIL)
    (paths,) = [e["argv"] for e in log if e["prog"] == "python" and e["argv"][0] == "-c"]
    assert paths[-1] == LITERAL and LITERAL not in paths[1]
    (serve,) = _calls(log, "privcode", "serve")
    assert _after(serve, "--config") == LITERAL


def test_submit_job_test_helm_and_gpu_check_split_argument_lists_without_evaluating(work):
    log = _make(work, "submit-job", CONFIG=EVIL, DEMO_STORE=EVIL, ARGS=EVIL)
    (submit,) = [e for e in log if e["prog"] == "python"]
    assert submit["env"]["CONFIG"] == LITERAL and submit["env"]["DEMO_STORE"] == LITERAL
    assert submit["argv"][-len(LITERAL.split()) :] == LITERAL.split()

    log = _make(work, "test-all", PYTEST_ARGS=EVIL)
    assert _calls(log, "pytest", "-m") == [["-m", "not gpu", *LITERAL.split()]]

    log = _make(work, "helm-template", VALUES=EVIL)
    (helm,) = [e["argv"] for e in log if e["prog"] == "helm"]
    assert _after(helm, "--values") == LITERAL

    log = _make(work, "gpu-check", ARGS=EVIL)
    (gpu,) = [e["argv"] for e in log if e["prog"] == "python"]
    assert gpu == ["bench/gpu_check.py", *LITERAL.split()]
