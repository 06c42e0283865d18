"""docs/compat.md is the page a whole test run writes (tests/compat.py): every module that runs
a peer's code has a row there, and every module of tests/peers/ is one of them."""

from __future__ import annotations

from collections import Counter

from tests.compat import MODULES, PAGE, ROOT, render


def test_every_peer_module_has_a_row_and_every_row_names_a_module() -> None:
    peers = {f"tests/peers/{p.name}" for p in (ROOT / "tests" / "peers").glob("test_*.py")}
    assert peers - set(MODULES) == set(), "a peer test module without a row in tests/compat.py"
    assert all((ROOT / module).is_file() for module in MODULES)


def test_the_page_was_written_by_a_run_of_these_modules() -> None:
    page = PAGE.read_text()
    assert page.startswith("# Peer compatibility\n") and "Written by `make test`" in page
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`tests/" in line]
    ran = [line.split(" | ")[3].split("`")[1] for line in rows]  # the "what ran" column names the module
    assert sorted(ran) == sorted(MODULES)
    assert all(not line.endswith("| not run |") for line in rows)


def test_render_counts_each_modules_outcomes() -> None:
    module = next(iter(MODULES))
    page = render({module: Counter(passed=3, failed=1)})
    row = next(line for line in page.splitlines() if f"`{module}`" in line)
    assert row.endswith("| 1 failed, 3 passed |") and MODULES[module].name in row
