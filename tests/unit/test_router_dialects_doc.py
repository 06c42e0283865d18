"""docs/router.md maps every dialect route the router serves, and the router serves exactly
the paths it lets through without a body."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from weightsync.router.dialects import DIALECT_PATHS, dialect_routes
from weightsync.router.service import Router

DOC = Path(__file__).resolve().parents[2] / "docs" / "router.md"


async def _read(request: Any) -> dict[str, Any]:
    return {}


def test_every_router_dialect_route_is_in_router_md_and_bodiless_paths_match() -> None:
    routes = dialect_routes(cast(Router, None), _read, lambda request: None)
    paths = {r.path for r in routes}  # type: ignore[attr-defined]
    assert paths == DIALECT_PATHS
    section = DOC.read_text().split("## Dialects through the router", 1)[1].split("\n## ", 1)[0]
    for path in sorted(paths):
        assert f"`{path}" in section or f" {path}" in section, f"docs/router.md lacks {path}"
