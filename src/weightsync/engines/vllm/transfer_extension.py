"""weightsync's vLLM worker extension with the ``weightsync`` weight-transfer backend.

vLLM picks a worker's weight-transfer engine by name (``--weight-transfer-config
'{"backend": "weightsync"}'``) from ``WeightTransferEngineFactory`` in the worker process, as
the model loads.  vLLM imports a ``--worker-extension-cls`` in every worker before that, so
naming :class:`WeightSyncTransferExtension` there registers the backend where vLLM looks it
up; the extension is weightsync's own (``weightsync.engines.vllm.worker``).
"""

from __future__ import annotations

from weightsync.engines.vllm.transfer import register
from weightsync.engines.vllm.worker import WeightSyncExtension

__all__ = ["WeightSyncTransferExtension"]

# The same extension (its ``weightsync_transfer_engine`` reports the backend), under the name
# vLLM is told to import so that importing it registers the backend first.
WeightSyncTransferExtension = WeightSyncExtension

register()
