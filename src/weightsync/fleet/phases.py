"""The forward phases of a transaction, one method each: prepare (dry runs, epochs and
the expected digest), apply (pause, load), verify (attest the digest), commit (declare and
read back) and resume.  Each sends its calls through :class:`~.fanout.Fanout` and returns
the :class:`~._decide.Outcome` the decider steps on, with the rows to journal.
"""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.core.errors import EngineUnavailable, IllegalState, WeightSyncError
from weightsync.fleet._decide import Outcome
from weightsync.fleet._values import Held
from weightsync.fleet.channels import Channel
from weightsync.fleet.events import short_digest
from weightsync.fleet.fanout import Fanout, Hook, Reply
from weightsync.fleet.journal import ADOPT_LIMIT, CommittedRow
from weightsync.fleet.run import Run

__all__ = ["Phases"]


class Phases(Fanout):
    """What each forward phase sends, and how its answers become an outcome."""

    before_pause: Hook | None
    after_commit: Hook | None
    live_verify: bool

    async def _prepare(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        spec = run.spec

        async def one(url: str) -> tuple[Reply, Reply]:
            client = self.client(url, deadline)
            before = await client.get_weight_version()
            dry = await channel.dry_run(client, url)
            self._note(run, url, "dry run ok", f"digest {short_digest(dry.get('digest'))}")
            return before, dry

        done, failed = await self._each("preparing", run.progress.active, one, deadline)
        # The fleet epoch comes from the journal.  A fresh journal takes over a running
        # fleet at its highest (plausible) epoch; after that a worker's higher epoch is a
        # claim the journal never made: reported, and the worker is left out.
        issued = self.journal.issued_epoch()
        epochs = {u: b.get("epoch") for u, (b, _) in done.items() if isinstance(b.get("epoch"), int)}
        floor = issued if issued else max([e for e in epochs.values() if e < ADOPT_LIMIT], default=0)
        for url, epoch in epochs.items():
            if epoch > floor:
                done.pop(url)
                failed[url] = EngineUnavailable(
                    f"{url} reports epoch {epoch}, which this journal never issued (it issued up to "
                    f"{floor}): restart the worker, or use the journal that committed it",
                    code="untrusted_epoch", url=url,
                )  # fmt: skip
        expected = spec.expected_digest or channel.expected_digest()
        for url, (_, dry) in list(done.items()):
            digest = dry.get("digest")
            if expected is None and digest is not None:
                expected = digest
            elif digest is not None and digest != expected:
                done.pop(url)
                failed[url] = IllegalState(
                    f"{url}: the dry run would hold digest {digest}, expected {expected}",
                    code="digest_mismatch", url=url,
                )  # fmt: skip
        outcome = self._outcome(run, done, failed)
        for url, (before, _) in done.items():
            held = Held.from_status(before, self._restore_source(url))
            run.spec = run.spec.with_worker(attrs.evolve(run.spec.worker(url), previous=held))
        if not outcome.refused and (not outcome.unreachable or spec.policy == "fence"):
            run.spec = attrs.evolve(run.spec, expected_digest=expected, epoch=self.journal.issue_epoch(floor))
        return outcome, []

    async def _apply(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        active = run.progress.active
        await self._hook(run, self.before_pause, active, "before_pause")

        async def pause(url: str) -> None:
            await self.client(url, deadline).pause_generation(run.spec.pause_mode)
            self._note(run, url, "paused", run.spec.pause_mode)

        paused, failed = await self._each("applying", active, pause, deadline)
        loaded, more = await channel.apply(
            {u: self.client(u, deadline) for u in paused}, self._each, deadline
        )
        for url, reply in loaded.items():
            self._note(run, url, "loaded", f"digest {short_digest(reply.get('digest'))}")
        return self._outcome(run, loaded, {**failed, **more}), []

    async def _attest(self, url: str, deadline: float, expected: str | None) -> Reply:
        """The worker's digest of what it serves: recomputed from the served weights, or
        (unless ``live_verify``) the digest its load took in the served memory itself when
        nothing wrote the weights since — the worker decides which (``scope``).

        Raises ``IllegalState`` (``digest_mismatch``) when it is not ``expected`` or the
        recomputed digest differs from the recorded one (changed outside the control plane).
        """
        client = self.client(url, deadline)
        reply: Reply
        try:
            if self.live_verify:
                reply = await client.verify_weights()
            else:
                try:
                    reply = await client.verify_weights(allow_load_digest=True)
                except WeightSyncError as exc:  # a worker that predates the option re-hashes
                    if exc.code != "unknown_field":
                        raise
                    reply = await client.verify_weights()
        except WeightSyncError as exc:
            if exc.code not in ("unknown_route", "not_found", "not_supported"):
                raise
            reply = await client.get_weight_version()
        else:
            if reply.get("match") is not True:
                raise IllegalState(
                    f"{url}: serves digest {reply.get('digest')}, but recorded {reply.get('recorded_digest')}: "
                    "the weights were changed outside the control plane",
                    code="digest_mismatch", url=url,
                )  # fmt: skip
        if expected is None or reply.get("digest") != expected:
            raise IllegalState(
                f"{url}: holds digest {reply.get('digest')}, expected {expected}",
                code="digest_mismatch",
                url=url,
            )
        return reply

    async def _verify(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        expected = run.spec.expected_digest
        done, failed = await self._each(
            "verifying", run.progress.active, lambda u: self._attest(u, deadline, expected), deadline
        )
        for url in done:
            self._note(run, url, "verified", f"digest {short_digest(expected)}")
        return self._outcome(run, done, failed), []

    async def _declare(
        self, url: str, deadline: float, version: Any, epoch: int | None, digest: str | None
    ) -> Reply:
        """Declare ``version`` at ``epoch`` guarded by ``digest``, then read it back.

        Raises ``IllegalState`` (``commit_not_read_back``) when the worker's state afterwards
        is not exactly that (a 200 is a claim; the read-back is the evidence)."""
        client = self.client(url, deadline)
        options: dict[str, Any] = {} if epoch is None else {"epoch": epoch}
        if digest is not None:
            options["expected_digest"] = digest
        await client.set_weight_version(version, **options)
        back: Reply = await client.get_weight_version()
        want = {"version": version, "version_declared": True, "epoch": epoch, "digest": digest, "torn": False}
        got = {k: back.get(k) for k in want}
        if digest is None:
            got["digest"] = None
        if got != want:
            raise IllegalState(
                f"{url}: after the declaration it reports {got}, not {want}",
                code="commit_not_read_back",
                url=url,
            )
        return back

    async def _commit(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        s = run.spec
        done, failed = await self._each(
            "committing", run.progress.active,
            lambda u: self._declare(u, deadline, s.version, s.epoch, s.expected_digest), deadline,
        )  # fmt: skip
        outcome = self._outcome(run, done, failed)
        committed = []
        if not outcome.failed or s.policy == "fence":
            assert s.epoch is not None
            for url in done:
                self._note(run, url, "declared", f"epoch {s.epoch}")
                committed.append(
                    (url, CommittedRow(s.worker(url).source, s.version, s.epoch, s.expected_digest))
                )
        return outcome, committed

    async def _resume(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        """Resume the committed batch; a worker that does not hold the commit (it restarted)
        is first brought onto it.  One that cannot be stays paused and is reported."""
        s = run.spec

        async def one(url: str) -> None:
            client = self.client(url, deadline)
            now = await client.get_weight_version()
            if (now.get("version"), now.get("epoch"), now.get("digest"), now.get("torn")) != (
                s.version, s.epoch, s.expected_digest, False,
            ):  # fmt: skip
                self._note(run, url, "does not hold the commit", "bringing it onto it")
                await client.pause_generation(s.pause_mode)
                source = s.worker(url).source
                if source is None:
                    raise IllegalState(f"{url}: no source to load the commit from", code="no_restore_source")
                await channel.reload(client, source)
                await self._declare(url, deadline, s.version, s.epoch, s.expected_digest)
            await client.resume_generation()
            self._note(run, url, "serving", f"version {s.version!r}, epoch {s.epoch}")

        active = run.progress.active
        done, failed = await self._each("resuming", active, one, deadline)
        for url, exc in failed.items():
            run.fail(url, exc)
            run.resume_failed.add(url)
            self._note(run, url, "not resumed", f"{exc.code}: {exc.message}")
        await self._hook(run, self.after_commit, [u for u in active if u in done], "after_commit")
        return Outcome(ok=active), []
