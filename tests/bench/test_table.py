"""The headline table of docs/benchmarks/README.md: generated from the committed reports,
checked against them, and refused in one line where a report or the README cannot be read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from schnet_ipu.bench import table
from schnet_ipu.bench.__main__ import main
from schnet_ipu.errors import run_cli


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    """A copy of the committed benchmarks folder."""
    return Path(shutil.copytree(table.DOCS, tmp_path / "benchmarks"))


def check(root: Path) -> int:
    return main(["table", "--check", "--root", str(root)])


def test_the_committed_table_is_up_to_date(docs):
    assert check(docs) == 0


def test_a_changed_report_makes_the_table_stale_until_it_is_regenerated(docs, capsys):
    report_path = docs / "accuracy" / "cpu-10min" / "accuracy.json"
    report = json.loads(report_path.read_text())
    ours = next(row for row in report["results"] if row["name"] == "ours (configs/qm9.yaml)")
    ours["test_mae"] = 0.0123456
    report_path.write_text(json.dumps(report))

    assert check(docs) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["table", "--root", str(docs)]) == 0
    assert check(docs) == 0
    readme = (docs / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "accuracy/cpu-10min/accuracy.json" in line)
    pyg = next(r["test_mae"] for r in report["results"] if r["name"] == "stock PyG SchNet")
    assert "| 12.35 meV |" in row
    assert f"| {table.figure_text(12.3456 / (pyg * 1000))} |" in row


def test_every_report_has_a_row_with_its_machine_and_link(docs):
    rows = table.table_rows(docs)
    for path in docs.rglob("*.json"):
        link = f"({path.relative_to(docs).as_posix()})"
        assert any(row.endswith(link + " |") for row in rows), path
    machines = {row.split(" | ")[5] for row in rows}
    assert "AMD EPYC, 2 cores" in machines and "not recorded" in machines


def test_a_report_without_a_rule_is_named(docs, capsys):
    (docs / "throughput" / "cpu-quick" / "mystery.json").write_text("{}")
    assert run_cli(lambda: check(docs)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "mystery.json" in err and "RULES" in err


def test_a_report_missing_its_figures_is_named(docs, capsys):
    broken = docs / "model" / "cpu-quick" / "model.json"
    broken.write_text(json.dumps({"suite": "model", "results": []}))
    assert run_cli(lambda: check(docs)) == 2
    assert "model.json: not a model report" in capsys.readouterr().err


def test_a_readme_without_markers_is_refused(docs, capsys):
    readme = docs / "README.md"
    readme.write_text(readme.read_text().replace(table.BEGIN, ""))
    assert run_cli(lambda: check(docs)) == 2
    assert "no headline table markers" in capsys.readouterr().err
