"""What a stranger installs: the sdist and the wheel, built, checked and installed as a user would.

The wheel is installed (not editable) into a fresh virtualenv, through the committed lock, and
the README's main job is run from it in a folder that holds nothing of the checkout but the
example processor: a file the wheel forgot, or one it only finds in the checkout, fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import kclpy

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "kinesis-kclpy"

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("src") / "kclpy"
    # build from a copy, so that setuptools' build/ and egg-info never land in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
        "node_modules"))
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out),
                    str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_distributions_are_named_and_versioned_from_one_place(dists: dict[str, Path]) -> None:
    stem = DISTRIBUTION.replace("-", "_")
    assert dists["wheel"].name.startswith(f"{stem}-{kclpy.__version__}-py3-none-any")
    assert dists["sdist"].name == f"{stem}-{kclpy.__version__}.tar.gz"


def test_twine_accepts_both(dists: dict[str, Path]) -> None:
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                             str(dists["wheel"]), str(dists["sdist"])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_wheel_holds_the_package_typed_and_licensed_and_nothing_else(
    dists: dict[str, Path],
) -> None:
    names = zipfile.ZipFile(dists["wheel"]).namelist()
    assert "kclpy/py.typed" in names
    assert "kclpy/__init__.py" in names
    assert any(re.fullmatch(r"[^/]+\.dist-info/(licenses/)?LICENSE", n) for n in names), names
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kclpy"}, tops
    with tarfile.open(dists["sdist"]) as sdist:
        members = sdist.getnames()
    assert any(m.endswith("/LICENSE") for m in members)


def test_the_installed_wheel_runs_the_readme_main_job(
    dists: dict[str, Path], tmp_path: Path,
) -> None:
    # A user's shell, not this test process's: the Spark tests' session puts the checkout on
    # PYTHONPATH, where its egg-info would tell pip that kinesis-kclpy is installed already.
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("AWS_", "KCLPY_", "PYTHON", "VIRTUAL_ENV"))}
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300,
                   env=environment)
    python = env_dir / "bin" / "python"
    # --no-compile: pip would byte-compile every module of every dependency (moto's
    # thousands among them), a third of the install's CPU on a 2-core CI machine; the job
    # below compiles what it imports, as a user's first run does.
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-compile", f"{dists['wheel']}[local]",
         "-c", str(ROOT / ".ci" / "constraints.txt")],
        capture_output=True, text=True, timeout=600, env=environment)
    assert install.returncode == 0, install.stderr[-3000:]
    assert (env_dir / "bin" / "kclpy-worker").exists(), install.stdout[-3000:]
    work = tmp_path / "user"
    (work / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "printing_processor.py", work / "examples")
    environment["PATH"] = os.pathsep.join([str(env_dir / "bin"), environment.get("PATH", "")])
    version = subprocess.run([str(env_dir / "bin" / "kclpy"), "--version"], cwd=work,
                             capture_output=True, text=True, timeout=60, env=environment)
    assert version.stdout.strip() == f"kclpy {kclpy.__version__}", version
    run = subprocess.run(
        [str(env_dir / "bin" / "kclpy-worker"), "--local", "--processor",
         "examples/printing_processor.py:PrintingProcessor", "--stop-when-caught-up"],
        cwd=work, capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [line for line in run.stdout.splitlines() if " data=" in line]
    assert len(records) == 20, run.stdout
    where = subprocess.run([str(python), "-c", "import kclpy; print(kclpy.__file__)"],
                           cwd=work, capture_output=True, text=True, timeout=60, env=environment)
    assert str(env_dir) in where.stdout and str(ROOT) not in where.stdout, where.stdout
