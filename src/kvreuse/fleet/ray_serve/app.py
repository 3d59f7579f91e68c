"""kvreuse's fleet on Ray Serve: N `kvreuse serve` replicas behind an OpenAI-compatible ingress
whose deployment handle routes with `KvreuseRequestRouter` (the fleet's exact scores, through
Ray Serve's public request-router API). docs/fleet-serving.md has the guide.

    python -m kvreuse.fleet.ray_serve.app --replicas 2 [--address auto|ray://HEAD:10001] [--fake]
                                    [--geometry G] [--policy exact] [--port 8000] [-- SERVE…]
    serve run kvreuse.fleet.ray_serve.app:app_builder replicas=2 fake=true geometry=tiny-attention

Without `--address` (and without RAY_ADDRESS) it starts a local Ray cluster; with one it joins
that cluster and deploys there, unchanged. Ray is imported only when an app is built or run:
`import kvreuse.fleet` and this module work without it (the `ray` extra:
benchmarks/ray/setup_venv.sh builds `.venv-ray`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from kvreuse.fleet import DEFAULT_LOAD_WEIGHT, POLICIES, check_policy
from kvreuse.fleet.options import add_load_weight, add_replica_options
from kvreuse.vocab import Help


def build_app(
    replicas: int = 2,
    *,
    geometry: str | None = None,
    fake: bool = False,
    model: str | None = None,
    num_blocks: int | None = None,
    serve_args: Sequence[str] = (),
    policy: str = "exact",
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    replica_cpus: float = 1.0,
) -> Any:
    """The Ray Serve application (`serve.run(build_app(...))`)."""
    from kvreuse.deployment import geometry_toml
    from kvreuse.fleet.ray_serve import deploy as ray_deploy
    from kvreuse.fleet.serving.cli import replica_deployment

    check_policy(policy)
    if not (type(replicas) is int and replicas >= 1):
        raise ValueError(f"replicas must be an integer ≥ 1, got {replicas!r}")
    dep = replica_deployment(geometry, fake, num_blocks)
    args = ["--geometry", geometry] if geometry is not None else []
    args += ["--model", model] if model is not None else []
    args += ["--fake"] if fake else []
    args += ["--num-blocks", str(num_blocks)] if num_blocks is not None else []
    tokenizer = None
    if model is not None:
        from pathlib import Path

        path = Path(model) / "tokenizer.json"
        tokenizer = str(path) if path.is_file() else None
    return ray_deploy.application(
        replicas,
        [*args, *serve_args],
        geometry_toml(dep),
        policy=policy,
        load_weight=load_weight,
        replica_cpus=replica_cpus,
        tokenizer=tokenizer,
    )


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run kvreuse.fleet.ray_serve.app:app_builder key=value …`: replicas, geometry,
    fake, model, num_blocks, policy, load_weight, replica_cpus, serve_args (space-separated)."""
    known = {"replicas", "geometry", "fake", "model", "num_blocks", "policy", "load_weight"}
    known |= {"replica_cpus", "serve_args"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; allowed: {sorted(known)}")
    return build_app(
        int(args.get("replicas", "2")),
        geometry=args.get("geometry"),
        fake=args.get("fake", "false").lower() in ("1", "true", "yes"),
        model=args.get("model"),
        num_blocks=int(args["num_blocks"]) if "num_blocks" in args else None,
        serve_args=args.get("serve_args", "").split(),
        policy=args.get("policy", "exact"),
        load_weight=float(args.get("load_weight", DEFAULT_LOAD_WEIGHT)),
        replica_cpus=float(args.get("replica_cpus", "1")),
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvreuse.fleet.ray_serve.app",
        description="kvreuse replicas on Ray Serve behind an exact cache-aware request router",
        formatter_class=Help,
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--address", default=None, help="Ray cluster (default: a new local one)")
    p.add_argument("--policy", choices=POLICIES, default="exact")
    add_load_weight(p, "prefill tokens one token of a replica's load is worth (exact)")
    add_replica_options(p)
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a new local cluster")
    p.add_argument("--host", default="127.0.0.1", help="where Ray Serve's HTTP proxy listens")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("serve_args", nargs="*", metavar="SERVE_OPTION", help="after --: for serve")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        app = build_app(
            args.replicas,
            geometry=args.geometry,
            fake=args.fake,
            model=args.model,
            num_blocks=args.num_blocks,
            serve_args=args.serve_args,
            policy=args.policy,
            load_weight=args.load_weight,
            replica_cpus=args.replica_cpus,
        )
    except ModuleNotFoundError as exc:
        print(f"kvreuse ray: needs {exc.name}: bash benchmarks/ray/setup_venv.sh", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvreuse ray: {exc}", file=sys.stderr)
        return 2
    import ray  # type: ignore[import-not-found, unused-ignore]
    from ray import serve  # type: ignore[import-not-found, unused-ignore]

    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    ray.init(address=args.address, num_cpus=args.num_cpus if args.address is None else None)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="kvreuse-fleet", route_prefix="/")
        where = f"http://{args.host}:{args.port}"
        print(
            f"kvreuse ray: {args.replicas} replica(s), policy {args.policy}, on {where}/v1",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
