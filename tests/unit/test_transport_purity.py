"""The transports sit side by side: a worker-side channel loads no web stack and no trainer
wing, and no channel imports a sibling it does not need.  Each check runs in a fresh
interpreter, so what another test imported cannot hide a dependency."""

from __future__ import annotations

import subprocess
import sys

import pytest

WEB = ("fastapi", "starlette", "uvicorn", "httpx", "prometheus_client")


def loaded_after(statement: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with one of ``prefixes`` loaded by a fresh interpreter running
    ``statement``."""
    code = (
        f"import sys; {statement}; "
        f"print(' '.join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


WORKER_SIDE = [
    "import weightsync.transports.disk",
    "from weightsync.transports.disk import DiskCheckpoint",
    "from weightsync.transports.disk.reader import DiskReader",
    "import weightsync.transports.tensor",
    "from weightsync.transports.tensor.shm import SharedReader",
    "import weightsync.transports.tensor.shm",
    "import weightsync.transports.distributed",
    "from weightsync.transports.distributed import GroupRegistry",
    "import weightsync.transports.distributed.worker",
    "import weightsync.transports.loading",
    "import weightsync.serve",
    "import weightsync.trainer",
]


@pytest.mark.parametrize("statement", WORKER_SIDE)
def test_worker_side_channels_load_no_web_stack(statement: str) -> None:
    assert loaded_after(statement, WEB) == []


@pytest.mark.parametrize("statement", WORKER_SIDE)
def test_worker_side_channels_load_no_trainer_wing(statement: str) -> None:
    loaded = loaded_after(statement, ("weightsync.trainer.",))
    assert loaded == []


def test_vllm_worker_extension_imports_no_web_stack() -> None:
    # The extension module starts a watchdog thread on import; it ends with this interpreter.
    statement = "import weightsync.engines.vllm.worker"
    assert loaded_after(statement, (*WEB, "weightsync.trainer", "weightsync.serve")) == []


SIBLINGS = {
    "weightsync.transports.tensor.shm": ("weightsync.transports.distributed", "weightsync.transports.disk"),
    "weightsync.transports.distributed.worker": ("weightsync.transports.disk", "weightsync.serve"),
    "weightsync.transports.disk.reader": (
        "weightsync.transports.distributed",
        "weightsync.transports.tensor",
    ),
}


@pytest.mark.parametrize("module", sorted(SIBLINGS))
def test_channels_do_not_import_their_siblings(module: str) -> None:
    assert loaded_after(f"import {module}", SIBLINGS[module]) == []


def test_the_transports_name_no_trainer_wing() -> None:
    import importlib

    from weightsync import serve as http
    from weightsync import trainer
    from weightsync.transports import disk, distributed, tensor

    for package, name in [
        (disk, "save_checkpoint"), (distributed, "Broadcaster"), (distributed, "PushFailed"),
        (tensor, "share_tensors"), (tensor, "SharedTensors"), (http, "WorkerClient"),
        (http, "AsyncWorkerClient"), (http, "raise_for_reply"), (http, "Fleet"), (http, "FleetError"),
    ]:  # fmt: skip
        assert name not in package.__all__
        with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
            getattr(package, name)
    for old in ("disk.writer", "distributed.trainer", "http", "http.client", "http.fleet"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"weightsync.transports.{old}")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = trainer.nope
