"""The typed requests of the admin routes, each parsed from an untrusted body.

Every ``from_body`` uses the checkers of :mod:`weightsync.core.validation` (strict types,
unknown fields refused, an ``InvalidRequest`` with a code naming the field); weight
sources are parsed by their own classes (:mod:`weightsync.core.sources`).  Parsing never
looks at the worker's state: a malformed request is a 400 even when the state would also
refuse it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, ClassVar, Final

import attrs

from weightsync.core.errors import InvalidRequest
from weightsync.core.snapshot import Declared, PauseMode
from weightsync.core.sources import (
    DeltaSource,
    DeltaStreamSource,
    DiskSource,
    DistributedSource,
    PlanSource,
    SourceType,
    TensorSource,
    WeightSource,
)
from weightsync.core.validation import (
    Body,
    any_json,
    array_of,
    boolean,
    bounded,
    declared,
    hex_digest,
    host,
    obj,
    one_of,
    positive_number,
    store_name,
    string,
)


@attrs.frozen
class EmptyRequest:
    """Routes without fields: get_weight_version, resume_generation, flush_cache, ..."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_body(cls, body: Any) -> EmptyRequest:
        Body(body, cls.FIELDS)
        return cls()


RECEIVERS: Final = ("inline", "process")
"""Who joins a weight-update group on the worker: the worker itself, or a helper process."""

RENDEZVOUS: Final = ("process_group", "default_group", "vllm_stateless")
"""How the trainer formed the group, so the worker meets it there: SGLang's/OpenRLHF's
``init_custom_process_group`` (also weightsync's own trainer); a trainer's own
``torch.distributed.init_process_group``; vLLM's ``StatelessProcessGroup`` with
``PyNcclCommunicator``."""

MAX_EPOCH: Final = 2**63 - 1
"""The largest fleet epoch (it fits a signed 64-bit integer everywhere it is stored)."""


MAX_NOT_AFTER: Final = 253402300799.0
"""The latest ``not_after`` a declaration may carry: the last second of the year 9999."""


def unix_time(field: str, value: Any) -> float:
    """A moment in unix seconds: a finite number above 0, at most :data:`MAX_NOT_AFTER`."""
    return positive_number(field, value, MAX_NOT_AFTER)


@attrs.frozen(eq=True, hash=False)
class SetWeightVersion:
    """Declare a version; with ``epoch`` (a fleet commit) and ``expected_digest`` (the
    weights the declaration is about) as guards checked against the worker's state, and
    ``not_after`` (unix seconds, the worker's clock) after which the worker refuses it
    (``commit_expired``: a fleet commit that arrives once its coordinator gave up on it)."""

    version: Declared
    epoch: int | None = None
    expected_digest: str | None = None
    not_after: float | None = None
    FIELDS: ClassVar[tuple[str, ...]] = ("weight_version", "epoch", "expected_digest", "not_after")

    @classmethod
    def from_body(cls, body: Any) -> SetWeightVersion:
        b = Body(body, cls.FIELDS)
        return cls(
            b.get("weight_version", declared),
            b.get("epoch", bounded(0, MAX_EPOCH), None),
            b.get("expected_digest", hex_digest, None),
            b.get("not_after", unix_time, None),
        )


@attrs.frozen
class PauseRequest:
    mode: PauseMode = PauseMode.KEEP
    clear_cache: bool = False
    FIELDS: ClassVar[tuple[str, ...]] = ("mode", "clear_cache")

    @classmethod
    def from_body(cls, body: Any) -> PauseRequest:
        b = Body(body, cls.FIELDS)
        mode = b.get("mode", one_of([m.value for m in PauseMode]), "keep")
        return cls(PauseMode(mode), b.get("clear_cache", boolean, False))


@attrs.frozen
class VerifyRequest:
    """``verify_weights``: ``allow_load_digest`` lets the worker report the digest its last
    load took in the served memory, when nothing wrote the weights since, instead of hashing
    them all again (see :meth:`Controller.verify_weights
    <weightsync.core.controller.Controller.verify_weights>`)."""

    allow_load_digest: bool = False
    FIELDS: ClassVar[tuple[str, ...]] = ("allow_load_digest",)

    @classmethod
    def from_body(cls, body: Any) -> VerifyRequest:
        return cls(Body(body, cls.FIELDS).get("allow_load_digest", boolean, False))


@attrs.frozen
class MemoryRequest:
    """``release_memory`` / ``resume_memory``: ``weights`` released as ``"offload"`` (kept in
    host memory, restored as they were), ``"discard"`` (freed: only an update refills them) or
    ``None`` (kept), or restored (``"restore"``); the KV cache released or restored (restored
    empty) when ``kv_cache``.  A release defaults to vLLM's level 1 (offload, and the KV cache)."""

    weights: str | None = None
    kv_cache: bool = True
    FIELDS: ClassVar[tuple[str, ...]] = ("weights", "kv_cache")

    @classmethod
    def release_from_body(cls, body: Any) -> MemoryRequest:
        b = Body(body, cls.FIELDS)
        weights = b.get("weights", one_of(["offload", "discard", "keep"]), "offload")
        return cls(None if weights == "keep" else weights, b.get("kv_cache", boolean, True))

    @classmethod
    def resume_from_body(cls, body: Any) -> MemoryRequest:
        b = Body(body, cls.FIELDS)
        return cls("restore" if b.get("weights", boolean, True) else None, b.get("kv_cache", boolean, True))


@attrs.frozen
class AbortRequest:
    """``abort_request``: the id of the one in-flight request to end (``NotFound`` when the
    engine has no such request)."""

    request_id: str
    FIELDS: ClassVar[tuple[str, ...]] = ("request_id",)

    @classmethod
    def from_body(cls, body: Any) -> AbortRequest:
        return cls(Body(body, cls.FIELDS).get("request_id", string))


_UPDATE_FIELDS: Final = ("weight_version", "allow_unpaused", "reset_prefix_cache", "dry_run", "session")


def check_unpaused(allow_unpaused: bool, reset_prefix_cache: bool) -> None:
    """Raises ``InvalidRequest`` (``conflicting_options``) when both are true: a prefix cache
    cannot be reset under running requests."""
    if allow_unpaused and reset_prefix_cache:
        raise InvalidRequest(
            "allow_unpaused and reset_prefix_cache cannot both be true: a prefix cache cannot "
            "be reset under running requests",
            code="conflicting_options",
        )


def unpaused_options(b: Body) -> tuple[bool, bool]:
    """``allow_unpaused`` and ``reset_prefix_cache`` of ``b``, the reset defaulting to ``not
    allow_unpaused``.  Raises ``InvalidRequest`` (:func:`check_unpaused`)."""
    allow_unpaused = b.get("allow_unpaused", boolean, False)
    reset = b.get("reset_prefix_cache", boolean, not allow_unpaused)
    check_unpaused(allow_unpaused, reset)
    return allow_unpaused, reset


@attrs.frozen(eq=True, hash=False)
class UpdateRequest:
    """An update from any source.  ``version`` is ``None`` when the caller omitted it.

    ``reset_prefix_cache`` defaults to ``not allow_unpaused``: a cache cannot be reset
    under running requests, so only an explicit ``true`` with ``allow_unpaused`` is refused
    (``conflicting_options``).  ``dry_run`` validates the source and writes nothing (legal
    in every state).  ``session`` streams the tensors into the open update session instead
    (its ``version`` then waits for the session's finish, and the cache is reset there).
    """

    source: WeightSource
    version: Declared | None = None
    allow_unpaused: bool = False
    reset_prefix_cache: bool = True
    dry_run: bool = False
    session: bool = False

    def __attrs_post_init__(self) -> None:
        check_unpaused(self.allow_unpaused, self.reset_prefix_cache)
        if self.session and (self.allow_unpaused or self.dry_run):
            raise InvalidRequest(
                "session cannot be combined with allow_unpaused or dry_run: a session is paused, "
                "and its updates write",
                code="conflicting_options",
            )

    @classmethod
    def from_source_body(cls, source: SourceType, body: Any) -> UpdateRequest:
        """An update from ``source`` (a source class): its fields, parsed by its own parser,
        beside the update's.  Raises ``InvalidRequest``."""
        b = Body(body, (*source.FIELDS, *_UPDATE_FIELDS))
        parsed = source.parse(b)
        version = b.get("weight_version", declared, None)
        if isinstance(parsed, DiskSource):  # the reader holds the label against the manifest's
            parsed = attrs.evolve(parsed, label=None if version is None else [version.value])
        allow_unpaused, reset = unpaused_options(b)
        dry_run = b.get("dry_run", boolean, False)
        return cls(parsed, version, allow_unpaused, reset, dry_run, b.get("session", boolean, False))

    @classmethod
    def from_disk_body(cls, body: Any) -> UpdateRequest:
        return cls.from_source_body(DiskSource, body)

    @classmethod
    def from_distributed_body(cls, body: Any) -> UpdateRequest:
        """Dense tensors, or with ``delta`` a sparse delta stream (:class:`DeltaStreamSource`)."""
        sparse = isinstance(body, dict) and "delta" in body
        return cls.from_source_body(DeltaStreamSource if sparse else DistributedSource, body)

    @classmethod
    def from_tensor_body(cls, body: Any) -> UpdateRequest:
        return cls.from_source_body(TensorSource, body)

    @classmethod
    def from_plan_body(cls, body: Any) -> UpdateRequest:
        return cls.from_source_body(PlanSource, body)

    @classmethod
    def from_delta_body(cls, body: Any) -> UpdateRequest:
        return cls.from_source_body(DeltaSource, body)


@attrs.frozen(eq=True, hash=False)
class FinishSession:
    """Finish the open update session: reset the prefix cache (unless told not to), then
    commit ``version`` (the one given here, else the last one an update inside the session
    carried, else none: the declaration stays as it was)."""

    version: Declared | None = None
    reset_prefix_cache: bool = True
    FIELDS: ClassVar[tuple[str, ...]] = ("weight_version", "reset_prefix_cache")

    @classmethod
    def from_body(cls, body: Any) -> FinishSession:
        b = Body(body, cls.FIELDS)
        version = Declared(b.get("weight_version", any_json)) if b.has("weight_version") else None
        return cls(version, b.get("reset_prefix_cache", boolean, True))


MAX_TIMEOUT_S: Final = 86400.0
"""The longest wait any timeout or deadline may ask for (a day): a worker's rendezvous, a
trainer's group, a fleet transaction's deadline.  Longer would overflow torch's timers."""

MAX_WORLD_SIZE: Final = 65536
"""The largest weight-update group (torch takes ranks and sizes as 32-bit integers)."""


@attrs.frozen
class InitGroupRequest:
    """Join a dedicated weight-update group as ranks ``rank_offset ..`` (the trainer is rank 0).

    Its wire form (:meth:`to_wire` / :meth:`from_wire`) is the body form, read by the same
    parser, so a group joined across a process boundary is checked as at the edge.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str = "nccl"
    timeout_s: float = 60.0
    receiver: str = "inline"
    """``inline``: the worker joins the group itself (weightsync's packed stream, plans);
    ``process``: a helper process joins it and receives foreign streams, so that a trainer
    that sends more bytes than declared cannot abort the worker (gloo only)."""
    rendezvous: str = "process_group"
    """How the trainer formed the group (:data:`RENDEZVOUS`)."""
    FIELDS: ClassVar[tuple[str, ...]] = (
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s",
        "receiver", "rendezvous",
    )  # fmt: skip

    @classmethod
    def from_body(cls, body: Any) -> InitGroupRequest:
        b = Body(body, cls.FIELDS)
        req = cls(
            b.get("master_address", host),
            b.get("master_port", bounded(1, 65535)),
            b.get("rank_offset", bounded(1, MAX_WORLD_SIZE - 1)),
            b.get("world_size", bounded(2, MAX_WORLD_SIZE)),
            b.get("group_name", store_name),
            b.get("backend", one_of(("nccl", "gloo")), "nccl"),
            b.get("timeout_s", lambda f, v: positive_number(f, v, hi=MAX_TIMEOUT_S), 60.0),
            b.get("receiver", one_of(RECEIVERS), "inline"),
            b.get("rendezvous", one_of(RENDEZVOUS), "process_group"),
        )
        if req.rendezvous == "vllm_stateless" and req.backend != "nccl":
            raise InvalidRequest(
                "rendezvous 'vllm_stateless' is vLLM's StatelessProcessGroup with PyNcclCommunicator: "
                "backend 'nccl' only (a gloo trainer forms 'default_group' or 'process_group')",
                code="invalid_value",
                field="rendezvous",
            )
        if req.receiver == "process" and req.backend != "gloo":
            raise InvalidRequest(
                "receiver 'process' needs backend 'gloo' (an NCCL group cannot be received in a helper)",
                code="invalid_value",
                field="receiver",
            )
        if req.rank_offset >= req.world_size:
            raise InvalidRequest(
                f"rank_offset ({req.rank_offset}) must be below world_size ({req.world_size})",
                code="invalid_value",
                field="rank_offset",
            )
        return req

    def to_wire(self) -> dict[str, Any]:
        """The request as a plain dict (its body form) for a process boundary."""
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_wire(cls, wire: Any) -> InitGroupRequest:
        """Rebuild a request from :meth:`to_wire`'s dict.  Raises ``InvalidRequest``, as
        :meth:`from_body` does."""
        return cls.from_body(wire)


@attrs.frozen
class DestroyGroupRequest:
    """``destroy_weights_update_group``: the name of the weight-update group to leave."""

    group_name: str
    FIELDS: ClassVar[tuple[str, ...]] = ("group_name",)

    @classmethod
    def from_body(cls, body: Any) -> DestroyGroupRequest:
        return cls(Body(body, cls.FIELDS).get("group_name", store_name))


@attrs.frozen(eq=True, hash=False)
class EngineRpcRequest:
    """Dynamo's ``engine_rpc``, limited to an allow-list: no caller-chosen method names."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = attrs.field(factory=dict)
    FIELDS: ClassVar[tuple[str, ...]] = ("method", "args", "kwargs")

    @classmethod
    def from_body(cls, body: Any, allowed: Collection[str] = ()) -> EngineRpcRequest:
        b = Body(body, cls.FIELDS)
        method = b.get("method", string)
        if method not in allowed:
            raise InvalidRequest(
                f"engine_rpc method {method!r} is not on the allow-list {sorted(allowed)}",
                code="method_not_allowed",
                field="method",
            )
        args = b.get("args", array_of(any_json), [])
        return cls(method, tuple(args), b.get("kwargs", obj, {}))
