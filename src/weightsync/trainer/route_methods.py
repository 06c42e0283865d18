"""The admin routes as client methods: one stub per route (its parameters are the route's
body fields, its docstring and return type the method's), turned into a method by
:func:`route`.  :class:`RouteMethods` collects them; a client subclass supplies ``_call``
(sync, async, or many workers at once).
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from weightsync.trainer.replies import (
    AbandonReply,
    AliveReply,
    CapabilitiesReply,
    ClockReply,
    DeclaredReply,
    FlushReply,
    OkReply,
    PauseReply,
    RpcReply,
    SessionReply,
    StateReply,
    UpdateReply,
    VerifyReply,
    WeightInfoReply,
)

R = TypeVar("R")
Reply = dict[str, Any]


class _Unset:
    """The default of an option the caller did not give: it is left out of the request body,
    so the worker applies its own default."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()
"""Default of an optional field: left out of the body, so the worker's default applies."""
_UNSET: Any = UNSET


def route(stub: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ``stub`` into the client method of the admin route named like it.

    The route name is the method's name (spelled once, in :data:`weightsync.core.routes.ROUTES`;
    a test checks every route has a method whose parameters are its body's fields).  The body
    is the arguments the caller gave plus the stub's defaults, options left at ``_UNSET``
    dropped, unless the stub returns a body of its own (``engine_rpc`` does).  The stub's
    docstring and return annotation (a :mod:`weightsync.trainer.replies` type) are the method's.
    """
    signature = inspect.signature(stub)

    @functools.wraps(stub)
    def method(self: RouteMethods[Any], *args: Any, **kwargs: Any) -> Any:
        body = stub(self, *args, **kwargs)
        if body is None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            body = {k: v for k, v in list(bound.arguments.items())[1:] if v is not _UNSET}
        return self._call(stub.__name__, body)

    return method


class RouteMethods(abc.ABC, Generic[R]):
    """One method per admin route (see :func:`route`); ``_call`` does the transport (sync,
    async, or many workers at once).  Each method returns the worker's ok reply (typed in
    :mod:`weightsync.trainer.replies`; awaited on the async client, one per worker on a
    fleet) and raises the :mod:`weightsync.core.errors` class of an error reply, with the
    worker's ``code`` and ``message``."""

    @abc.abstractmethod
    def _call(self, route: str, body: Reply) -> R:
        """Send ``body`` to ``route`` the way this client talks (the one method a client adds)."""

    @route
    def get_weight_version(self) -> StateReply:
        """The committed version and state: ``version`` (``None`` while undeclared), ``paused``,
        ``torn``, ``update_in_flight``, the held weights' ``digest`` and whether the version
        still describes them (``version_current``).  A read: never waits for an update."""

    @route
    def set_weight_version(
        self, weight_version: Any, *, epoch: Any = _UNSET, expected_digest: Any = _UNSET,
        not_after: Any = _UNSET,
    ) -> DeclaredReply:  # fmt: skip
        """Declare ``weight_version`` (any JSON value) for the weights held; never touches them.

        ``epoch``: a fleet epoch (a smaller one than the worker's is refused, ``stale_epoch``);
        ``expected_digest``: refuse (``digest_mismatch``) unless the held weights have it;
        ``not_after``: unix seconds by the worker's clock (:meth:`clock` reads it) after which
        it refuses the declaration (``commit_expired``) instead of taking it late.
        Raises ``IllegalState`` on any guard (nothing changed)."""

    @route
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        allow_partial: Any = _UNSET,
        allow_dtype_cast: Any = _UNSET,
        session: Any = _UNSET,
        relabel: Any = _UNSET,
    ) -> UpdateReply:
        """Load a safetensors checkpoint directory (``model_path``) into the served weights.

        On success the reply has ``version`` (this update's label), ``digest``, ``stats`` and
        the resulting ``state``; ``weight_version`` declares it (omitted: the old
        declaration is kept, and ``state.version_current`` turns false).  ``dry_run`` checks
        without loading.  A ``weight_version`` other than the one the checkpoint's manifest
        names is ``IllegalState`` (``version_mismatch``) unless ``relabel``.  Raises ``IllegalState`` while running without ``allow_unpaused``,
        ``InvalidRequest`` for a refused checkpoint (nothing written), ``WeightsTorn`` when
        the load failed after writing began (the worker stays paused until an update works).
        """

    @route
    def update_weights_from_delta(
        self,
        delta_path: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Apply the delta checkpoint at ``delta_path`` (see ``weightsync delta``) to the exact
        base it names.  Raises ``IllegalState`` (``base_mismatch``) when the worker does not
        hold that base, ``InvalidRequest`` (``bad_delta``) for a refused delta (nothing
        written either way), an error whose ``details.undone`` is true when the apply failed
        and put the base back, ``WeightsTorn`` when it could not.  Reply as for
        :meth:`update_weights_from_disk`; its ``digest`` is the target's."""

    @route
    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        packing: Any = _UNSET,
        hashes: Any = _UNSET,
        session: Any = _UNSET,
        delta: Any = _UNSET,
    ) -> UpdateReply:
        """Receive the tensors ``names`` (with ``dtypes`` and ``shapes``) that a trainer
        broadcasts over the weight-update group ``group_name`` (see
        :class:`~weightsync.trainer.broadcast.Broadcaster`); with ``delta``, a sparse delta of
        them instead (:meth:`~weightsync.trainer.broadcast.Broadcaster.push_delta`).  Reply and
        errors as for :meth:`update_weights_from_disk`."""

    @route
    def update_weights_from_plan(
        self,
        group_name: str,
        stream_id: str,
        plan: Reply,
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Receive this worker's part of a sharded transfer ``plan`` (see ``weightsync plan``)
        as stream ``stream_id`` over the weight-update group ``group_name``.  Reply and errors
        as for :meth:`update_weights_from_disk`."""

    @route
    def update_weights_from_tensor(
        self,
        tensors: list[Reply],
        *,
        weight_version: Any = _UNSET,
        allow_unpaused: Any = _UNSET,
        reset_prefix_cache: Any = _UNSET,
        dry_run: Any = _UNSET,
        session: Any = _UNSET,
    ) -> UpdateReply:
        """Load tensors a colocated trainer shared (shared-memory or CUDA-IPC handles, one
        dict per tensor: name, dtype, shape, handle).  Reply and errors as for
        :meth:`update_weights_from_disk`."""

    @route
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        *,
        backend: str = "nccl",
        timeout_s: float = 60.0,
        receiver: str = "inline",
        rendezvous: str = "process_group",
    ) -> OkReply:
        """Join the torch.distributed weight-update group ``group_name`` as ranks from
        ``rank_offset`` (the trainer is rank 0 of ``world_size``).  ``receiver="process"``
        (gloo only) has a helper process join it, for foreign per-tensor or flat streams.
        ``rendezvous`` says how the trainer formed the group: ``process_group`` (weightsync's
        trainer, SGLang's and OpenRLHF's ``init_custom_process_group``), ``default_group`` (a
        trainer's own ``torch.distributed.init_process_group``) or ``vllm_stateless`` (vLLM's
        ``StatelessProcessGroup`` + ``PyNcclCommunicator``).
        Raises ``EngineFailure`` when the group does not form within ``timeout_s`` (the worker
        keeps serving), ``NotSupported`` when the engine has no groups."""

    @route
    def destroy_weights_update_group(self, group_name: str) -> OkReply:
        """Leave the weight-update group ``group_name``."""

    @route
    def pause_generation(self, mode: str = "keep", *, clear_cache: bool = False) -> PauseReply:
        """Pause generation: ``keep`` holds running requests, ``wait`` lets them finish,
        ``abort`` ends them (``aborted`` counts them).  Idempotent (``already_paused``)."""

    @route
    def resume_generation(self) -> OkReply:
        """Resume generation.  Raises ``IllegalState`` (``weights_torn``) while torn."""

    @route
    def flush_cache(self) -> FlushReply:
        """Reset the prefix cache.  Raises ``IllegalState`` (``cache_in_use``) when requests
        hold it (pause with ``abort`` or ``wait`` first)."""

    @route
    def release_memory(self, *, weights: Any = _UNSET, kv_cache: Any = _UNSET) -> Reply:
        """Release memory while paused: ``weights`` ``"offload"`` (default; restored as they
        were), ``"discard"`` (the worker then holds no version's weights until an update) or
        ``"keep"``; the KV cache unless ``kv_cache`` is false.  Reply: ``weights``,
        ``kv_cache``, ``weights_released``, ``paused``, ``digest``."""

    @route
    def resume_memory(self, *, weights: Any = _UNSET, kv_cache: Any = _UNSET) -> Reply:
        """Restore what :meth:`release_memory` released (offloaded weights as they were, the
        KV cache empty); discarded weights come back only through an update."""

    @route
    def abort_request(self, request_id: str) -> OkReply:
        """Abort the in-flight request ``request_id``; ``NotFound`` when there is none."""

    @route
    def liveness_probe(self) -> AliveReply:
        """Whether the engine can serve (``alive``)."""

    @route
    def clock(self) -> ClockReply:
        """The worker's clock (``clock``, unix seconds): what a declaration's ``not_after`` is
        checked against."""

    @route
    def weight_info(self) -> WeightInfoReply:
        """Names, dtypes (torch names such as ``bfloat16``) and shapes of the served weights."""

    @route
    def verify_weights(self, *, allow_load_digest: Any = _UNSET) -> VerifyReply:
        """Hash the weights actually served and compare with the recorded digest (``match``).
        ``allow_load_digest=True``: the worker may report the digest its last load took in
        the served memory instead, when nothing wrote the weights since (``scope`` is then
        ``"load_in_place"``).  Raises ``NotSupported`` when the engine cannot attest its weights."""

    @route
    def begin_weight_update(self) -> SessionReply:
        """Open an update session (paused or torn worker): updates sent with ``session=True``
        stream into it and nothing is committed until :meth:`end_weight_update`.  The reply
        says ``session_open`` and its ``deadline_s``.  Raises ``IllegalState`` while running."""

    @route
    def end_weight_update(
        self, *, weight_version: Any = _UNSET, reset_prefix_cache: Any = _UNSET
    ) -> UpdateReply:
        """Finish the update session: reset the prefix cache, commit ``weight_version``.
        Reply as for :meth:`update_weights_from_disk`; ``IllegalState`` without a session."""

    @route
    def abort_weight_update(self) -> AbandonReply:
        """Abandon the update session: the worker is torn if it wrote, untouched otherwise
        (the reply's ``torn``, ``paused`` and ``digest`` say which)."""

    @route
    def capabilities(self) -> CapabilitiesReply:
        """What this worker speaks and supports (dialects, sources, engine features)."""

    @route
    def engine_rpc(self, method: str, *args: Any, **kwargs: Any) -> RpcReply:
        """Call the engine method ``method`` (only names on its allow-list; others are
        ``InvalidRequest``) with ``args`` and ``kwargs``; the reply's ``result`` is its value."""
        return {"method": method, "args": list(args), "kwargs": kwargs}
