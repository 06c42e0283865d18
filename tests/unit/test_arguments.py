"""One rule for every command-line version flag (``serve --initial-version``, ``fleet update
--version``): strict JSON when the text is JSON, else the text as a plain string, and only
values every reply can write back.  One rule for every API-key flag (``serve``, ``router``,
``fleet``): the flag, else its environment variable, and no key no client could send.  And
the test-only shift of a worker's clock (``$WEIGHTSYNC_TEST_CLOCK_OFFSET_S``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from weightsync.cli import main
from weightsync.core.errors import InvalidRequest
from weightsync.edge.arguments import TEST_CLOCK_OFFSET, api_key_argument, version_argument, worker_clock
from weightsync.fleet.cli import _version
from weightsync.worker_app import initial_version as _initial_version


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7", 7),
        ("null", None),
        ('"step-3"', "step-3"),
        ("step-3", "step-3"),
        ('{"step": 3, "run": "a"}', {"step": 3, "run": "a"}),
        ("[1, 2", "[1, 2"),  # not JSON: the text itself
        ("NaN", "NaN"),  # not strict JSON: the text itself, never a float nan
        ('{"a": 1, "a": 2}', '{"a": 1, "a": 2}'),  # a repeated key is not strict JSON
        ("", ""),
    ],
)
def test_a_version_flag_is_strict_json_or_else_the_plain_text(text: str, value: Any) -> None:
    assert version_argument("--version", text) == value
    assert type(version_argument("--version", text)) is type(value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('"\\ud800"', "not valid UTF-8"),
        ("\udcff", "not valid UTF-8"),  # an undecodable byte of argv, as Python hands it over
        ("1e400", "not a finite number"),
        ("[" * 40 + "]" * 40, "levels deep"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('"' + "x" * (64 << 10) + '"', "bytes"),
    ],
)
def test_a_version_no_reply_can_write_back_is_invalid_value(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        version_argument("--version", text)
    assert caught.value.code == "invalid_value"


@pytest.mark.parametrize("text", ["step-3", "7", '"7"', '{"step": 3}', "[1, 2", "NaN"])
def test_serve_and_fleet_read_a_version_the_same_way(text: str) -> None:
    assert _initial_version(text) == _version(text) == version_argument("--version", text)


@pytest.mark.parametrize("text", ['"\\ud800"', "[" * 40 + "]" * 40, "[" * 100_000 + "]" * 100_000])
def test_serve_and_fleet_refuse_the_same_versions(text: str) -> None:
    for parse in (_initial_version, _version):
        with pytest.raises(InvalidRequest) as caught:
            parse(text)
        assert caught.value.code == "invalid_value"


# The three commands that take --api-key, each with arguments that get as far as reading it.
KEYED = {
    "serve": ["serve", "--port", "0"],
    "router": ["router", "--worker", "http://127.0.0.1:9"],
    "fleet": ["fleet", "status", "--worker", "http://127.0.0.1:9"],
}


def test_an_api_key_flag_wins_over_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_API_KEY", "from-env")
    assert api_key_argument("--api-key", "from-flag") == "from-flag"
    assert api_key_argument("--api-key", None) == "from-env"
    monkeypatch.delenv("WEIGHTSYNC_API_KEY")
    assert api_key_argument("--api-key", None) is None


@pytest.mark.parametrize("command", sorted(KEYED))
@pytest.mark.parametrize(("key", "says"), [("", "the API key is empty"), (" padded ", "printable ASCII"),
                                           ("caf\u00e9", "printable ASCII")])  # fmt: skip
@pytest.mark.parametrize("from_env", [False, True])
def test_serve_router_and_fleet_refuse_the_same_api_keys(
    command: str, key: str, says: str, from_env: bool, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.delenv("WEIGHTSYNC_API_KEY", raising=False)
    if from_env:
        monkeypatch.setenv("WEIGHTSYNC_API_KEY", key)
    assert main(KEYED[command] + ([] if from_env else ["--api-key", key])) == 2
    assert says in capsys.readouterr().err


def test_a_workers_clock_is_this_one_unless_the_test_variable_shifts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TEST_CLOCK_OFFSET, raising=False)
    assert worker_clock() is time.time
    monkeypatch.setenv(TEST_CLOCK_OFFSET, "-60.5")
    before = time.time()
    shifted = worker_clock()()
    assert before - 60.5 <= shifted <= time.time() - 60.5


@pytest.mark.parametrize("text", ["", "soon", "nan", "inf", "-inf"])
def test_a_clock_shift_that_is_not_a_finite_number_is_refused_before_serve_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    monkeypatch.setenv(TEST_CLOCK_OFFSET, text)
    with pytest.raises(InvalidRequest) as err:
        worker_clock()
    assert err.value.code == "invalid_value" and TEST_CLOCK_OFFSET in err.value.message
    assert main(["serve", "--port", "0"]) == 2
    assert TEST_CLOCK_OFFSET in capsys.readouterr().err
