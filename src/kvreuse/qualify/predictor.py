"""What a server's cached_tokens must be, computed without the server.

`RulePredictor` applies the spec's rules to requests run one after another with nothing evicted:
the oracle of spec §15 (`kvreuse.oracle`) answers each lookup on the entries earlier requests
published (10.2–10.4: every unit boundary up to min(T, n·u) in attention groups; recurrent states
at the replay point ρ(P) and its page floors, at the junction and its floors, and at the finish
point φ(T)). It is exact while no block is evicted.

`ShadowPredictor` replays the same requests through a fresh manager and scheduler of the same
geometry, whose engine emits the server's own output tokens: exact under eviction too (scenario
(e)), independent of the server's HTTP path, step loop, engine and counters.
"""

from __future__ import annotations

from kvreuse.core import KVCacheManager, Request
from kvreuse.core.spi import replay_point
from kvreuse.deployment import Deployment
from kvreuse.oracle import Entry, OracleRequest, ident, num_units, oracle
from kvreuse.sched import ReplayTokens, Scheduler, ScriptedEngine


class RulePredictor:
    def __init__(self, dep: Deployment) -> None:
        self.geo = dep.cache.geometry
        self.dense = dep.cache.recurrent_retention == "dense"
        self.entries: set[Entry] = set()

    def predict(self, prompt: list[int]) -> tuple[int, int | None]:
        """(hit, junction) of a fresh request with this prompt."""
        res = oracle(self.geo, OracleRequest(tuple(prompt), len(prompt)), self.entries)
        return res.hit, res.junction

    def publish(self, prompt: list[int], output: list[int], hit: int, junction: int | None) -> None:
        """Add what a finished request published (T = P + len(output) − 1 committed)."""
        geo, u = self.geo, self.geo.hash_unit
        req = OracleRequest(tuple(prompt + output), len(prompt))
        committed = len(req.tokens) - 1
        n = num_units(geo, req)
        top = min(committed, n * u) // u * u  # E rounded to the unit grid
        groups = [g for g in geo.groups if g.cacheable]
        for g in groups:
            if g.is_attention:
                for b in range(u, top + 1, u):
                    self.entries.add((g.group_id, b, ident(geo, req, b)))
        for g in groups:
            if not g.is_attention:
                for c in self._states(g.page_size, len(prompt), committed, n, hit, junction):
                    self.entries.add((g.group_id, c, ident(geo, req, c)))

    def _states(
        self,
        page_size: int,
        prompt_len: int,
        committed: int,
        hashed_units: int,
        hit: int,
        junction: int | None,
    ) -> set[int]:
        """Positions of the recurrent states a request publishes (9.4, 10.4)."""
        geo, u, s = self.geo, self.geo.hash_unit, self.geo.common_page
        m, n = page_size, hashed_units
        n_prompt = max(0, (prompt_len - geo.lookahead) // u)
        marks = [replay_point(geo, prompt_len)]
        if junction is not None and junction > hit:
            marks.append(junction)
        limit = min(committed, n * u)
        planned = {c for x in marks for c in (x, x // m * m, x // s * s)}
        out = {c for c in planned if hit < c <= min(limit, n_prompt * u)}
        if self.dense:
            out |= set(range((hit // m + 1) * m, limit + 1, m))
        phi = min(committed // u, n) * u - (u if geo.spec_mode == "drop" else 0)
        if phi > 0:
            out.add(phi)  # the finish point, published at release (10.4)
        return out


class ShadowPredictor:
    def __init__(self, dep: Deployment) -> None:
        self.script = ReplayTokens()
        engine = ScriptedEngine(self.script, saves="up_to_end")
        self.sched = Scheduler(KVCacheManager(dep.cache), engine, dep.sched)
        self.count = 0

    def run(self, prompt: list[int], output: list[int], salt: str | None = None) -> int:
        """Replay one request to its end; its cached tokens."""
        self.count += 1
        rid = f"shadow-{self.count}"
        self.script.outputs[rid] = list(output)
        seq = self.sched.add(Request(rid, prompt, cache_salt=salt), max(1, len(output)))
        while not seq.finished:
            self.sched.step()
        self.sched.pop_finished(rid)
        return seq.cached_tokens or 0
