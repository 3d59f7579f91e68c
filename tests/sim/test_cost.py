"""The cost model: the geometry file's [cost] table, what a step costs (tokens, saved recurrent
states, prefill chunks), and the seed's 256- vs 2,048-token checkpoint A/B it must reproduce."""

from __future__ import annotations

import json
import re

import pytest

from kvreuse.core import KVCacheManager, Request
from kvreuse.deployment import PRESETS, GeometryError, geometry_toml, load_geometry, preset
from kvreuse.sim.cost import CostMeter, CostModel, cold_prefill, fit_state_cost
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload

FULL = '[cache]\nnum_blocks = 8\n[[groups]]\nkind = "full"\nblock_size = 16\n'
# The seed's measurement: cold 32 K prefill on one server, 2,048- vs 256-token recurrent pages.
SEED_TOKENS, SEED_2048, SEED_256 = 32768, 12_759.0, 10_200.0
SEED_LOSS = 1 - SEED_256 / SEED_2048  # 20.06 %: the throughput the finer pages cost


def test_a_cost_table_loads_and_reads_back() -> None:
    dep = load_geometry(FULL + "[cost]\nprefill_tokens_per_s = 5000\nsaved_state_s = 0.001\n")
    assert dep.cost == {"prefill_tokens_per_s": 5000.0, "saved_state_s": 0.001}
    text = geometry_toml(dep)
    assert "[cost]\nprefill_tokens_per_s = 5000.0\nsaved_state_s = 0.001\n" in text
    assert load_geometry(text, dep.name) == dep


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_prints_cost_only_when_it_sets_one(name: str) -> None:
    dep = preset(name)
    text = geometry_toml(dep)
    assert ("[cost]" in text) == bool(dep.cost)
    assert load_geometry(text, name) == dep


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        (
            "[cost]\nprefill_tokens = 1\n",
            r"\[cost\] has unknown key\(s\) \['prefill_tokens'\] "
            r"\('prefill_tokens': did you mean 'prefill_tokens_per_s'\?\)",
        ),
        (
            '[cost]\nsaved_state_s = "1ms"\n',
            r"\[cost\] saved_state_s must be a number in "
            r"\[0, 3600\], got '1ms'",
        ),
        ("[cost]\nsaved_state_s = -0.5\n", r"saved_state_s must be a number in \[0, 3600\]"),
        (
            "[cost]\nprefill_tokens_per_s = 0\n",
            r"prefill_tokens_per_s must be a number in "
            r"\[1, 1e\+12\], got 0",
        ),
        ("[cost]\nprefill_tokens_per_s = nan\n", r"prefill_tokens_per_s .* got nan"),
        ("[cost]\ndecode_step_s = inf\n", r"decode_step_s .* got inf"),
        ("[cost]\nprefill_chunk_s = true\n", r"prefill_chunk_s .* got True"),
        ("cost = 5\n", r"cost must be a table"),
        (
            "[costs]\nx = 1\n",
            r"unknown table\(s\) \['costs'\]; use \[cache\], \[\[groups\]\] "
            r"and \[cost\]",
        ),
    ],
)
def test_a_bad_cost_table_is_one_line_naming_the_file_and_key(table: str, fragment: str) -> None:
    text = table + FULL if table.startswith("cost =") else FULL + table
    with pytest.raises(GeometryError, match=fragment) as info:
        load_geometry(text, "g.toml")
    assert str(info.value).startswith("g.toml: ") and "\n" not in str(info.value)


def test_the_cost_model_checks_its_fields_and_keeps_its_positional_form() -> None:
    assert CostModel(1000.0, 0.5).step_time(500, 1) == pytest.approx(1.0)
    for bad in ({"saved_state_s": -1.0}, {"prefill_tokens_per_s": float("nan")}):
        with pytest.raises(ValueError, match=f"cost model: {next(iter(bad))} must be a number"):
            CostModel(**bad)  # type: ignore[arg-type]


def test_for_deployment_takes_the_file_then_explicit_overrides() -> None:
    dep = preset("hybrid-dcp4-ckpt256")
    model = CostModel.for_deployment(dep)
    assert (model.prefill_tokens_per_s, model.saved_state_s) == (
        dep.cost["prefill_tokens_per_s"],
        dep.cost["saved_state_s"],
    )
    assert model.decode_step_s == CostModel().decode_step_s  # not in the file: the default
    over = CostModel.for_deployment(dep, prefill_tokens_per_s=1e4, decode_step_s=None)
    assert over.prefill_tokens_per_s == 1e4 and over.decode_step_s == model.decode_step_s
    assert CostModel.for_deployment(preset("attention-16")) == CostModel()
    with pytest.raises(TypeError, match="unknown cost field"):
        CostModel.for_deployment(dep, prefill_rate=1.0)


def _wanted_states(name: str, prompt_tokens: int) -> int:
    """The states a cold prompt saves, from the core's own save-position rules: what
    `save_positions` wants at admission, per recurrent group."""
    dep = preset(name)
    mgr = KVCacheManager(dep.cache)
    mgr.add_request(Request("r", prompt_token_ids=list(range(prompt_tokens))))
    wanted = mgr.save_positions("r", mgr.lookup("r"))
    return len(wanted) * len(dep.cache.geometry.recurrent)


@pytest.mark.parametrize("name", ["hybrid-dcp4-ckpt256", "hybrid-dcp4-ckpt2048"])
def test_a_cold_prefill_saves_the_states_the_core_asks_for(name: str) -> None:
    """With a state at every page, each chunk ends at a wanted position and writes it."""
    cold = cold_prefill(name, SEED_TOKENS)
    assert cold.num_saved_states == cold.num_prefill_chunks == _wanted_states(name, SEED_TOKENS)


def test_sparse_retention_also_writes_a_rolling_state_at_each_chunk_end() -> None:
    """hybrid-dcp4 wants 3 states (replay point, its 8,192 floor, the prompt's end) but writes
    one at the end of every chunk: the step budget (8,192) cuts the prompt at 8,192 and 16,384
    too, and a step saves its last unit boundary (held, then dropped when out of range)."""
    cold = cold_prefill("hybrid-dcp4", SEED_TOKENS)
    assert _wanted_states("hybrid-dcp4", SEED_TOKENS) == 3
    assert cold.num_saved_states == cold.num_prefill_chunks == 5


def test_the_ckpt_presets_checkpoint_every_page() -> None:
    assert _wanted_states("hybrid-dcp4-ckpt256", SEED_TOKENS) == SEED_TOKENS // 256
    # every 2,048 tokens, and the replay point ⌊(P − 1)/256⌋·256 of the resend
    assert _wanted_states("hybrid-dcp4-ckpt2048", SEED_TOKENS) == SEED_TOKENS // 2048 + 1


def test_each_cost_term_adds_what_it_says() -> None:
    base = cold_prefill("attention-16", SEED_TOKENS, CostModel(20_000.0))
    assert base.num_saved_states == 0 and base.num_prefill_chunks == 4  # 8,192-token budget
    assert base.seconds == pytest.approx(SEED_TOKENS / 20_000)
    chunked = cold_prefill("attention-16", SEED_TOKENS, CostModel(20_000.0, prefill_chunk_s=0.1))
    assert chunked.seconds - base.seconds == pytest.approx(0.4)
    hybrid = cold_prefill("hybrid-dcp4", SEED_TOKENS, CostModel(20_000.0, saved_state_s=0.01))
    assert hybrid.seconds - base.seconds == pytest.approx(0.01 * hybrid.num_saved_states)


def test_the_ckpt_presets_reproduce_the_seed_throughput_loss() -> None:
    fine = cold_prefill("hybrid-dcp4-ckpt256", SEED_TOKENS)
    coarse = cold_prefill("hybrid-dcp4-ckpt2048", SEED_TOKENS)
    assert 1 - fine.tokens_per_s / coarse.tokens_per_s == pytest.approx(SEED_LOSS, abs=0.005)
    assert coarse.tokens_per_s == pytest.approx(SEED_2048, rel=0.005)


def test_fit_state_cost_derives_the_presets_cost_from_the_measurements() -> None:
    fit = fit_state_cost(
        SEED_TOKENS, ("hybrid-dcp4-ckpt2048", SEED_2048), ("hybrid-dcp4-ckpt256", SEED_256)
    )
    cost = preset("hybrid-dcp4-ckpt256").cost  # the same server: the same [cost] in both
    assert cost == preset("hybrid-dcp4-ckpt2048").cost
    assert fit.prefill_tokens_per_s == pytest.approx(cost["prefill_tokens_per_s"], rel=1e-4)
    assert fit.saved_state_s == pytest.approx(cost["saved_state_s"], rel=0.01)
    with pytest.raises(ValueError, match="both deployments save 5 states"):
        fit_state_cost(SEED_TOKENS, ("hybrid-dcp4", 1e4), ("hybrid-dcp4", 9e3))
    with pytest.raises(ValueError, match="do not fit"):  # finer pages measured faster
        fit_state_cost(
            SEED_TOKENS, ("hybrid-dcp4-ckpt2048", SEED_256), ("hybrid-dcp4-ckpt256", SEED_2048)
        )


def _cold_ttft(name: str) -> float:
    wl = load_workload(
        [
            json.dumps(
                {
                    "id": "cold",
                    "prompt": {"random": {"seed": 1, "len": SEED_TOKENS}},
                    "max_tokens": 1,
                }
            )
        ]
    )
    rows: list[dict] = []
    simulate(preset(name), wl, sink=rows.append)
    return float(rows[0]["ttft_estimate_s"])


def test_the_simulator_reproduces_the_seed_a_b_at_32k() -> None:
    """`kvreuse simulate`'s own clock, with each geometry's [cost]: cold 32 K prefill runs
    20.1 % ± 0.5 slower in throughput on 256-token checkpoints than on 2,048-token ones."""
    coarse, fine = _cold_ttft("hybrid-dcp4-ckpt2048"), _cold_ttft("hybrid-dcp4-ckpt256")
    assert 1 - coarse / fine == pytest.approx(0.201, abs=0.005)


def test_the_simulator_reports_saved_states_chunks_and_prefill_seconds() -> None:
    wl = load_workload(
        [json.dumps({"id": "a", "prompt": {"random": {"seed": 1, "len": 4096}}, "max_tokens": 4})]
    )
    s = simulate(preset("hybrid-dcp4-ckpt256"), wl).summary
    assert s["saved_states"] == _wanted_states("hybrid-dcp4-ckpt256", 4096)  # decode saves none
    assert s["prefill_chunks"] == 4096 // 256
    cost = CostModel.for_deployment(preset("hybrid-dcp4-ckpt256"))
    expected = 4096 / cost.prefill_tokens_per_s + s["saved_states"] * cost.saved_state_s
    assert s["prefill_seconds"] == pytest.approx(expected, abs=1e-5)
    assert s["simulated_seconds"] == pytest.approx(expected + 3 * cost.decode_step_s, abs=1e-5)


def test_the_meter_passes_outcomes_through_and_counts_per_step() -> None:
    calls: list[object] = []

    def engine(step: object, seqs: object) -> list[tuple[int, list[int], list[int]]]:
        calls.append(step)
        return [(4, [], [4, 8]), (9, [1], [])]

    class Plan:
        def __init__(self, rid: str, start: int) -> None:
            self.request_id, self.start = rid, start

    class Step:
        def __init__(self) -> None:
            self.requests = [Plan("p", 0), Plan("d", 8)]

    class Seq:
        def __init__(self, num: int, output: list[int]) -> None:
            self.num_tokens, self.output = num, output

    meter = CostMeter(engine, CostModel(100.0, 1.0, saved_state_s=0.5, prefill_chunk_s=2.0))
    out = meter(Step(), {"p": Seq(10, []), "d": Seq(9, [7])})  # type: ignore[arg-type]
    assert out == [(4, [], [4, 8]), (9, [1], [])] and len(calls) == 1
    # 100 prefill tokens (1 s) + 2 states (1 s) + 1 chunk ("d" decodes) (2 s) + a decode step
    assert meter.step_time(100, 1) == pytest.approx(5.0)
    assert meter.step_time(0, 0) == 0.0  # a step that never reached the engine costs nothing
    assert meter.summary() == {"saved_states": 2, "prefill_chunks": 1, "prefill_seconds": 4.0}


def test_the_docs_cost_example_is_a_valid_geometry() -> None:
    """docs/simulate.md's [cost] example loads as written."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "simulate.md").read_text()
    block = re.search(r"```toml\n(\[cache\][^`]*\[cost\][^`]*)```", doc)
    assert block is not None, "docs/simulate.md has no geometry example with a [cost] table"
    assert load_geometry(block[1], "docs").cost
