"""weightsync's vLLM worker extension with the ``weightsync`` weight-transfer backend.

vLLM picks a worker's weight-transfer engine by name (``--weight-transfer-config
'{"backend": "weightsync"}'``) from ``WeightTransferEngineFactory`` in the worker process, as
the model loads.  vLLM imports a ``--worker-extension-cls`` in every worker before that, so
naming :class:`WeightSyncTransferExtension` there registers the backend where vLLM looks it
up; the extension is weightsync's (``weightsync.engines.vllm.worker``) plus one report.
"""

from __future__ import annotations

from weightsync.engines.vllm.transfer import WeightSyncWeightTransferEngine, register
from weightsync.engines.vllm.worker import WeightSyncExtension

__all__ = ["WeightSyncTransferExtension"]


class WeightSyncTransferExtension(WeightSyncExtension):
    """weightsync's worker extension, imported in each vLLM worker with the backend registered."""

    def weightsync_transfer_engine(self) -> dict[str, object]:
        """The class name of the weight-transfer engine vLLM built in this worker and the
        xxh3-64 of every tensor its last update received (what ``collective_rpc`` returns)."""
        engine = getattr(self, "weight_transfer_engine", None)  # none without a transfer config
        received = engine.received if isinstance(engine, WeightSyncWeightTransferEngine) else {}
        return {"engine": type(engine).__name__, "received": dict(received)}


register()
