"""`make test` on several processes (pytest-xdist, ``-n N --dist loadgroup``): which tests must
share a process, and a scheduler that keeps them together.

A test's group (:func:`group_of`) is the shared resource it needs, else the module whose
module- or session-scoped fixture starts something once for all its tests, else none (any
process).  Each worker writes the groups of what it collected to a file the controller names
(``pytest_configure_node``); the controller's scheduler (:class:`GroupScheduling`, pytest-xdist's
scope scheduling, largest group first) reads them, so a group runs on one process, in order.

(pytest-xdist's own ``xdist_group`` marker carries the group in the test's id, which pytest 9.2's
structured node ids no longer let a hook change; a file says the same without touching ids.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

SHARED_GROUPS = ("vllm", "vllm-peers", "ray")
"""The groups of a shared resource: the vLLM tests, in two lanes (each module starts one or two
vLLMs of ~2.5 GB, ``tests/vllm/servers.py``: two lanes at once fit beside the rest, more would
not), then every Ray test (one local cluster per process)."""

_KEY = "weightsync_groups"


def group_of(item: pytest.Item) -> str | None:
    """The group ``item`` runs in (see the module docstring)."""
    if item.get_closest_marker("vllm") is not None:  # tests/vllm/ in one lane, the rest in the other
        return "vllm" if item.nodeid.startswith("tests/vllm/") else "vllm-peers"
    module = getattr(item, "module", None)
    ray_cluster = sys.modules.get("tests.ray_cluster")
    if module is not None and ray_cluster is not None and getattr(module, "SMALL", None) is ray_cluster.SMALL:
        return "ray"  # a Ray test module: its actors take their resources from tests/ray_cluster.py
    fixtures = getattr(item, "_fixtureinfo", None)
    for name in fixtures.names_closure if fixtures is not None else ():
        for definition in fixtures.name2fixturedefs.get(name, ()):
            if definition.scope in ("module", "session", "package") and definition.baseid.endswith(".py"):
                return definition.baseid
    return None


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadgroup":
        config.stash[_path] = Path(tempfile.mkdtemp(prefix="weightsync-xdist-")) / "groups.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_path, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller tells each worker where to write the groups (under ``--dist loadgroup``)."""
    path = node.config.stash.get(_path, None)
    if path is not None:
        node.workerinput[_KEY] = str(path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A worker writes ``{test id: group}`` (every worker collects the same tests)."""
    target = getattr(config, "workerinput", {}).get(_KEY)
    if target is None:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    tmp = Path(f"{target}.{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(target)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") == "loadgroup":
        return GroupScheduling(config, log)
    return None


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """pytest-xdist's scope scheduling with the groups the workers wrote as scopes (a test
    without a group is a scope of its own); the largest scopes go out first."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None
        self._file: Path = config.stash[_path]

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            self._groups = json.loads(self._file.read_text()) if self._file.exists() else {}
        group = self._groups.get(nodeid)
        return f"group:{group}" if group is not None else nodeid


_path = pytest.StashKey[Path]()
