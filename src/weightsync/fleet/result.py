"""What a transaction did, and where it left the fleet: frozen values with a JSON form."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

import attrs

from weightsync.core.errors import WeightSyncError
from weightsync.fleet.records import PAUSE_MODES, POLICIES

__all__ = [
    "CLI_STEPS", "OUTCOMES", "PAUSE_MODES", "POLICIES", "RAY_STEPS", "ROUTER_STEPS", "Advice", "Brought", "Steps",
    "TransactionResult", "WorkerOutcome", "WorkerStatus",
]  # fmt: skip


@attrs.frozen
class Steps:
    """How advice names the operator's commands: the CLI's, or a running router's routes."""

    status: str
    update: str
    resume: str
    adopt: str
    """The whole clause that takes a fleet whose epoch another journal issued into this one."""
    verb: str = "run"
    """How a sentence asks for one of them: a command is run, a route is sent."""
    fence: str = "`--policy fence`"
    """How the operator asks for the fence policy (the failing workers fenced, not rolled back)."""
    restore_point: str = "Give the update `--initial-source` naming a checkpoint of the weights they hold"
    """The sentence (an imperative, without its full stop) by which the operator gives a
    transaction the checkpoint a rollback restores."""


CLI_STEPS: Final = Steps(
    status="`weightsync fleet status`",
    update="`weightsync fleet update`",
    resume="`weightsync fleet resume`",
    adopt="if the fleet's state is yours, run `weightsync fleet adopt` with this journal and these workers "
    "(it checks their digests agree), or restart those workers",
)
# While the router runs it holds the journal's lease: the commands that write the journal
# are its routes; adopting is done with the router stopped (it writes the journal directly).
ROUTER_STEPS: Final = Steps(
    status="`GET /fleet/status` on the router",
    update="`POST /fleet/update_weights_from_disk` on the router",
    resume="`POST /fleet/resume_generation` on the router",
    adopt="if the fleet's state is yours, stop the router and run `weightsync fleet adopt` with its journal "
    "and these workers (it checks their digests agree), or restart those workers",
    verb="send",
    fence='`"policy": "fence"` in the update\'s body',
    restore_point="Restart the router with `--initial-source` naming a checkpoint of the weights they hold",
)
# A Ray fleet's workers are actors: no command line reaches them, their RayFleet's methods do.
RAY_STEPS: Final = Steps(
    status="`RayFleet.status()`",
    update="`RayFleet.update(path, version)`",
    resume="`RayFleet.resume()`",
    adopt="restart those actors (a restarted one reports no epoch)",
    verb="call",
    fence='`policy="fence"`',
    restore_point="Build the fleet with `RayFleet(..., initial_source=path)` naming a checkpoint of the weights they "
    "hold, or push with `restore=` (the tensors they hold)",
)


def _named(urls: list[str], what: str) -> str:
    return f"{', '.join(urls)} {what}; " if urls else ""


# A worker's outcome once the transaction is over.
OUTCOMES: Final = (
    "committed",  # serves the new version, epoch and digest
    "unchanged",  # its weights were never changed (refused prepare, or not reached)
    "refused",  # refused the dry run: the transaction was aborted, nothing changed
    "rolled_back",  # loaded, then restored to its last committed weights and version
    "fenced",  # fence policy: left out of the committed set (paused, down, or not updated)
    "failed",  # could not be brought to a committed state: paused; see its errors
)

_STATUS_KEYS: Final = ("version", "epoch", "digest", "paused", "torn", "update_in_flight")


@attrs.frozen
class WorkerStatus:
    """A worker's answer to ``get_weight_version``, or the error that replaced it."""

    url: str
    reply: dict[str, Any] | None
    error: WeightSyncError | None = None

    def get(self, key: str) -> Any:
        return None if self.reply is None else self.reply.get(key)

    @property
    def last_error(self) -> str | None:
        """The error code that replaced the reply (``unreachable``, ``timeout``, a refusal
        code), else ``"torn"`` for a torn worker, else ``None``."""
        if self.error is not None:
            return self.error.code
        return "torn" if self.get("torn") else None

    @property
    def serving(self) -> bool:
        return self.reply is not None and not self.get("paused") and not self.get("torn")

    def to_json(self) -> dict[str, Any]:
        """``url``, ``version``, ``epoch``, ``digest``, ``paused``, ``torn``,
        ``update_in_flight`` (each ``None`` when it did not answer) and ``last_error``."""
        out: dict[str, Any] = {"url": self.url}
        out.update({k: self.get(k) for k in _STATUS_KEYS})
        out["last_error"] = self.last_error
        return out


@attrs.frozen
class WorkerOutcome:
    url: str
    outcome: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    code: str | None = None  # the first error this worker hit, machine-readable
    message: str | None = None
    digest: str | None = None  # the digest it reports now
    codes: tuple[str, ...] = ()  # every error it hit, in order
    holds: dict[str, Any] | None = None  # its state when the transaction ended (None: no answer)

    @classmethod
    def of(
        cls, url: str, outcome: str, errors: Sequence[WeightSyncError], status: WorkerStatus
    ) -> WorkerOutcome:
        first = errors[0] if errors else None
        holds = None if status.reply is None else {k: status.get(k) for k in _STATUS_KEYS}
        return cls(
            url,
            outcome,
            first.code if first else None,
            first.message if first else None,
            status.get("digest"),
            tuple(e.code for e in errors),
            holds,
        )

    @property
    def serving(self) -> bool:
        return self.holds is not None and not self.holds["paused"] and not self.holds["torn"]

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["codes"] = list(self.codes)
        out["serving"] = self.serving
        return out


@attrs.frozen
class TransactionResult:
    """``phase`` is the terminal phase; ``committed`` (and ``ok``) when the version committed.

    A transaction committed when it ended ``committed`` (every worker), or ``fenced`` with
    at least ``min_workers`` workers committed.  ``epoch`` is the epoch the serving workers
    now carry: the new one after a commit, the rollback's after a rollback.  :attr:`fleet`
    says where the fleet now is, as the workers reported it at the end, and
    :attr:`next_step` what to do about it.
    """

    txn: int
    phase: str
    version: Any
    epoch: int | None
    expected_digest: str | None
    policy: str
    workers: tuple[WorkerOutcome, ...]
    code: str | None = None
    message: str | None = None
    min_workers: int | None = None
    steps: Steps = attrs.field(default=CLI_STEPS, eq=False, repr=False)
    """Whose commands :attr:`next_step` names: the CLI's, a router's routes, a RayFleet's methods."""

    @property
    def committed(self) -> bool:
        if self.phase == "committed":
            return True
        if self.phase != "fenced" or self.min_workers is None:
            return False
        return sum(w.outcome == "committed" for w in self.workers) >= self.min_workers

    @property
    def ok(self) -> bool:
        return self.committed

    def worker(self, url: str) -> WorkerOutcome:
        return next(w for w in self.workers if w.url == url)

    @property
    def fleet(self) -> dict[str, Any]:
        """``versions``: each (version, epoch, digest) the serving workers report, with who
        serves it (one entry when the fleet agrees); ``serving``, ``fenced``, ``paused``
        (not serving, reachable) and ``unreachable`` worker lists."""
        versions: dict[str, dict[str, Any]] = {}
        for w in self.workers:
            if w.serving and w.holds is not None:
                key = repr((w.holds["version"], w.holds["epoch"], w.holds["digest"]))
                entry = versions.setdefault(
                    key,
                    {
                        "version": w.holds["version"],
                        "epoch": w.holds["epoch"],
                        "digest": w.holds["digest"],
                        "workers": [],
                    },
                )
                entry["workers"].append(w.url)
        return {
            "versions": list(versions.values()),
            "serving": [w.url for w in self.workers if w.serving],
            "fenced": [w.url for w in self.workers if w.outcome == "fenced"],
            "paused": [w.url for w in self.workers if w.holds is not None and not w.serving],
            "unreachable": [w.url for w in self.workers if w.holds is None],
        }

    @property
    def next_step(self) -> str:
        """What to do next, in :attr:`steps`' commands (see :meth:`advice`)."""
        return self.advice(self.steps)

    def advice(self, steps: Steps) -> str:
        """What to do next, naming ``steps``' commands: :data:`CLI_STEPS` for the ``weightsync
        fleet`` commands, :data:`ROUTER_STEPS` for a running router's routes (it holds the
        journal's lease, so the commands that write it would be refused there).  A worker
        that did not answer is called unreachable, never paused."""
        fleet = self.fleet
        stuck = [w for w in self.workers if w.outcome == "failed"]
        if stuck:
            down = [w.url for w in stuck if w.holds is None]
            paused = [w.url for w in stuck if w.holds is not None]
            said = [f"{', '.join(paused)} stay(s) paused"] if paused else []
            said += [f"{', '.join(down)} did not answer (down or unreachable)"] if down else []
            return (
                f"{len(stuck)} worker(s) could not be restored: {'; '.join(said)}. Check them "
                f"({steps.status}), then bring them onto a checkpoint ({steps.verb} {steps.update}), or resume "
                f"them once they hold what their label says ({steps.verb} {steps.resume})"
                + (". Restart the unreachable ones first." if down else ".")
            )
        if self.phase == "rollback_failed":
            return (
                f"the rollback did not finish: {_named(fleet['paused'], 'stay(s) paused')}"
                f"{_named(fleet['unreachable'], 'did not answer')}check them ({steps.status}), then "
                f"{steps.verb} the update again ({steps.update})"
            )
        if fleet["fenced"]:
            return (
                f"fenced worker(s) {', '.join(fleet['fenced'])} are out of the commit: fix them, then "
                f"{steps.verb} {steps.update} again to bring them onto it"
            )
        if self.committed:
            return "nothing: every worker serves the new version"
        untrusted = [w.url for w in self.workers if "untrusted_epoch" in w.codes]
        if untrusted:
            return (
                f"{', '.join(untrusted)} report(s) an epoch this journal never issued (another journal "
                f"committed it): {steps.adopt}; then {steps.verb} the update again ({steps.update})"
            )
        sourceless = [w.url for w in self.workers if w.code == "no_rollback_source"]
        if self.phase == "aborted" and sourceless:
            return (
                f"nothing changed: a rollback would have nothing to restore {', '.join(sourceless)} from (no "
                f"checkpoint of the weights they serve is known, a push committed them). {steps.restore_point}, "
                f"or accept fencing the failing workers instead of a rollback ({steps.fence}); then "
                f"{steps.verb} the update again ({steps.update})"
            )
        down = [w.url for w in self.workers if w.code in ("unreachable", "timeout")]
        if self.phase == "aborted" and down and self.policy != "fence":
            return (
                f"nothing changed: {', '.join(down)} did not answer (down or unreachable). Restart them and "
                f"{steps.verb} the update again ({steps.update}), or update the others without them "
                f"({steps.fence}: those that fail are fenced, the rest commit)"
            )
        if self.phase == "aborted" and self.code == "already_at_target":
            return (
                f"nothing to do: every worker already holds the delta's target, version {json.dumps(self.version)}; "
                f"the next delta applies to it ({steps.status} shows what each one serves)"
            )
        if self.phase == "aborted" and self.code == "coordinator_stopped":
            return (
                "nothing changed: the coordinator stopped before anything was written; "
                f"{steps.verb} the update again ({steps.update})"
            )
        if self.phase == "aborted":
            return f"nothing changed: fix what the refusals name, then {steps.verb} the update again ({steps.update})"
        return (
            "the fleet is back on its previous version: fix what the errors name, then "
            f"{steps.verb} the update again ({steps.update})"
        )

    def to_json(self, steps: Steps | None = None) -> dict[str, Any]:
        """The result as JSON, its ``next_step`` naming ``steps``' commands (default
        :attr:`steps`; see :meth:`advice`)."""
        out = attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "steps")
        out["workers"] = [w.to_json() for w in self.workers]
        out["committed"] = self.committed
        out["ok"] = self.ok
        out["fleet"] = self.fleet
        out["next_step"] = self.advice(steps or self.steps)
        return out


@attrs.frozen
class Advice:
    """A membership command's two pieces of advice: ``stuck`` (formatted with ``{workers}``,
    the failed workers' URLs) when some worker was not brought, ``done`` when every one was."""

    stuck: str
    done: str

    def given(self, failed: list[str]) -> str:
        return self.stuck.format(workers=", ".join(failed)) if failed else self.done


@attrs.frozen
class Brought:
    """What a membership command (``adopt``, ``add``) did: the commit it brought the workers
    to, each one's state after (``ok`` when every worker took it and was recorded), and the
    command's own :class:`Advice`, from which :attr:`next_step` is said."""

    version: Any
    epoch: int
    digest: str
    workers: tuple[WorkerStatus, ...]
    advice: Advice
    source: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[str]:
        return [w.url for w in self.workers if w.error is not None]

    @property
    def next_step(self) -> str:
        return self.advice.given(self.failed)

    def to_json(self) -> dict[str, Any]:
        skip = ("workers", "advice")
        out = {k: v for k, v in attrs.asdict(self, recurse=False).items() if k not in skip}
        return {
            "ok": self.ok,
            **out,
            "workers": [w.to_json() for w in self.workers],
            "next_step": self.next_step,
        }
