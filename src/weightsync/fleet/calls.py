"""What each phase sends, as data: :class:`Call` values (worker, route, body), one at a time.

A phase's work on one worker is a *script*: a generator that yields each call it wants made
and is sent the worker's reply — or has the worker's error thrown in, at that same point —
in the sans-I/O style of h11.  A script never touches a worker, a clock or the journal, so
a test drives it by hand, reply by reply; the driver (:class:`~weightsync.fleet.fanout.Fanout`)
plays one script per worker, every worker at once.  Besides a call a script may yield a
:class:`Note` (journal it and say it as it happens), :class:`Rolled` (this worker's last
committed weights are back), :class:`Repush` (a push channel's group restore, which is
not one call to one worker), :class:`~weightsync.fleet.clocks.ReadClock` and
:class:`~weightsync.fleet.clocks.Expires` (read the worker's clock; when a declaration
expires, in it: :mod:`weightsync.fleet.clocks`), :class:`InDoubt` (a declaration sent that got no
answer: it may still land, until it expires) or :class:`Settle` (wait until none of this
worker's declarations in doubt can land any more).  What the replies come to, once every
worker answered, is read by :mod:`weightsync.fleet.outcomes`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any, Final, TypeVar

import attrs

from weightsync.core.errors import IllegalState, WeightSyncError
from weightsync.fleet.clocks import CLOCK_SKEW_S as CLOCK_SKEW_S  # where the tests read it
from weightsync.fleet.clocks import Expires, Expiry, ReadClock
from weightsync.fleet.events import short_digest
from weightsync.fleet.records import CommittedRow, TransactionSpec
from weightsync.trainer.route_methods import RouteMethods

T = TypeVar("T")
Reply = dict[str, Any]

UNANSWERED: Final = frozenset({"timeout", "unreachable", "coordinator_error"})
"""Codes of a call that got no answer from its worker: unless the error says it was never
sent (``sent: false``: no connection was made), the request may still reach the worker."""


def _route(_: Any, __: Any, route: str) -> None:
    if route.startswith("_") or not callable(getattr(RouteMethods, route, None)):
        raise ValueError(f"{route!r} is not an admin route")


@attrs.frozen
class Call:
    """One request to one worker: the admin route and its body's fields.  The driver sends
    it as the worker client's method of the same name (one per route), so the body on the
    wire is exactly what that method sends for these arguments."""

    worker: str
    route: str = attrs.field(validator=_route)
    body: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Note:
    """A step worth a line in the journal and in the progress lines, as it happens."""

    worker: str
    what: str
    detail: str = ""


@attrs.frozen
class Rolled:
    """The worker's last committed weights are back (it counts as rolled back, whatever
    happens to it next)."""

    worker: str


@attrs.frozen
class Repush:
    """Restore the worker by the channel's re-push of the weights it was handed back: one
    push to the whole group, shared by every worker that asks.  The reply is the worker's."""

    worker: str


@attrs.frozen
class InDoubt:
    """A declaration to the worker got no answer: it may still land there until ``until``
    (unix seconds, the coordinator's clock)."""

    worker: str
    until: float


@attrs.frozen
class Settle:
    """Wait until no declaration in doubt to the worker can land any more (see
    :class:`InDoubt`) before going on: what comes next may not be undone by a late one."""

    worker: str


Step = Call | Note | Rolled | Repush | ReadClock | Expires | InDoubt | Settle
Script = Generator[Step, Any, T]
Restore = Callable[[Reply, str, float], Script[Reply]]
"""``restore(now, digest, not_after)``: a script that takes a paused worker (``now`` its
state) back to ``digest``, its declarations expiring at ``not_after`` (unix seconds, the
coordinator's clock); its value is the worker's state after."""


def state(url: str) -> Call:
    """Read what ``url`` holds: version, epoch, digest, paused, torn."""
    return Call(url, "get_weight_version")


def pause(url: str, mode: str) -> Call:
    return Call(url, "pause_generation", {"mode": mode})


def resume(url: str) -> Call:
    return Call(url, "resume_generation")


def load(url: str, path: str) -> Call:
    """Load the checkpoint at ``path`` (as ``url`` sees it), with a fresh prefix cache and no
    version: the label changes only at a commit."""
    return Call(url, "update_weights_from_disk", {"model_path": path, "reset_prefix_cache": True})


def declaration(
    url: str, version: Any, epoch: int | None, digest: str | None, not_after: float | None = None
) -> Call:
    """Declare ``version`` at ``epoch``, refused unless the worker holds ``digest`` and takes
    it up by ``not_after`` (unix seconds, the worker's clock: see :func:`declaring`)."""
    body: dict[str, Any] = {"weight_version": version}
    if epoch is not None:
        body["epoch"] = epoch
    if digest is not None:
        body["expected_digest"] = digest
    if not_after is not None:
        body["not_after"] = not_after
    return Call(url, "set_weight_version", body)


def unanswered(exc: BaseException) -> bool:
    """Whether a call that failed with ``exc`` may still reach its worker: no answer came
    (:data:`UNANSWERED`, or a failure that is not the family's) and nothing says it was
    never sent.  A worker's own refusal is an answer."""
    if not isinstance(exc, WeightSyncError):
        return True
    return exc.code in UNANSWERED and exc.details.get("sent") is not False


def first(step: Step, script: Script[T]) -> Script[T]:
    """``step``, then ``script``; the value is the script's."""
    yield step
    return (yield from script)


def mismatch(url: str, what: str, code: str = "digest_mismatch") -> IllegalState:
    """The refusal of a worker that does not hold what it must (``url: what``)."""
    return IllegalState(f"{url}: {what}", code=code, url=url)


def one(call: Call | Repush) -> Script[Reply]:
    """Make ``call``; the reply is the script's value."""
    reply: Reply = yield call
    return reply


def built(url: str, build: Callable[[str], Call]) -> Script[Reply]:
    """Make the call ``build(url)``, built when the script starts (a call that cannot be
    built fails this worker alone); the reply is the script's value."""
    return (yield from one(build(url)))


def read_after(url: str, first: Call | None = None) -> Script[Reply]:
    """Make ``first`` (if any), then read what ``url`` holds: the script's value."""
    if first is not None:
        yield first
    return (yield from one(state(url)))


def prepare(
    url: str, dry_run: Callable[[str], Call], initial: str | None = None
) -> Script[tuple[Reply, Reply]]:
    """What ``url`` holds (a rollback restores it), then the channel's dry run (it validates
    the update and writes nothing); the value is both replies.

    ``initial``: the initial source a rollback would restore ``url`` from (it has no
    committed one): dry-run it too, and raise ``IllegalState`` (``initial_source_mismatch``)
    unless it would load the digest ``url`` holds now — before anything is written, since a
    rollback could not restore it.  A torn worker, or one whose digest is unknown, holds
    nothing to compare.
    """
    before = yield from one(state(url))
    yield ReadClock(url)  # what the commit's expiry is sent by
    dry = yield from built(url, dry_run)
    yield Note(url, "dry run ok", f"digest {short_digest(dry.get('digest'))}")
    held = before.get("digest")
    if initial is not None and isinstance(held, str) and before.get("torn") is not True:
        yield from restores(url, initial, held)
    return before, dry


def restores(url: str, path: str, held: str) -> Script[None]:
    """Dry-run the checkpoint at ``path`` on ``url``: it writes nothing.  Raises
    ``IllegalState`` (``initial_source_mismatch``) unless it would load ``held``, the digest
    ``url`` holds now (so it could restore it)."""
    back = yield Call(url, "update_weights_from_disk", {"model_path": path, "dry_run": True})
    would = back.get("digest")
    if would != held:
        what = (
            f"would load digest {short_digest(would)}"
            if would is not None
            else "cannot say what it would load before loading it (its tensors need a dtype cast)"
        )
        raise mismatch(
            url,
            f"the source {path} {what}, but the worker holds {short_digest(held)}: it could not "
            "restore it; name the checkpoint the workers hold now as the initial source (`weightsync "
            "checkpoint --initial` writes what a fresh reference worker holds)",
            "initial_source_mismatch",
        )


def resume_labelled(url: str, allow_mislabelled: bool = False) -> Script[Reply]:
    """Resume ``url`` unless its declared label no longer describes its weights
    (``version_current`` false: weights loaded without a declaration); the value is its state
    after.  Raises ``IllegalState`` (``version_not_current``) then, unless
    ``allow_mislabelled``: it stays paused.  An undeclared worker claims nothing."""
    now = yield from one(state(url))
    if now.get("version_declared") is True and now.get("version_current") is False and not allow_mislabelled:
        raise mismatch(
            url,
            f"its label {now.get('version')!r} does not describe the weights it holds (digest "
            f"{short_digest(now.get('digest'))}): it stays paused; bring it onto a commit with "
            "`weightsync fleet update`, or resume it anyway with --allow-mislabelled",
            "version_not_current",
        )
    yield resume(url)
    return (yield from one(state(url)))


def pause_to_load(url: str, mode: str) -> Script[None]:
    """Pause ``url`` before the channel loads it (a running worker refuses a load)."""
    yield pause(url, mode)
    yield Note(url, "paused", mode)


def attest(url: str, expected: str | None, live_verify: bool) -> Script[Reply]:
    """The worker's digest of what it serves: recomputed from the served weights, or
    (unless ``live_verify``) the digest its load took in the served memory itself when
    nothing wrote the weights since — the worker decides which (``scope``).  A worker that
    cannot attest is read instead.

    Raises ``IllegalState`` (``digest_mismatch``) when it is not ``expected`` or the
    recomputed digest differs from the recorded one (changed outside the control plane).
    """
    reply: Reply
    try:
        if live_verify:
            reply = yield Call(url, "verify_weights")
        else:
            try:
                reply = yield Call(url, "verify_weights", {"allow_load_digest": True})
            except WeightSyncError as exc:  # a worker that predates the option re-hashes
                if exc.code != "unknown_field":
                    raise
                reply = yield Call(url, "verify_weights")
    except WeightSyncError as exc:
        if exc.code not in ("unknown_route", "not_found", "not_supported"):
            raise
        reply = yield state(url)
    else:
        if reply.get("match") is not True:
            raise mismatch(
                url,
                f"serves digest {reply.get('digest')}, but recorded {reply.get('recorded_digest')}: "
                "the weights were changed outside the control plane",
            )
    if expected is None or reply.get("digest") != expected:
        raise mismatch(url, f"holds digest {reply.get('digest')}, expected {expected}")
    return reply


def read_back(
    url: str, reply: Mapping[str, Any], version: Any, epoch: int | None, digest: str | None
) -> None:
    """Check that ``reply`` (the state read after a declaration) is exactly that declaration:
    a 200 is a claim, the read-back is the evidence.

    Raises ``IllegalState`` (``commit_not_read_back``) otherwise.
    """
    want = {"version": version, "version_declared": True, "epoch": epoch, "digest": digest, "torn": False}
    got = {k: reply.get(k) for k in want}
    if digest is None:
        got["digest"] = None
    if got != want:
        raise mismatch(url, f"after the declaration it reports {got}, not {want}", "commit_not_read_back")


def declaring(
    url: str, version: Any, epoch: int | None, digest: str | None, not_after: float
) -> Script[Reply]:
    """Declare ``version`` at ``epoch`` guarded by ``digest``, expiring at ``not_after`` (unix
    seconds, the coordinator's clock; sent in the worker's, as :class:`Expires` answers); the
    value is the reply.  One that got no answer is reported :class:`InDoubt` (until when it
    may still land) before its error is raised."""
    expiry: Expiry = yield Expires(url, not_after)
    try:
        return (yield from one(declaration(url, version, epoch, digest, expiry.theirs)))
    except Exception as exc:
        if unanswered(exc):
            yield InDoubt(url, expiry.until)
        raise


def declare(url: str, version: Any, epoch: int | None, digest: str | None, not_after: float) -> Script[Reply]:
    """:func:`declaring`, then read the declaration back (see :func:`read_back`); the value
    is the state read back."""
    yield from declaring(url, version, epoch, digest, not_after)
    back = yield from one(state(url))
    read_back(url, back, version, epoch, digest)
    return back


def resume_committed(
    url: str, spec: TransactionSpec, not_after: float, restore: Restore | None = None
) -> Script[None]:
    """Resume ``url`` on the commit; a worker that does not hold it (it restarted) is first
    paused, reloaded (from its source, else by ``restore``: catch-up's chain) and declared
    (expiring at ``not_after``, the coordinator's clock).
    Raises ``IllegalState`` (``no_restore_source``) when there is nothing to reload it from:
    it stays paused."""
    now = yield from one(state(url))
    if (now.get("version"), now.get("epoch"), now.get("digest"), now.get("torn")) != (
        spec.version, spec.epoch, spec.expected_digest, False,
    ):  # fmt: skip
        yield Note(url, "does not hold the commit", "bringing it onto it")
        yield pause(url, spec.pause_mode)
        source = spec.worker(url).source
        if source is not None:
            yield load(url, source)
        elif restore is not None and spec.expected_digest is not None:
            yield from restore(now, spec.expected_digest, not_after)
        else:
            raise IllegalState(f"{url}: no source to load the commit from", code="no_restore_source")
        yield from declare(url, spec.version, spec.epoch, spec.expected_digest, not_after)
    yield resume(url)
    yield Note(url, "serving", f"version {spec.version!r}, epoch {spec.epoch}")


def roll_back(
    url: str, spec: TransactionSpec, repush: bool, not_after: float, restore: Restore | None = None
) -> Script[CommittedRow | None]:
    """Pause, restore the last committed weights (a load of its source, or with ``repush``
    the channel's re-push, or with ``restore`` the script that reaches its old digest —
    catch-up's chain — where no source is known), re-declare the old version under the
    rollback epoch (expiring at ``not_after``, the coordinator's clock), read it back, resume
    what was running.  The value is the worker's new
    committed row (``None`` when it had no declared version, or was never prepared).

    Raises ``IllegalState`` — ``no_rollback_source``, or ``digest_mismatch`` when the
    restore lands another digest — and the worker stays paused.
    """
    prev = spec.worker(url).previous
    if prev is None:
        return None
    yield pause(url, spec.pause_mode)
    now = yield from one(state(url))
    changed = now.get("torn") is True or now.get("digest") != prev.digest or prev.digest is None
    # A re-push reaches the whole group: every worker waits for it, none resumes early.
    changed |= prev.source is None and repush
    if changed:
        if prev.source is None and not repush and (restore is None or prev.digest is None):
            raise IllegalState(
                f"{url}: holds digest {short_digest(now.get('digest'))} and no committed source is known "
                "to restore: it stays paused; bring it onto a checkpoint with a fleet update, "
                "or give the next transaction an initial source",
                code="no_rollback_source",
                url=url,
            )
        if prev.source is None and not repush:
            assert restore is not None and prev.digest is not None
            reply = yield from restore(now, prev.digest, not_after)
        else:
            reply = yield from one(Repush(url) if prev.source is None else load(url, prev.source))
        if prev.digest is not None and reply.get("digest") != prev.digest:
            raise mismatch(
                url, f"restored digest {reply.get('digest')}, expected {prev.digest}: it stays paused"
            )
        yield Rolled(url)
    row = None
    if prev.declared:
        epoch = spec.rollback_epoch
        back = yield from declare(url, prev.version, epoch, prev.digest or now.get("digest"), not_after)
        row = CommittedRow(prev.source, prev.version, int(epoch or 0), back.get("digest"))
    if not prev.paused:
        yield resume(url)
    yield Note(url, "restored" if changed else "unchanged", f"epoch {spec.rollback_epoch}")
    return row
