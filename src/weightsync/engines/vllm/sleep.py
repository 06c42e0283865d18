"""Memory release on vLLM: weightsync's ``release_memory`` / ``resume_memory`` as vLLM's own
``AsyncLLM.sleep(level, mode)`` and ``wake_up(tags)``.

vLLM's levels release the KV cache with the weights: level 1 offloads the weights to host
memory, level 2 discards them; ``release_kv_cache_memory`` frees the KV cache alone (after a
pause).  So a weights-only discard (SGLang's ``weights`` tag) is level 2 followed by
``wake_up(["kv_cache"])``.  ``wake_up`` resumes vLLM's scheduler once everything is resident;
weightsync's controller decides when generation resumes, so a worker paused before the wake is
paused again right after it.  A load into discarded weights wakes them (``wake_up(["weights"])``:
memory, no content) first.

Sleep mode needs ``enable_sleep_mode=True`` and a platform with vLLM's cumem allocator (CUDA,
ROCm, XPU).  vLLM's CPU platform has none: vLLM refuses ``enable_sleep_mode`` there ("Sleep
mode is not supported on current platform."), so on CPU a release is refused with
``not_supported`` before vLLM is touched.
"""

from __future__ import annotations

from typing import Any

from weightsync.core.errors import NotSupported


class VllmSleep:
    """Sleep and wake of one ``AsyncLLM`` (see the module docstring)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.asleep: set[str] = set()  # the tags vLLM holds released: weights, kv_cache

    def check(self) -> None:
        config = getattr(self.llm, "vllm_config", None)
        if config is None or not config.model_config.enable_sleep_mode:
            raise NotSupported(
                "vLLM sleep mode is off: start vLLM with enable_sleep_mode=True (vLLM offers it on "
                "CUDA, ROCm and XPU only; its CPU platform refuses it)",
                code="not_supported",
            )

    async def release(self, weights: str | None, kv_cache: bool) -> None:
        self.check()
        if weights is None:
            if kv_cache and "kv_cache" not in self.asleep:
                await self.llm.release_kv_cache_memory()
                self.asleep.add("kv_cache")
            return
        await self.llm.sleep(level=1 if weights == "offload" else 2, mode="keep")
        self.asleep |= {"weights", "kv_cache"}
        if not kv_cache:
            await self.wake(False, True, paused=True)

    async def wake(self, weights: bool, kv_cache: bool, *, paused: bool) -> None:
        tags = [
            t for t, asked in (("weights", weights), ("kv_cache", kv_cache)) if asked and t in self.asleep
        ]
        if not tags:
            return
        awake = await self.llm.wake_up(tags)
        self.asleep -= set(tags)
        if awake and paused:  # vLLM resumed its scheduler; weightsync's pause stands
            await self.llm.pause_generation(mode="keep", clear_cache=False)
