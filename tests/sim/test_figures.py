"""Figures in the docs come from records a run wrote (docs/figures/NAME.json: command,
machine, date, values), and `benchmarks/figures.py check` fails when a doc prints anything
else: a figure typed from memory, or one left behind when its record was measured again."""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = module
    spec.loader.exec_module(module)
    return module


figures = _figures()


def test_every_doc_figure_is_its_records() -> None:
    assert figures.differences() == []


def test_every_record_names_its_command_machine_and_date() -> None:
    records = sorted((ROOT / "docs" / "figures").glob("*.json"))
    assert len(records) >= 8
    used = "".join(d.read_text(encoding="utf-8") for d in figures.docs())
    for path in records:
        rec = json.loads(path.read_text(encoding="utf-8"))
        assert rec["command"] and rec["values"], path.name
        assert "cores" in rec["machine"], path.name
        datetime.date.fromisoformat(rec["date"])
        assert f"fig {path.stem} " in used or f"figure: {path.stem} " in used, (
            f"{path.name} is printed by no doc"
        )


def test_a_figure_that_differs_from_its_record_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = figures.value("trace_synthetic_all", "simulate_wall_s.hits")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "hits <!--fig trace_synthetic_all simulate_wall_s.hits ,-->39,850,801<!--/fig-->\n"
        "and <!--fig trace_synthetic_all simulate_wall_s.hits ,-->"
        f"{real:,}<!--/fig-->\n"
        "<!--fig nowhere some.key-->1<!--/fig-->\n"
        "<!-- figure: fleet_example table -->\n```text\nan old table\n```\n"
    )
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    monkeypatch.setattr(figures, "docs", lambda: [doc])
    found = figures.differences()
    assert len(found) == 3, found
    assert "prints '39,850,801', its record '39,850,800'" in found[0]
    assert "no record docs/figures/nowhere.json" in found[1]
    assert "the block of fleet_example table differs" in found[2]


def test_a_deterministic_record_is_what_its_command_prints_now() -> None:
    """The fleet example is a simulation: the same on every machine, so its record must be
    exactly what the command prints today (a routing change shows here)."""
    pytest.importorskip("zmq", reason="a fleet needs pyzmq: pip install -e '.[events]'")
    _, values = figures.RECIPES["fleet_example"]()
    assert values == figures.load("fleet_example")["values"]


def test_render_formats() -> None:
    assert figures.render(0.3736, "*100:.1f") == "37.4"
    assert figures.render(0.0761, "*1000:.0f") == "76"
    assert figures.render(54097440, ",") == "54,097,440"
    assert figures.render("x", None) == "x"
