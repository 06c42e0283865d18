"""weightsync.core.plan: sharded, multi-source transfer plans as pure data.

A *plan* here always means a transfer plan: who sends which box of which tensor to which worker
rank, in which round, packed into which buffer (DESIGN.md §12).

* :mod:`.boxes` — slices of a tensor, and the JSON readers and bounds every layout and plan wire form shares;
* :mod:`.layouts` — who holds what (trainer ranks) and who serves what (worker ranks);
* :mod:`.value` — a plan, its transfers and one worker's part of it;
* :mod:`.build` — :func:`~.build.make_plan`, from two layouts to a plan;
* :mod:`.check` — one worker's part checked against what that worker serves.
"""
