"""``weightsync fleet ...``: parsing, exit codes and ``--json``, against real loopback workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import TINY, perturbed
from weightsync.cli import build_parser, main
from weightsync.core import Controller
from weightsync.engines.reference import ReferenceEngine
from weightsync.transports.disk import save_checkpoint
from weightsync.transports.http import ServerThread, create_app


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[tuple[str, ReferenceEngine]]]:
    started = []
    for _ in range(2):
        engine = ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path])
        started.append((ServerThread(create_app(Controller(engine))).start(), engine))
    yield [(s.url, e) for s, e in started]
    for s, _ in started:
        s.stop()


def test_update_parses_every_option_the_issue_names() -> None:
    args = build_parser().parse_args(
        ["fleet", "update", "--worker", "http://a:1", "--worker", "http://b:2", "--from-disk", "/c",
         "--version", "7", "--policy", "fence", "--min-workers", "1", "--pause-mode", "wait",
         "--deadline-s", "5", "--journal", "j.db", "--json", "--api-key", "k"]
    )  # fmt: skip
    assert args.worker == ["http://a:1", "http://b:2"] and args.from_disk == "/c"
    assert (args.version, args.policy, args.min_workers, args.pause_mode) == ("7", "fence", 1, "wait")
    assert (args.deadline_s, args.journal, args.json, args.api_key) == (5.0, "j.db", True, "k")


@pytest.mark.parametrize(
    "argv",
    [
        ["fleet", "update", "--from-disk", "/c", "--version", "1"],  # no worker
        ["fleet", "update", "--worker", "http://a:1", "--version", "1"],  # no source
        [
            "fleet",
            "update",
            "--worker",
            "http://a:1",
            "--from-disk",
            "/c",
            "--version",
            "1",
            "--policy",
            "yolo",
        ],
        ["fleet", "recover", "--worker", "http://a:1"],  # no journal
    ],
)
def test_malformed_command_lines_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_bad_quorum_is_refused_with_its_code_and_nothing_sent(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fleet", "update", "--worker", "http://127.0.0.1:9", "--from-disk", "/c", "--version", "1",
            "--min-workers", "3"]  # fmt: skip
    assert main(argv) == 2
    assert "invalid_value" in capsys.readouterr().err


def test_status_json_reports_every_worker(
    workers: list[tuple[str, ReferenceEngine]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fleet", "status", "--json"] + [a for url, _ in workers for a in ("--worker", url)]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["url"] for r in rows] == [url for url, _ in workers]
    assert all(r["paused"] is False and r["torn"] is False for r in rows)


def test_status_table_names_an_unreachable_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "status", "--worker", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr().out
    assert "last error" in out and "unreachable" in out


def test_update_against_workers_that_refuse_the_dry_run_aborts_and_changes_nothing(
    workers: list[tuple[str, ReferenceEngine]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = workers[0][1]
    ckpt = save_checkpoint(perturbed(dict(engine.model.weights())), tmp_path / "step-1")
    before = [{n: t.clone() for n, t in e.model.weights().items()} for _, e in workers]
    argv = [
        "fleet",
        "update",
        "--json",
        "--from-disk",
        str(ckpt),
        "--version",
        "step-1",
        "--deadline-s",
        "30",
    ]
    argv += [a for url, _ in workers for a in ("--worker", url)]
    rc = main(argv)
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    if result["phase"] == "committed":  # the worker side of the contract has landed
        assert rc == 0 and result["ok"] and result["epoch"] >= 1
        return
    assert rc == 1 and result["phase"] == "aborted" and not result["ok"]
    assert {w["outcome"] for w in result["workers"]} == {"refused"}
    assert all(w["code"] for w in result["workers"])
    assert "[preparing]" in captured.err
    for (_, e), old in zip(workers, before, strict=True):
        assert all(e.model.weights()[n].equal(t) for n, t in old.items())
