"""The tiers below a pool, by name: the host's (in the server's memory; its KV events say "CPU",
as vLLM's do) and the store's (shared by a fleet's replicas: docs/tiers.md), and a deployment
with them (`with_tiers`). The simulator, the server and the fleet build and name tiers only
through here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvreuse.core import Admission, TierSpec

if TYPE_CHECKING:
    from kvreuse.deployment import Deployment

HOST_TIER, STORE_TIER = "host", "store"  # a fleet's replicas share the store (docs/tiers.md)


def tier_medium(name: str) -> str:
    """The medium a tier's KV events name: "CPU" for the host's, as vLLM's; the store's is the
    one `TierSpec` gives a tier without one."""
    return TierSpec(name, 1, medium="CPU" if name == HOST_TIER else "").medium


def tier_media(host_tokens: int | None, store_tokens: int | None) -> list[str]:
    """The media of the tiers `--host-capacity` and `--store-capacity` give, in order."""
    sizes = ((HOST_TIER, host_tokens), (STORE_TIER, store_tokens))
    return [tier_medium(name) for name, tokens in sizes if tokens is not None]


def with_tiers(
    dep: Deployment,
    host_tokens: int | None,
    store_tokens: int | None,
    store_admission: str = "on-eviction",
) -> Deployment:
    """`dep` with a host and/or store tier, each sized in blocks as a pool of that many
    tokens would be (the null block aside); the host's KV events say "CPU", as vLLM's. The
    store admits every kind by `store_admission` (`--store-admission`)."""
    rule = Admission(store_admission.replace("-", "_"))
    tiers = [
        TierSpec(
            name, dep.cache.blocks_for_request(tokens), medium=tier_medium(name), default=default
        )
        for name, tokens, default in (
            (HOST_TIER, host_tokens, Admission.ON_EVICTION),
            (STORE_TIER, store_tokens, rule),
        )
        if tokens is not None
    ]
    return replace(dep, tiers=(*dep.tiers, *tiers)) if tiers else dep
