"""docs/performance.md says where the project stands, today's numbers first (issue 32): at most 300 lines,
its first table within its first 40 lines, and every ``benchmarks/*.py`` it names exists.  The runs that
led there are in git, not on the page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "performance.md"
MAX_LINES = 300
FIRST_TABLE_WITHIN = 40


def _lines() -> list[str]:
    return PERFORMANCE.read_text().splitlines()


def test_performance_page_is_at_most_300_lines():
    assert len(_lines()) <= MAX_LINES, f"docs/performance.md has {len(_lines())} lines (at most {MAX_LINES})"


def test_performance_page_starts_with_todays_table():
    first = next((i for i, line in enumerate(_lines()) if line.lstrip().startswith("|")), None)
    assert first is not None, "docs/performance.md has no table"
    assert first < FIRST_TABLE_WITHIN, f"its first table starts on line {first + 1}"


def test_every_benchmark_the_performance_page_names_exists():
    named = set(re.findall(r"benchmarks/[A-Za-z0-9_]+\.py", PERFORMANCE.read_text()))
    assert named, "docs/performance.md names no benchmark"
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, missing


def test_the_sections_the_code_points_at_are_there():
    # docstrings and comments in qcompiler/, backends/, benchmarks/ and tests/ cite these by name
    headings = [line for line in _lines() if line.startswith("#")]
    for name in ("Throughput", "Calibration on both cores", "Calibration at 2 threads",
                 "Fused activations in place", "AMX tiles", "Batch 1 at 2 threads: the row split",
                 "Batch 1 at 2 threads: the native row split", "Partitioning: the merge step"):
        assert any(name in h for h in headings), name
