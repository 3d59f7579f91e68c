"""`kvreuse.fleet`: several replicas behind one router, and the fleet simulation.

    query     a request hashed once (`Query`), and what policies read of the fleet
    policy    round-robin, least-loaded, text-prefix, attention-chain, exact
    router    `Router`: a mirror and a load per replica, one policy; `Decision`
    feed      the workload's requests on their way to the router (arrivals, dependencies)
    tier      a shared pool every replica reads (a global cache like Mooncake's store)
    sim       `simulate_fleet`: N simulated replicas on one clock, routed as they stand
    summary   hit rates, load balance, predicted vs delivered, the comparison table
    cli       `kvreuse simulate --replicas N --policy P …` (`add_fleet_arguments`, `run_fleet`)

A live fleet behind one OpenAI endpoint (docs/fleet-serving.md):

    front         the FastAPI front: tokenise as the replicas do, route, forward, record
    dispatch      replicas up and down, retries on a failed connection, loads in flight
    forward       relaying a replica's answer (streams included) and reading its usage
    front_metrics per-replica routed, predicted and delivered cached tokens (Prometheus)
    front_cli     `kvreuse fleet --replicas N` and `kvreuse route --replica URL,EVENTS`
    replicas      starting and stopping local `kvreuse serve` replicas
    ray_app       a Ray Serve application of `kvreuse serve` replicas (`ray` extra), with
    ray_deploy    its deployment, ray_router (Ray's request-router API scoring by `Router`)
    ray_shared    and what the two share

The router and the simulation need the `events` extra (msgspec for the mirrors' wire events;
pyzmq too when a `Subscriber` feeds them). This file imports nothing, so `kvreuse.fleet.cli`
can offer the options without that extra.
"""

POLICIES = ("round-robin", "least-loaded", "text-prefix", "attention-chain", "exact")

# How many prefill tokens one token of a replica's load (queued + running) is worth in the
# routing cost. Dynamo's KV router weighs them equally (1), but running tokens are mostly cached
# context that costs no compute: on the workloads of docs/fleet.md 0.02 reuses within 0.2
# points of ignoring load and spreads the routed tokens more evenly.
DEFAULT_LOAD_WEIGHT = 0.02

# Ray Serve's PrefixCacheAffinityRouter sends a request by prefix from a 10 % match.
TEXT_MATCH_THRESHOLD = 0.1
