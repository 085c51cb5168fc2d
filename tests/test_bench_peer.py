"""scripts/bench_peer.py's table: computed from the JSONL, medians over each scenario's sittings at its newest
settings, and the copy on the benchmarks page (docs/benchmarks.md) is the one the committed JSONL gives (never typed
by hand)."""

import json

import pytest

from conftest import REPO, script_module


@pytest.fixture(scope="module")
def bench_peer():
    return script_module("bench_peer")


def _record(scenario, trainer, sec, inrun, rss, steps=("3", "12")):
    return {
        "scenario": scenario,
        "trainer": trainer,
        "sec_per_step": sec,
        "sec_per_step_inrun": inrun,
        "peak_rss_mb": rss,
        "args": ["--steps", *steps],
    }


def test_the_table_gives_medians_over_sittings_at_the_newest_settings(bench_peer, tmp_path, monkeypatch):
    results = tmp_path / "peer.jsonl"
    records = [
        # An older setting of the scenario (other steps): left out of the row.
        _record("recommended-sd15", "diffusers-example", 90.0, 90.0, 9000, steps=("2", "5")),
        _record("recommended-sd15", "difftune", 1.0, 1.0, 100, steps=("2", "5")),
        # Three sittings at the newest settings: speed ratios 2.0, 1.5 and 1.0 (peer in-run over difftune's).
        _record("recommended-sd15", "diffusers-example", 8.0, 8.0, 5000),
        _record("recommended-sd15", "difftune", 4.0, 4.0, 4000),
        _record("recommended-sd15", "diffusers-example", 7.0, 6.0, 5000),
        _record("recommended-sd15", "difftune", 5.0, 4.0, 4500),
        _record("recommended-sd15", "diffusers-example", 6.0, 5.0, 6000),
        _record("recommended-sd15", "difftune", 6.0, 5.0, 3000),
        _record("identical-tiny-fp32", "difftune", 1.0, 1.0, 100),  # no peer line before it: no sitting, no row
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    benchmarks = tmp_path / "benchmarks.md"
    benchmarks.write_text(f"before\n{bench_peer.MARKERS[0]}\nold table\n{bench_peer.MARKERS[1]}\nafter\n")
    monkeypatch.setattr(bench_peer, "RESULTS", results)
    bench_peer.write_table(benchmarks)
    text = benchmarks.read_text()
    assert (
        text.startswith("before\n") and text.endswith(f"{bench_peer.MARKERS[1]}\nafter\n") and "old table" not in text
    )
    rows = [line for line in text.splitlines() if line.startswith("| each trainer")]
    # RSS ratios per sitting 0.8, 0.9, 0.5: median 0.8.
    assert rows == [
        f"| {bench_peer.SCENARIOS['recommended-sd15']['what']} | 3 "
        "| 7 (6) | 5 (4) | 1.50x (1.00-2.00) | 5000 | 4000 | 0.80x |  | CPU | "
        "`python scripts/bench_peer.py --peer-script PEER --scenario recommended-sd15` |"
    ]
    assert "tiny model" not in text


def test_benchmarks_md_holds_the_table_of_the_committed_results(bench_peer):
    records = [json.loads(line) for line in bench_peer.RESULTS.read_text().splitlines() if line.strip()]
    text = (REPO / "docs" / "benchmarks.md").read_text()
    start, end = (text.index(marker) for marker in bench_peer.MARKERS)
    assert text[start + len(bench_peer.MARKERS[0]) : end].strip() == bench_peer.markdown_table(records)
