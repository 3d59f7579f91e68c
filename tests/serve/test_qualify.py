"""`kvreuse qualify`: passes against an honest server, fails loudly against doctored ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli import main
from kvreuse.core import KVCacheManager
from kvreuse.sched import Scheduler, StepStats
from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread


def test_quick_qualify_passes_in_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["qualify", "--fake", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "qualify.json").read_text())
    assert doc["passed"] and not doc["failures"]
    names = [s["scenario"] for s in doc["scenarios"]]
    assert names == ["a-grid", "b-shared-prefix", "c-agent", "d-retrieval", "e-pressure"]
    by = {s["scenario"]: s for s in doc["scenarios"]}
    assert by["c-agent"]["requests"] == 8 and by["e-pressure"]["evicted_blocks"] > 0
    assert all(s["cached_tokens"] == s["hits_delta"] for s in doc["scenarios"])
    warm = [r for r in by["a-grid"]["rows"] if r["request"].startswith("warm-")]
    assert warm and all(r["answer_ok"] and r["cached"] == r["rules"] for r in warm)
    assert "PASSED" in capsys.readouterr().out
    assert (tmp_path / "qualify.md").read_text().startswith("# kvreuse qualify: PASSED")


class InflatedCounterManager(KVCacheManager):
    """Exports a prefix_cache_hits counter 8 tokens too high per admitted request."""

    def metrics(self) -> dict[str, Any]:
        m = dict(super().metrics())
        m["prefix_cache_hits"] = m["prefix_cache_hits"] + 8 * m["prefix_cache_requests"]
        return m


def _doctored(kind: str) -> Any:
    backend = fake_backend(num_blocks=96)
    old = backend.scheduler
    if kind == "cached":
        backend.scheduler = _InflateCached(old.mgr, old.engine, old.config)
    else:
        mgr = InflatedCounterManager(old.mgr.config)
        backend.scheduler = Scheduler(mgr, old.engine, old.config)
    return backend


class _InflateCached(Scheduler):
    def step(self) -> StepStats:
        st = super().step()
        for rid in st.admitted:
            seq = self.seqs[rid]
            if seq.cached_tokens is not None and seq.preemptions == 0:
                seq.cached_tokens += 1
        return st


@pytest.mark.parametrize(("kind", "check"), [("cached", "!= rules"), ("counter", "counters")])
def test_qualify_fails_on_a_doctored_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, check: str
) -> None:
    with ServerThread(create_app(_doctored(kind))) as url:
        rc = main(
            ["qualify", "--url", url, "--quick", "--max-fill-tokens", "0", "--out", str(tmp_path)]
        )
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and check in out
    doc = json.loads((tmp_path / "qualify.json").read_text())
    assert not doc["passed"] and any(check in f for f in doc["failures"])


def test_quick_qualify_passes_on_the_default_model(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine]'")
    assert main(["qualify", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "qualify.json").read_text())
    assert doc["passed"] and doc["model"].startswith("kvreuse-tiny")
    assert all(s["skipped"] is None for s in doc["scenarios"])
