"""SGLang's and Miles' own calls, reproduced one for one (neither package installs beside the
pinned torch here), for the tests of tests/peers/test_sglang_*.py.

- :func:`init_custom_process_group`: SGLang's ``sglang/srt/utils`` ``init_custom_process_group``
  (Miles' ``miles/utils/distributed_utils.py`` ``init_process_group`` is the same copy of
  torch's): a ``tcp://`` rendezvous whose rank 0 hosts the store, a ``PrefixStore(group_name)``,
  and ``_new_process_group_helper``.
- :class:`MilesEngine`: the HTTP calls of Miles' ``SGLangEngine``
  (``miles/backends/sglang_utils/sglang_engine.py``), method by method, and its start-up wait
  ``_wait_server_healthy``; :func:`miles_refit` the order in which Miles' distributed refit
  (``miles/backends/megatron_utils/update_weight/update_weight_from_distributed/mixin.py``
  and ``broadcast.py``) makes them.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import requests
import torch
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout: datetime.timedelta
) -> Any:
    """SGLang's ``init_custom_process_group`` with ``store=None`` (as its test and Miles call it)."""
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    # Use a PrefixStore to avoid accidental overrides of keys used by different systems.
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class MilesEngine:
    """Miles' ``SGLangEngine`` HTTP calls against ``base_url`` (``server_host:server_port``),
    each method as Miles writes it (node rank 0; ``requests``, ``raise_for_status``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def _make_request(self, endpoint: str, payload: dict[str, Any] | None = None) -> Any:
        response = requests.post(f"{self.base_url}/{endpoint}", json=payload or {}, timeout=120)
        response.raise_for_status()
        return response.json()

    def wait_server_healthy(self, api_key: Any, is_process_alive: Callable[[], bool], sleep_s: float) -> int:
        """``_wait_server_healthy``: ``GET /health_generate`` until 200, then ``GET /flush_cache``
        until 200 (Miles sleeps 2 s between tries; ``sleep_s`` here).  Returns how many
        ``/health_generate`` calls it took."""
        headers = {"Content-Type": "application/json; charset=utf-8", "Authorization": f"Bearer {api_key}"}
        calls = 0
        with requests.Session() as session:
            while True:
                try:
                    calls += 1
                    response = session.get(f"{self.base_url}/health_generate", headers=headers, timeout=60)
                    if response.status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if not is_process_alive():
                    raise Exception("Server process terminated unexpectedly.")
                time.sleep(sleep_s)
            while True:
                try:
                    response = session.get(f"{self.base_url}/flush_cache", headers=headers, timeout=60)
                    if response.status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if not is_process_alive():
                    raise Exception("Server process terminated unexpectedly.")
                time.sleep(sleep_s)
        return calls

    def health_generate(self, timeout: float = 5.0) -> bool:
        response = requests.get(f"{self.base_url}/health_generate", timeout=timeout)
        response.raise_for_status()
        return True

    def get_server_info(self) -> Any:
        response = requests.get(f"{self.base_url}/server_info", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def flush_cache(self) -> None:
        last_message = None
        for _ in range(60):
            response = requests.get(f"{self.base_url}/flush_cache", timeout=60)
            if response.status_code == 200:
                break
            last_message = response.text
            time.sleep(1)
        else:
            raise TimeoutError(f"Timeout while flushing cache: {last_message}")

    def get_parallelism_info(self, rank: int) -> Any:
        response = requests.get(
            f"{self.base_url}/parallelism_config",
            params={"rank": rank},
            timeout=5.0,
        )
        response.raise_for_status()
        return response.json()

    def check_weights(
        self,
        action: str,
        allow_quant_error: bool = False,
        selector: str = "all",
        skip_list: list[str] | None = None,
    ) -> Any:
        payload: dict[str, Any] = {
            "action": action,
            "allow_quant_error": allow_quant_error,
            "selector": selector,
        }
        if skip_list is not None:
            # sglang's CheckWeightsReqInput names this field `skip_tensor_list`.
            payload["skip_tensor_list"] = skip_list
        return self._make_request("weights_checker", payload)

    def get_weight_version(self) -> Any:
        # new sglang change api from /get_weight_version to /model_info
        for endpoint in ("/model_info", "/get_weight_version"):
            response = requests.get(f"{self.base_url}{endpoint}", timeout=60)
            if response.status_code == 200:
                return response.json()["weight_version"]
        response.raise_for_status()
        return None

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], selector: str = "all") -> Any:
        payload = {"serialized_named_tensors": serialized_named_tensors, "load_format": None,
                   "flush_cache": False, "selector": selector}  # fmt: skip
        return self._make_request("update_weights_from_tensor", payload)

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: Any = None
    ) -> Any:
        payload: dict[str, Any] = {"model_path": model_path}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_disk", payload)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any:
        return self._make_request("init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })  # fmt: skip

    def destroy_weights_update_group(self, group_name: str) -> Any:
        try:
            return self._make_request("destroy_weights_update_group", {"group_name": group_name})
        except requests.exceptions.RequestException:
            # catch the case there the engine is just created and does not have the group.
            pass
        return None

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[Any], shapes: list[Any], group_name: str,
        flush_cache: bool = False, weight_version: str | None = None, selector: str = "all",
    ) -> Any:  # fmt: skip
        payload = {
            "names": names,
            "dtypes": [str(dtype).replace("torch.", "") for dtype in dtypes],
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "selector": selector,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._make_request("update_weights_from_distributed", payload)

    def pause_generation(self, mode: str = "retract") -> requests.Response:
        response = requests.post(f"{self.base_url}/pause_generation", json={"mode": mode}, timeout=60)
        response.raise_for_status()
        return response

    def continue_generation(self) -> requests.Response:
        response = requests.post(f"{self.base_url}/continue_generation", json={}, timeout=60)
        response.raise_for_status()
        return response

    def begin_weight_update(self, selector: str = "all") -> Any:
        return self._make_request("begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> Any:
        return self._make_request("end_weight_update", {})

    def update_weight_version(self, weight_version: str) -> Any:
        return self._make_request("update_weight_version", {"new_version": weight_version})


def miles_refit(
    engine: MilesEngine,
    broadcast: Callable[[torch.Tensor], Any],
    group_name: str,
    weight_version: int,
    tensors: dict[str, torch.Tensor],
) -> Any:
    """One refit as Miles' ``DistBucketedWeightUpdateMixin.update_weights`` runs it with
    ``pause_generation_mode="retract"`` and one bucket: ``_pause_and_prepare_engines`` (pause,
    ``flush_cache``, ``begin_weight_update``), ``broadcast.update_weights_from_distributed``
    (the metadata posted while rank 0 broadcasts each tensor), ``_finalize_and_resume_engines``
    (``end_weight_update``, ``continue_generation``).  ``broadcast(tensor)`` starts rank 0's
    broadcast on the group (Miles: ``dist.broadcast(tensor, 0, group=group, async_op=True)``)
    and returns its work.  Returns the update's reply."""
    engine.pause_generation(mode="retract")
    engine.flush_cache()
    engine.begin_weight_update()
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(
            engine.update_weights_from_distributed,
            names=list(tensors),
            dtypes=[t.dtype for t in tensors.values()],
            shapes=[list(t.shape) for t in tensors.values()],
            group_name=group_name,
            weight_version=str(weight_version),
        )
        handles = [broadcast(t.contiguous()) for t in tensors.values()]
        for handle in handles:
            handle.wait()
        reply = ref.result(timeout=120)
    engine.end_weight_update()
    engine.continue_generation()
    return reply


@attrs.define
class MilesSample:
    """The fields of Miles' ``Sample`` (``miles/utils/types.py``) a single-turn rollout fills."""

    tokens: list[int] = attrs.field(factory=list)
    response: str = ""
    response_length: int = 0
    rollout_log_probs: list[float] | None = None
    weight_versions: list[Any] = attrs.field(factory=list)
    cached_tokens: int = 0
    total_prompt_tokens: int = 0
    status: str = "pending"


def miles_rollout(base_url: str, input_ids: list[int], sampling_params: dict[str, Any]) -> MilesSample:
    """One sample of Miles' single-turn rollout (``miles/rollout/generate_hub/single_turn.py``
    ``generate``): ``compute_request_payload`` (``return_logprob``, ``return_routed_experts`` and
    ``return_indexer_topk`` false, ``max_new_tokens`` in ``sampling_params``), ``post`` to
    ``/generate``, then ``update_sample_from_response`` and ``Sample.update_from_meta_info``."""
    sample = MilesSample()
    params = dict(sampling_params)
    max_new_tokens = params.pop("max_new_tokens")
    payload = {
        "input_ids": input_ids,
        "sampling_params": {**params, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "return_routed_experts": False,
        "return_indexer_topk": False,
    }
    response = requests.post(f"{base_url}/generate", json=payload, timeout=120)
    response.raise_for_status()
    output = response.json()
    sample.tokens = payload["input_ids"]
    if x := output["meta_info"].get("output_token_logprobs"):
        new_tokens, new_log_probs = [item[1] for item in x], [item[0] for item in x]
    else:
        new_tokens, new_log_probs = [], []
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += output["text"]
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + new_log_probs
    meta = output["meta_info"]
    sample.cached_tokens += meta.get("cached_tokens", 0)
    sample.total_prompt_tokens += meta.get("prompt_tokens", 0)
    if "weight_version" in meta:
        sample.weight_versions.append(meta["weight_version"])
    sample.status = {"length": "truncated", "abort": "aborted", "stop": "completed"}[
        meta["finish_reason"]["type"]
    ]
    return sample
