"""The layering is written down as import contracts (pyproject's ``[tool.importlinter]``):
the tree keeps every one, and an arrow pointing up or a circle breaks the contract that names
it.  Each check runs ``lint-imports`` in a fresh process over a copy of the source."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path) -> tuple[int, str]:
    """``lint-imports`` with the project's contracts over the package under ``src``: its exit
    status and its report, whitespace collapsed."""
    env = {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200", "NO_COLOR": "1"}
    out = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")],
        capture_output=True, text=True, timeout=120, cwd=src, env=env,
    )  # fmt: skip
    return out.returncode, re.sub(r"\s+", " ", out.stdout + out.stderr)


def test_the_tree_keeps_every_import_contract() -> None:
    code, report = lint_imports(ROOT / "src")
    assert code == 0, report
    assert "0 broken" in report, report


LAYERS = "each layer imports only those below it; trainer and engines never import each other"
BREAKS = [
    ("core/snapshot.py", "import weightsync.transports.sink", "core imports nothing of weightsync"),
    ("core/snapshot.py", "import weightsync.trainer.client", LAYERS),
    ("transports/sink.py", "import weightsync.engines.stamps", LAYERS),
    ("engines/stamps.py", "import weightsync.trainer.client", LAYERS),
    (
        "trainer/share.py", "import weightsync.serve.app",
        "trainer imports only the trainer-facing parts of transports, never the worker's",
    ),
    ("fleet/result.py", "import weightsync.transports.sink", "fleet imports trainer and core, not the worker side"),
    (
        "router/policy.py", "import weightsync.engines.stamps",
        "router imports fleet, trainer and core, not the worker side",
    ),
    ("serve/completions.py", "import weightsync.serve.app", "no import circle anywhere in weightsync"),
    ("edge/origin.py", "import weightsync.transports.sink", "edge (what every front door shares) imports only core"),
    (
        "serve/guard.py", "import weightsync.router.policy",
        "the worker's front door and the router share edge and never import each other",
    ),
    ("core/requests.py", "import weightsync.edge.origin", "core imports nothing of weightsync"),
    ("lora/slots.py", "import weightsync.transports.hashing", "lora (the adapter slots, pure like core) imports only core"),
    ("core/controller.py", "import weightsync.lora.slots", "core imports nothing of weightsync"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "statement", "contract"), BREAKS)
def test_an_import_against_the_layering_breaks_its_contract(
    tmp_path: Path, module: str, statement: str, contract: str
) -> None:
    shutil.copytree(ROOT / "src" / "weightsync", tmp_path / "weightsync")
    target = tmp_path / "weightsync" / module
    target.write_text(target.read_text() + f"\n{statement}  # against the layering\n")
    code, report = lint_imports(tmp_path)
    assert code != 0, report
    assert f"{contract} BROKEN" in report, report
