"""`kvreuse.fleet`: several replicas behind one router, simulated or live.

    routing/     what every fleet shares: a request hashed once (query), the five policies
                 (policy), `Router`: a mirror and a load per replica under one policy (router)
    simulation/  N simulated replicas on one clock (run: `simulate_fleet`), the workload on its
                 way to the router (feed), hit rates, balance and predicted vs delivered
                 (summary), `kvreuse simulate --replicas N` (cli)
    serving/     a live fleet behind one OpenAI endpoint (docs/fleet-serving.md): the FastAPI
                 front (front), the routing state (dispatch), a replica as the front sees it
                 (members), mirrors kept current without holding the routing lock across I/O
                 (freshness), a shared store's view (store), relaying answers (forward),
                 Prometheus series (metrics), time limits (deadlines), `kvreuse fleet` /
                 `kvreuse route` (cli, serve_args, preflight), local replica processes
                 (replicas) and their restarts (supervise)
    ray_serve/   the same front on Ray Serve (`ray` extra): the application (app), its
                 deployments (deploy), Ray's request-router API scoring by `Router` (router),
                 and what the two share (shared)
    options.py   the options the fleet's commands declare alike (a replica's, the load weight)

The router and the simulation need the `events` extra (msgspec for the mirrors' wire events;
pyzmq too when a `Subscriber` feeds them). This file imports nothing, so
`kvreuse.fleet.simulation.cli` can offer the options without that extra.
"""

# The routing policies by name; routing/policy.py builds each (and checks at import that it
# builds exactly these).
POLICIES = ("round-robin", "least-loaded", "text-prefix", "attention-chain", "exact")


def check_policy(name: str) -> str:
    """`name` when it names a policy of `POLICIES`; else ValueError naming the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
    return name


# How many prefill tokens one token of a replica's load (routing/router.py's rule) is worth in the
# routing cost. Dynamo's KV router weighs them equally (1), but running tokens are mostly cached
# context that costs no compute: on the workloads of docs/fleet.md (its record,
# docs/figures/fleet_load_weight.json) 0.02 reuses what ignoring load does, where 1 gives much
# of the reuse away; load then decides between replicas that would reuse alike.
DEFAULT_LOAD_WEIGHT = 0.02

# Seconds between the front's health checks of its replicas (`--health-interval`).
DEFAULT_HEALTH_INTERVAL_S = 2.0

# Ray Serve's PrefixCacheAffinityRouter sends a request by prefix from a 10 % match.
TEXT_MATCH_THRESHOLD = 0.1
