"""Bad coordinator input is refused before any worker is touched, with a coded error and exit 2.

A real reference worker on loopback, real checkpoints, real journal files and the real CLI
(``weightsync.cli.main``, or a subprocess where the old behaviour was to hang).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import TINY, perturbed
from weightsync.cli import main
from weightsync.core import Controller
from weightsync.core.digest import weights_digest
from weightsync.engines.reference import ReferenceEngine
from weightsync.fleet import Event, FleetCoordinator, checkpoint_digest
from weightsync.trainer import save_checkpoint
from weightsync.transports.hashing import tensor_hashes
from weightsync.transports.http import ServerThread, create_app


class Worker:
    def __init__(self, root: Path) -> None:
        self.engine = ReferenceEngine(TINY, allowed_weight_dirs=[root])
        self.server = ServerThread(create_app(Controller(self.engine))).start()
        self.url = self.server.url
        weights = dict(self.engine.model.weights())
        self.new_weights = perturbed(weights)
        self.new = save_checkpoint(self.new_weights, root / "step-1")
        self.before = self.snapshot()

    def status(self) -> dict[str, object]:
        return dict(httpx.post(f"{self.url}/engine/get_weight_version", json={}, timeout=10).json())

    def snapshot(self) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        return self.status(), {n: t.clone() for n, t in self.engine.model.weights().items()}

    def assert_untouched(self) -> None:
        status, weights = self.before
        assert self.status() == status
        assert all(self.engine.model.weights()[n].equal(t) for n, t in weights.items())


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    w = Worker(tmp_path)
    try:
        yield w
    finally:
        w.server.stop()


def _update(url: str, path: Path | str, *extra: str) -> list[str]:
    return ["fleet", "update", "--worker", url, "--from-disk", str(path), "--deadline-s", "30", *extra]


# ---------------------------------------------------------------- the version (finding 1)


@pytest.mark.parametrize(
    "version",
    [
        '"\\ud800"',  # a lone surrogate: no worker can store it, httpx cannot even encode it
        "[" * 40 + "]" * 40,  # deeper than any worker stores
        "[" * 100_000 + "]" * 100_000,  # deep enough to exhaust the JSON parser's stack
    ],
    ids=["lone_surrogate", "too_deep", "stack_deep"],
)
def test_a_version_no_worker_can_store_is_refused_before_any_worker_loads(
    worker: Worker, version: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_update(worker.url, worker.new, "--version", version)) == 2
    assert "invalid_value" in capsys.readouterr().err
    worker.assert_untouched()


def test_a_local_failure_during_a_step_is_a_coordinator_error_not_unreachable(worker: Worker) -> None:
    def hook(event: Event) -> None:
        if event.what == "dry run ok":
            raise RuntimeError("the caller's event hook broke")

    coordinator = FleetCoordinator([worker.url], on_event=hook)
    result = coordinator.update_sync(str(worker.new), "v1", deadline_s=30)
    assert result.phase == "aborted"
    assert result.worker(worker.url).code == "coordinator_error"
    assert "event hook broke" in (result.worker(worker.url).message or "")
    worker.assert_untouched()


# ---------------------------------------------------------------- the local digest (finding 4)


def test_checkpoint_digest_matches_what_a_worker_holds_with_and_without_a_manifest(worker: Worker) -> None:
    expected = weights_digest(tensor_hashes(worker.new_weights.items()))
    assert checkpoint_digest(str(worker.new)) == expected
    (worker.new / "weightsync-manifest.json").unlink()
    assert checkpoint_digest(str(worker.new)) == expected  # hashed from the shards


def test_checkpoint_digest_is_unknown_for_a_manifest_nested_too_deep(worker: Worker) -> None:
    (worker.new / "weightsync-manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert checkpoint_digest(str(worker.new)) is None


def test_checkpoint_digest_is_unknown_for_a_manifest_that_is_a_fifo(worker: Worker) -> None:
    manifest = worker.new / "weightsync-manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    script = f"from weightsync.fleet import checkpoint_digest; print(checkpoint_digest({str(worker.new)!r}))"
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("checkpoint_digest blocked on a FIFO manifest")
    assert (done.returncode, done.stdout.strip()) == (0, "None"), done.stderr


def test_fleet_update_with_a_fifo_manifest_ends_and_changes_nothing(worker: Worker) -> None:
    manifest = worker.new / "weightsync-manifest.json"
    manifest.unlink()
    os.mkfifo(manifest)
    argv = [sys.executable, "-m", "weightsync.cli", *_update(worker.url, worker.new, "--version", "v1")]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("fleet update blocked on a FIFO manifest")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "aborted" in done.stdout
    worker.assert_untouched()


# ---------------------------------------------------------------- the journal (finding 5)


def _bad_journal(kind: str, tmp_path: Path) -> str:
    if kind == "text":
        (tmp_path / "notes.txt").write_text("not a database\n")
        return str(tmp_path / "notes.txt")
    if kind == "fifo":
        os.mkfifo(tmp_path / "journal.fifo")
        return str(tmp_path / "journal.fifo")
    if kind == "directory":
        return str(tmp_path)
    return "/dev/null"


@pytest.mark.parametrize("kind", ["text", "fifo", "directory", "dev_null"])
@pytest.mark.parametrize("command", ["update", "recover"])
def test_a_bad_journal_is_refused_with_bad_journal_and_exit_2(
    worker: Worker, tmp_path: Path, kind: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = _bad_journal(kind, tmp_path)
    before = sorted(os.listdir(Path(journal).parent))
    if command == "update":
        argv = _update(worker.url, worker.new, "--version", "v1", "--journal", journal)
    else:
        argv = ["fleet", "recover", "--worker", worker.url, "--journal", journal]
    assert main(argv) == 2
    assert "bad_journal" in capsys.readouterr().err
    assert sorted(os.listdir(Path(journal).parent)) == before  # no -journal/-wal side files
    worker.assert_untouched()


# ---------------------------------------------------------------- arguments (finding 9)


@pytest.mark.parametrize("deadline", ["inf", "1e309", "-inf", "nan", "0", "-1"])
def test_a_deadline_that_is_not_a_positive_finite_number_exits_2(
    deadline: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fleet", "update", "--worker", "http://127.0.0.1:9", "--from-disk", "/c", "--version", "1",
            f"--deadline-s={deadline}"]  # fmt: skip
    assert main(argv) == 2
    assert "invalid_value" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url",
    ["", "127.0.0.1:8799", "ftp://127.0.0.1:8799", "http://[::1", "http://127.0.0.1:99999",
     "http://user:pw@127.0.0.1:8799", "http://127.0.0.1:8799\r\nX: y", "http://:80", "http://a:1/?q"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["status", "update"])
def test_a_malformed_worker_url_exits_2_with_bad_worker_url(
    url: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fleet", command, "--worker", url, "--json"]
    if command == "update":
        argv += ["--from-disk", "/c", "--version", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "bad_worker_url" in captured.err and captured.out == ""


def test_a_plain_worker_url_with_a_path_prefix_and_trailing_slash_is_accepted(worker: Worker) -> None:
    assert FleetCoordinator([worker.url + "/"]).workers == [worker.url]
    assert json.dumps(FleetCoordinator([worker.url]).status()[0].to_json()["version"]) == "null"
