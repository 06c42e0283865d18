"""Whether a new generation request is admitted while the worker is paused.

weightsync queues a request that arrives while generation is paused: it waits for the resume.
vLLM 0.33 changed its own server: a pause through ``POST /pause`` in mode ``abort`` or
``wait`` refuses every new request with 503 (``RetryableRequestError``, "Generation is paused.
Please retry after it resumes.") until ``/resume``; ``keep`` still queues them, and pauses of
any other origin (sleep, an update) keep their policy (``EngineCore.pause_generation`` and
``_reject_add_while_paused`` in ``vllm/v1/engine/core.py``).  The vLLM dialect mirrors the
release ``serve --vllm-version`` names (0.33 by default) by setting :attr:`Admission.refusing`
on its ``/pause``; the generation routes ask :meth:`Admission.check` before a request reaches
the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from weightsync.core.errors import EngineUnavailable


@attrs.define
class Admission:
    """The pause policy for new generation requests (see the module docstring)."""

    paused: Callable[[], bool]
    """Whether the worker is paused now (the controller's snapshot)."""
    refusing: bool = False
    """Set by vLLM 0.33's ``/pause`` in mode ``abort`` or ``wait``, cleared by its ``/resume``
    and as soon as the worker is seen running again (a resume of any origin ends it)."""

    def check(self) -> None:
        """Raise ``EngineUnavailable`` (503, ``engine_paused``) while refusing and paused."""
        if not self.paused():
            self.refusing = False
        elif self.refusing:
            raise EngineUnavailable(
                "Generation is paused. Please retry after it resumes (POST /resume).", code="engine_paused"
            )
