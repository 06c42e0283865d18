"""``weightsync fleet ...``: parsing, exit codes and ``--json``, against real loopback workers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY, perturbed
from weightsync.cli import build_parser, main
from weightsync.core import Controller
from weightsync.core.values import Attestation
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import save_checkpoint
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


def test_status_json_is_one_object_naming_each_workers_state_and_last_error(
    workers: list[tuple[str, ReferenceEngine]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fleet", "status", "--json"] + [a for url, _ in workers for a in ("--worker", url)]
    argv += ["--worker", "http://127.0.0.1:9"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out) == ["workers"]
    rows = out["workers"]
    keys = {"url", "version", "epoch", "digest", "paused", "torn", "update_in_flight", "last_error"}
    assert all(set(r) == keys for r in rows)
    assert [r["url"] for r in rows] == [url for url, _ in workers] + ["http://127.0.0.1:9"]
    assert all(r["paused"] is False and r["torn"] is False and r["last_error"] is None for r in rows[:2])
    assert rows[2]["last_error"] == "unreachable" and rows[2]["version"] is None


def test_status_table_names_an_unreachable_worker(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "status", "--worker", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr().out
    assert "last error" in out and "unreachable" in out


def test_status_last_error_names_the_code_a_refusing_worker_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = ServerThread(create_app(Controller(ReferenceEngine(TINY)), api_key="sesame")).start()
    try:
        assert main(["fleet", "status", "--json", "--api-key", "wrong", "--worker", server.url]) == 1
    finally:
        server.stop()
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workers"]
    assert row["last_error"] == "unauthorized"


def test_recover_refuses_a_journal_that_does_not_exist_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "missing.db"
    assert main(["fleet", "recover", "--journal", str(journal), "--worker", "http://127.0.0.1:9"]) == 2
    assert "bad_journal" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("deadline", ["1e300", "86401", "inf", "nan", "0"])
def test_deadline_beyond_a_day_is_refused_before_anything_is_sent(
    deadline: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "j.db"
    argv = ["fleet", "update", "--worker", "http://127.0.0.1:9", "--from-disk", "/c", "--version", "1",
            "--deadline-s", deadline, "--journal", str(journal)]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid_value" in err and "[preparing]" not in err


def test_update_help_says_a_fenced_commit_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fleet", "update", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 when the version was committed" in text and "--policy fence" in text
    assert "at most 86400" in text


class TamperedAfterLoad(ReferenceEngine):
    """A worker whose weights are changed in-process (outside the control plane) after it loads."""

    async def attest(self) -> Attestation:
        with torch.no_grad():
            self.model.weights()["model.norm.weight"].add_(0.5)
        return await super().attest()


def test_fenced_commit_with_quorum_exits_0_and_reports_committed_and_the_fenced_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engines = [ReferenceEngine(TINY, allowed_weight_dirs=[tmp_path]) for _ in range(2)]
    engines.append(TamperedAfterLoad(TINY, allowed_weight_dirs=[tmp_path]))
    servers = [ServerThread(create_app(Controller(e))).start() for e in engines]
    try:
        ckpt = save_checkpoint(perturbed(dict(engines[0].model.weights())), tmp_path / "step-1")
        argv = ["fleet", "update", "--json", "--from-disk", str(ckpt), "--version", "step-1",
                "--policy", "fence", "--min-workers", "2", "--deadline-s", "60"]  # fmt: skip
        argv += [a for s in servers for a in ("--worker", s.url)]
        rc = main(argv)
    finally:
        for s in servers:
            s.stop()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["phase"], result["committed"], result["ok"], rc) == ("fenced", True, True, 0)
    outcomes = {w["url"]: (w["outcome"], w["code"]) for w in result["workers"]}
    assert outcomes[servers[2].url] == ("fenced", "digest_mismatch")
    assert [outcomes[s.url][0] for s in servers[:2]] == ["committed", "committed"]


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
        assert rc == 0 and result["ok"] and result["committed"] and result["epoch"] >= 1
        return
    assert rc == 1 and result["phase"] == "aborted" and not result["ok"] and result["committed"] is False
    assert {w["outcome"] for w in result["workers"]} == {"refused"}
    assert all(w["code"] for w in result["workers"])
    assert "[preparing]" in captured.err
    for (_, e), old in zip(workers, before, strict=True):
        assert all(e.model.weights()[n].equal(t) for n, t in old.items())
