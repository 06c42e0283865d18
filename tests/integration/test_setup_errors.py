"""Setup mistakes a newcomer makes get an error in the family that names the next step."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.workers import Worker
from weightsync.core.errors import InvalidRequest
from weightsync.trainer import AsyncWorkerClient, WorkerClient

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://127.0.0.1:8000", "http://", ""])
def test_a_worker_url_without_http_scheme_or_host_is_refused_in_the_error_family(url: str) -> None:
    for client in (WorkerClient, AsyncWorkerClient):
        with pytest.raises(InvalidRequest) as caught:
            client(url)
        assert caught.value.code == "bad_worker_url"
        assert "http://HOST:PORT" in caught.value.message
    with pytest.raises(InvalidRequest, match=re.escape("did you mean 'http://127.0.0.1:8000'")):
        WorkerClient("127.0.0.1:8000")


def test_get_on_an_admin_route_says_admin_routes_are_post_with_json(worker: Worker) -> None:
    reply = httpx.get(f"{worker.url}/engine/pause_generation")
    assert reply.status_code == 405
    body = reply.json()
    assert body["code"] == "method_not_allowed"
    assert "POST" in body["message"] and "JSON" in body["message"]
    assert "POST" in reply.headers["allow"]
    # and nothing changed
    assert worker.client.get_weight_version()["paused"] is False


def test_json_replies_end_with_a_newline(worker: Worker) -> None:
    ok = httpx.post(f"{worker.url}/engine/get_weight_version", json={})
    error = httpx.post(f"{worker.url}/engine/no_such_route", json={})
    health = httpx.get(f"{worker.url}/health")
    for reply in (ok, error, health):
        assert reply.content.endswith(b"}\n"), reply.content


def test_importing_the_test_kit_without_hypothesis_names_the_dev_extra() -> None:
    code = "import sys; sys.modules['hypothesis'] = None\nimport weightsync.testing\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: weightsync.testing needs hypothesis, from the dev extra")
    assert "[dev]" in last


@pytest.mark.parametrize(
    ("prefix", "wrapper"), [("_orig_mod.", "torch.compile"), ("module.", "DataParallel/DDP")]
)
def test_names_behind_a_wrapper_prefix_are_unknown_tensor_with_the_fix(
    worker: Worker, prefix: str, wrapper: str
) -> None:
    from weightsync.core.errors import WeightSyncError
    from weightsync.trainer import save_checkpoint

    weights = {f"{prefix}{n}": t for n, t in worker.engine.model.weights().items()}
    before = worker.client.get_weight_version()
    path = save_checkpoint(weights, worker.root / "wrapped", version="wrapped")
    worker.client.pause_generation()
    with pytest.raises(WeightSyncError) as caught:
        worker.client.update_weights_from_disk(str(path), weight_version="wrapped")
    assert caught.value.code == "unknown_tensor"
    assert f"starts with {prefix!r}" in caught.value.message and wrapper in caught.value.message
    assert f"removeprefix({prefix!r})" in caught.value.message
    assert worker.client.get_weight_version() == {**before, "paused": True}
