"""docs/api.md documents every route the server serves, each with an example."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.workers import Worker

DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def heading(path: str) -> str:
    if path == "/engine/routes":
        return "### routes (GET /engine/routes)"
    return f"### {path.removeprefix('/engine/')}"


def test_every_served_route_is_documented_with_an_example(worker: Worker) -> None:
    paths = set(httpx.get(f"{worker.url}/openapi.json").json()["paths"])
    assert {"/engine/update_weights_from_disk", "/v1/completions", "/health", "/metrics"} <= paths
    for path in sorted(paths):
        assert f"{heading(path)}\n" in DOC, f"docs/api.md lacks a section for {path}"
        section = DOC.split(f"{heading(path)}\n", 1)[1].split("\n### ", 1)[0]
        assert "```" in section or "→" in section, f"docs/api.md has no example for {path}"
    assert {f"/engine/{r}" for r in worker.client.routes()["routes"]} <= paths
