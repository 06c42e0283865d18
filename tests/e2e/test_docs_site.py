"""`make docs`: the guides and the generated Python API reference build as a static site,
offline, and a broken link fails the build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    return project


def test_docs_build_offline_with_the_api_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = _build(ROOT, site)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index.html", "api.html", "state-machine.html", "trainer-guide.html", "fleet.html"):
        assert (site / page).is_file(), page
    trainer = (site / "reference" / "trainer.html").read_text()
    for name in ("WorkerClient", "AsyncWorkerClient", "Broadcaster", "save_checkpoint"):
        assert name in trainer, name
    assert "Controller" in (site / "reference" / "core.html").read_text()
    # every public package has a reference page naming what it offers
    offered = {
        "ray": ("RayFleet", "WorkerActor", "ActorTransport"),
        "router": ("Router", "create_router_app", "Policy"),
        "serve": ("create_app", "ServerThread"),
        "trainer": ("DeltaTrainer", "ShardedPusher", "weights_digest"),
        "fleet": ("FleetCoordinator", "TransactionResult", "Journal", "admit"),
    }
    for package, names in offered.items():
        page = (site / "reference" / f"{package}.html").read_text()
        for name in names:
            assert f'id="weightsync.{package}.' in page and name in page, (package, name)
    # offline: no page pulls fonts or scripts from another host
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


def test_a_broken_link_fails_the_docs_build(tmp_path: Path) -> None:
    project = _copy_project(tmp_path)
    with (project / "docs" / "embedding.md").open("a") as f:
        f.write("\nSee [a page that does not exist](no-such-page.md).\n")
    done = _build(project, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr
