"""vLLM's own HTTP test helpers, call for call, and a reference-engine worker to point them at.

The helpers are those of vLLM's ``tests/entrypoints/serve/dev/rlhf/conftest.py`` (vLLM 0.32,
the RL routes of ``vllm/entrypoints/rl/online/api_router.py``): the same paths, query
parameters, bodies and timeouts, so a test that calls them sends what vLLM's tests send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from tests.helpers import TINY
from weightsync.core import Controller
from weightsync.engines.reference import ModelConfig, ReferenceEngine
from weightsync.serve import ServerThread, create_app

# ---------------------------------------------------------------- vLLM's conftest helpers


def gen(url: str, prompt: str = "The capital of France is", max_tokens: int = 8, timeout: int = 30) -> Any:
    """vLLM's ``gen``: a greedy completion for the served model ``m``."""
    response = requests.post(
        f"{url}/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=timeout,
    )
    response.raise_for_status()
    return response.json()


def ok(resp: Any) -> bool:
    """vLLM's ``ok``: a completion with choices and no error."""
    return resp is not None and "choices" in resp and bool(resp["choices"]) and "error" not in resp


def pause(url: str, mode: str = "abort", clear_cache: bool = True) -> int:
    return requests.post(
        f"{url}/pause", params={"mode": mode, "clear_cache": clear_cache}, timeout=15
    ).status_code


def resume(url: str) -> int:
    return requests.post(f"{url}/resume", timeout=10).status_code


def is_paused(url: str) -> bool:
    return bool(requests.get(f"{url}/is_paused", timeout=5).json()["is_paused"])


def health(url: str) -> int:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code
    except Exception:
        return 0


def start_weight_update(url: str, is_checkpoint_format: bool = True) -> requests.Response:
    return requests.post(
        f"{url}/start_weight_update", json={"is_checkpoint_format": is_checkpoint_format}, timeout=10
    )


def finish_weight_update(url: str) -> requests.Response:
    return requests.post(f"{url}/finish_weight_update", timeout=10)


def get_world_size(url: str, include_dp: bool = True) -> requests.Response:
    return requests.get(f"{url}/get_world_size", params={"include_dp": include_dp}, timeout=5)


def weight_info_response(url: str) -> requests.Response:
    return requests.get(f"{url}/weight_info", timeout=5)


def update_weight_version_response(url: str, new_version: Any) -> requests.Response:
    return requests.post(f"{url}/update_weight_version", json={"new_version": new_version}, timeout=5)


def weight_checker(url: str, action: str, baseline: Any = None) -> requests.Response:
    """``weight_checker`` of vLLM's ``tests/entrypoints/rl/state_transitions/test_weight_checker.py``."""
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    return requests.post(f"{url}/weight_checker", json=body, timeout=300)


# ---------------------------------------------------------------- the worker


@pytest.fixture
def make_vllm_worker() -> Iterator[Callable[..., str]]:
    """Starts reference-engine workers on real loopback servers (``create_app`` keywords:
    ``dialect``, ``auto_pause_updates``; ``session_timeout_s`` for the controller, ``config``
    for the engine's model); yields a function returning the worker's URL."""
    servers: list[ServerThread] = []

    def make(session_timeout_s: float = 300.0, config: ModelConfig = TINY, **app_kwargs: Any) -> str:
        controller = Controller(ReferenceEngine(config), session_timeout_s=session_timeout_s)
        server = ServerThread(create_app(controller, **app_kwargs)).start()
        servers.append(server)
        return server.url

    yield make
    for server in servers:
        server.stop()
