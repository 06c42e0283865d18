"""The way back: restore the last committed weights on the workers a transaction touched,
re-declare the old version under a new epoch, and resume what was running."""

from __future__ import annotations

from typing import Any

import attrs

from weightsync.core.errors import IllegalState
from weightsync.fleet._decide import Outcome
from weightsync.fleet.channels import Channel
from weightsync.fleet.events import short_digest
from weightsync.fleet.journal import CommittedRow
from weightsync.fleet.phases import Phases
from weightsync.fleet.run import Run

__all__ = ["Rollback"]


class Rollback(Phases):
    """The rolling-back phase (it declares as the commit does)."""

    async def _rollback(self, run: Run, channel: Channel, deadline: float) -> tuple[Outcome, list[Any]]:
        """Pause, restore the last committed weights, re-declare the old version under a new
        epoch, read it back, resume what was running.  Epochs only go up."""
        s = run.spec
        if s.rollback_epoch is None:
            run.spec = s = attrs.evolve(s, rollback_epoch=self.journal.issue_epoch(s.epoch or 0))
            self.journal.record(run.id, s, run.progress)
        active = run.progress.active
        serving = [u for u in active if u in run.progress.committed]
        await self._hook(run, self.before_pause, serving, "before_pause")

        async def one(url: str) -> CommittedRow | None:
            client = self.client(url, deadline)
            prev = s.worker(url).previous
            if prev is None:
                return None
            await client.pause_generation(s.pause_mode)
            now = await client.get_weight_version()
            changed = now.get("torn") is True or now.get("digest") != prev.digest or prev.digest is None
            # A re-push reaches the whole group: every worker waits for it, none resumes early.
            changed |= prev.source is None and getattr(channel, "restores_without_source", False)
            if changed:
                if prev.source is None and not getattr(channel, "restores_without_source", False):
                    raise IllegalState(
                        f"{url}: holds digest {short_digest(now.get('digest'))} and no committed source is known "
                        "to restore: it stays paused; run `weightsync fleet update` with a checkpoint, "
                        "or pass --initial-source next time",
                        code="no_rollback_source", url=url,
                    )  # fmt: skip
                reply = await channel.reload(client, prev.source)
                if prev.digest is not None and reply.get("digest") != prev.digest:
                    raise IllegalState(
                        f"{url}: restored digest {reply.get('digest')}, expected {prev.digest}: it stays paused",
                        code="digest_mismatch", url=url,
                    )  # fmt: skip
                run.rolled.add(url)
            row = None
            if prev.declared:
                back = await self._declare(
                    url, deadline, prev.version, s.rollback_epoch, prev.digest or now.get("digest")
                )
                row = CommittedRow(prev.source, prev.version, int(s.rollback_epoch or 0), back.get("digest"))
            if not prev.paused:
                await client.resume_generation()
            self._note(run, url, "restored" if changed else "unchanged", f"epoch {s.rollback_epoch}")
            return row

        done, failed = await self._each("rolling_back", active, one, deadline)
        await self._hook(run, self.after_commit, [u for u in serving if u in done], "after_commit")
        outcome = self._outcome(run, done, failed)
        return outcome, [(u, row) for u, row in done.items() if row is not None]
