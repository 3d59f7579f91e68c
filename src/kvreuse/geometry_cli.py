"""`kvreuse geometry list | show NAME | from-model DIR`: the presets, one of them (or a geometry
file) as a complete TOML file, or the geometry a Hugging Face checkpoint's config.json implies
(`kvreuse.hfconfig`), for `simulate`, `sweep`, `serve` and `qualify`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvreuse.core import GroupGeometry
from kvreuse.deployment import PRESETS, geometry_toml, load_geometry, resolve
from kvreuse.hfconfig import GeometryOptions, model_geometry
from kvreuse.vocab import MAX_SIZE, add_num_blocks, size


def _cmd_geometry(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name in sorted(PRESETS):
            dep = resolve(name)
            groups = ", ".join(_describe(g) for g in dep.cache.geometry.groups)
            spec = dep.sched.num_spec_tokens
            drafts = f"; {spec} drafts per step ({dep.cache.spec_mode})" if spec else ""
            print(f"{name:<20} {dep.cache.num_blocks:>6,} blocks: {groups}{drafts}")
        return 0
    if args.action == "from-model":
        return _geometry_from_model(args)
    if args.name is None:
        print("kvreuse geometry show: name a preset (kvreuse geometry list)", file=sys.stderr)
        return 2
    try:
        dep = resolve(args.name)
    except ValueError as exc:  # GeometryError, or the core's ConfigError for a file
        print(f"kvreuse geometry show: {exc}", file=sys.stderr)
        return 2
    print(f"# {dep.name}: a geometry file to start from (kvreuse simulate FILE WORKLOAD.jsonl)")
    print(geometry_toml(dep), end="")
    return 0


def _geometry_from_model(args: argparse.Namespace) -> int:
    """Print the geometry a Hugging Face checkpoint's config.json implies (checked by loading
    it back), for `simulate`, `sweep`, `serve` and `qualify`."""
    if args.name is None:
        print(
            "kvreuse geometry from-model: name a model directory (with config.json)",
            file=sys.stderr,
        )
        return 2
    opts = GeometryOptions(
        dcp_size=args.dcp,
        block_size=args.block_size,
        state_block_size=args.state_block_size,
        capacity_tokens=None if args.num_blocks else args.capacity_tokens,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    try:
        text = model_geometry(Path(args.name), opts)
        derived = load_geometry(text, args.name)  # the file must load as it is printed
    except ValueError as exc:
        print(f"kvreuse geometry from-model: {exc}", file=sys.stderr)
        return 2
    groups = ", ".join(_describe(g) for g in derived.cache.geometry.groups)
    print(f"# {derived.cache.num_blocks:,} blocks: {groups}")
    print(text, end="")
    return 0


def _describe(g: GroupGeometry) -> str:
    """'full 2048×4 = 8192' or 'sliding 16 (window 48)': a group's kind and page."""
    size = str(g.page_size)
    if g.page_size != g.block_size:
        size = f"{g.block_size}×{g.page_size // g.block_size} = {g.page_size}"
    kind = f"{g.kind} draft" if g.is_draft else g.kind
    extra = f" (window {g.window})" if g.window else f" (chunk {g.chunk})" if g.chunk else ""
    return f"{kind} {size}{extra}"


def add_geometry(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "geometry",
        help="list the presets, or print one as TOML",
        description="`list`: the presets; `show NAME`: a preset (or a geometry file) as a "
        "complete TOML geometry file to start from.",
    )
    p.add_argument(
        "action",
        choices=("list", "show", "from-model"),
        help="list the presets, show one, or derive one from a model directory",
    )
    p.add_argument(
        "name", nargs="?", help="show: a preset name or a .toml file; from-model: a model directory"
    )
    p.add_argument("--dcp", type=int, default=1, help="from-model: DCP ranks (default 1)")
    p.add_argument(
        "--block-size", type=int, default=16, help="from-model: attention local block (16)"
    )
    p.add_argument(
        "--state-block-size",
        type=int,
        default=None,
        help="from-model: the recurrent group's M (default: the attention page)",
    )
    p.add_argument(
        "--capacity-tokens",
        type=size(1, MAX_SIZE),
        default=16384,
        help="from-model: pool for N tokens",
    )
    add_num_blocks(p, "from-model: pool size in blocks")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="from-model: budget")
    p.set_defaults(func=_cmd_geometry)
