"""Every code block of the README runs (offline, from the repository root), or says why not in a
`<!-- readme-test: not run: REASON -->` line right before it: a stale example fails CI."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?P<marker><!-- readme-test: not run: (?P<reason>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```",
                   re.S)
BLOCKS = [(m.group("lang"), m.group("body"), m.group("reason")) for m in BLOCK.finditer(
    (ROOT / "README.md").read_text(encoding="utf-8"))]
RUN = [(lang, body) for lang, body, reason in BLOCKS if reason is None]


def test_every_block_runs_or_says_why_not():
    assert BLOCKS and RUN
    assert all(reason.strip() for _, _, reason in BLOCKS if reason is not None)
    assert {lang for lang, _, _ in BLOCKS} <= {"python", "bash"}


@pytest.mark.parametrize("lang, body", RUN, ids=[body.strip().splitlines()[0][:40] for _, body in RUN])
def test_readme_block_runs(lang, body):
    command = [sys.executable, "-c", body] if lang == "python" else ["bash", "-euo", "pipefail", "-c", body]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_performance_ratios_the_readme_quotes_are_in_the_benchmark_tables():
    """README's speed-ups are copied from benchmarks/README.md's tables (which the benchmark commands
    print): a ratio the README states that no table holds is stale."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Performance"):readme.index("## Reliability")]
    tables = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    quoted = re.findall(r"(\d+\.\d+)x", section)
    assert quoted
    for ratio in quoted:
        if not re.search(rf"\b{re.escape(ratio)}x\b", tables):
            if "-" in section[section.index(ratio) - 4:section.index(ratio)]:
                continue  # the upper end of a range ("3.3-4.9x"): its lower end is checked
            raise AssertionError(f"README quotes {ratio}x, which no table of benchmarks/README.md holds")
