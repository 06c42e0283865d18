"""The package as a user gets it: an sdist and a wheel built with ``python -m build``, each
installed into a fresh virtualenv with the documented extras, then used from there.

Nothing here imports weightsync from the source tree: every command runs in the fresh
virtualenv's own interpreter, from a directory outside the clone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
# The tested CPU build; installed first so that the torch extra's `torch>=2.4` is already met.
TORCH = "torch==2.13.0"


def _clean_env() -> dict[str, str]:
    """The environment of a newcomer's shell: no PYTHONPATH pointing into the clone."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _sh(*cmd: str | Path, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist first, then the wheel built from that sdist (so the sdist is known complete)."""
    out = tmp_path_factory.mktemp("dist")
    _sh(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT, cwd=out)
    return out


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin"


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("weightsync-*.whl")
    return wheel


def test_build_makes_an_sdist_and_a_wheel_of_one_version(dist: Path) -> None:
    from weightsync import __version__

    (sdist,) = dist.glob("weightsync-*.tar.gz")
    wheel = _wheel(dist)
    assert sdist.name == f"weightsync-{__version__}.tar.gz"
    assert wheel.name.startswith(f"weightsync-{__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(f"weightsync-{__version__}.dist-info/METADATA").decode()
    assert "weightsync/py.typed" in names and "weightsync/core/_state.py" in names
    assert not any(n.startswith("tests/") for n in names)
    for extra in ("http", "torch", "vllm", "vllm-cpu", "dev"):
        assert f"Provides-Extra: {extra}" in metadata, extra
    assert 'Requires-Dist: vllm>=0.11; extra == "vllm"' in metadata
    with tarfile.open(sdist) as t:
        members = t.getnames()
    assert f"weightsync-{__version__}/README.md" in members
    assert f"weightsync-{__version__}/CHANGELOG.md" in members


def test_wheel_without_extras_gives_the_pure_core(dist: Path, tmp_path: Path) -> None:
    bin_ = _fresh_venv(tmp_path / "venv")
    _sh(bin_ / "pip", "install", "-q", _wheel(dist), cwd=tmp_path)
    probe = (
        "import sys, weightsync.core, weightsync; "
        "print(weightsync.__version__, sorted(m for m in ('torch', 'fastapi', 'httpx') if m in sys.modules))"
    )
    version, heavy = _sh(bin_ / "python", "-c", probe, cwd=tmp_path).split(" ", 1)
    from weightsync import __version__

    assert version == __version__
    assert heavy.strip() == "[]"


def test_wheel_with_http_torch_dev_serves_and_takes_an_update(dist: Path, tmp_path: Path) -> None:
    bin_ = _fresh_venv(tmp_path / "venv")
    # --no-compile: what is installed, and how it runs, is the same without the bytecode pip would
    # otherwise write for every module of torch (most of this test's time)
    _sh(bin_ / "pip", "install", "-q", "--no-compile", TORCH, cwd=tmp_path)
    _sh(bin_ / "pip", "install", "-q", "--no-compile", f"{_wheel(dist)}[http,torch,dev]", cwd=tmp_path)
    assert "serve" in _sh(bin_ / "weightsync", "--help", cwd=tmp_path)
    # the test kit imports (it needs the dev extra's hypothesis)
    _sh(bin_ / "python", "-c", "import weightsync.testing", cwd=tmp_path)

    ckpt = tmp_path / "ckpt-step-1"
    _sh(bin_ / "weightsync", "checkpoint", "--model-config", "tiny", "--seed", "1",
        "--version", "step-1", "--out", ckpt, cwd=tmp_path)  # fmt: skip
    port = free_port()
    worker = subprocess.Popen(
        [bin_ / "weightsync", "serve", "--model-config", "tiny", "--port", str(port)],
        cwd=tmp_path, env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the installed worker did not start"
            time.sleep(0.2)
        assert httpx.post(f"{url}/engine/pause_generation", json={}).status_code == 200
        reply = httpx.post(
            f"{url}/engine/update_weights_from_disk",
            json={"model_path": str(ckpt), "weight_version": "step-1"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert httpx.post(f"{url}/engine/resume_generation", json={}).status_code == 200
        state = httpx.post(f"{url}/engine/get_weight_version", json={}).json()
        assert (state["version"], state["version_declared"]) == ("step-1", True)
        # the worker holds exactly the checkpoint's weights: the digest its manifest promises
        (manifest,) = (json.loads(p.read_text()) for p in ckpt.glob("*.json") if "digest" in p.read_text())
        assert state["digest"] == manifest["digest"]
    finally:
        worker.terminate()
        worker.wait(30)
        if worker.stderr is not None:
            worker.stderr.close()
