#!/usr/bin/env bash
# Builds the Python environment in which NVIDIA Dynamo's mocker (a Rust mock engine with vLLM's
# scheduling and prefix caching) replays Mooncake traces offline, for benchmarks/mocker_bench.py
# and tests/sim/test_mocker_bench.py (both run benchmarks/mocker/replay.py with its interpreter).
#
#   bash benchmarks/mocker/setup_venv.sh          # creates .venv-mocker in the repository root
#
# About 250 MiB and a minute; needs the package index. Safe to run again. Settings, all optional:
#   VENV            where to build it       (default: <repository root>/.venv-mocker, which is
#                                            where the benchmark and the test look)
#   PYTHON          interpreter to build it (default: python3.11)
#   DYNAMO_VERSION  ai-dynamo-runtime's version (default: 1.6.1, the version whose replay API
#                   is described below and in replay.py)
#
# What ai-dynamo-runtime 1.6.1 offers, read from the installed package (dynamo/_core.pyi, the
# functions' __text_signature__, and the error messages of its configuration checks):
#   dynamo._core.run_mocker_trace_replay(trace_files, extra_engine_args=None, ...,
#       num_workers=1, replay_concurrency=None, replay_mode="offline", router_mode="round_robin",
#       arrival_speedup_ratio=1.0, trace_block_size=None, trace_format="mooncake", ...,
#       report_jsonl_path=None, ..., capture_per_request=False, ...)
#   returns, offline, an _OfflineReplayResult with .summary (a dict: num_requests,
#   total_input_tokens, prefix_cache_reused_ratio, first_admission_prefix_cache_reused_ratio,
#   duration_ms, wall_time_ms, TTFT/ITL statistics, …) and .per_request (with
#   capture_per_request=True); report_jsonl_path writes the same per-request records as JSON
#   lines (arrival_time_ms, input_length, output_length, reused_input_tokens,
#   admission_history, readmission_count, …; no trace line number, a random uuid instead).
#   extra_engine_args is an engine launch config: {"engine": {...}, "dp_size", "tensor_parallel_size",
#   "num_gpu_blocks_is_explicit", …}; an unknown key is a ValueError listing the allowed ones.
#   Its "engine" table (dynamo._core._normalize_mocker_config prints the defaults) holds
#   backend ("vllm"), num_gpu_blocks (16384), block_size, max_model_len (None), max_num_seqs (256),
#   max_num_batched_tokens (8192), enable_prefix_caching (true), enable_chunked_prefill (true),
#   preemption_mode ("lifo"), speedup_ratio, decode_speedup_ratio, timing_model ("polynomial"), ….
# The `python -m dynamo.replay` front end lives in another package (ai-dynamo), not installed here.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${VENV:-$root/.venv-mocker}
python=${PYTHON:-python3.11}
dynamo_version=${DYNAMO_VERSION:-1.6.1}

# shellcheck source=../make_venv.sh
source "$here/../make_venv.sh"
make_venv "$python" "$venv" "Python >= 3.10"

echo "[1/2] ai-dynamo-runtime $dynamo_version (a Rust runtime with Python bindings; no GPU needed)"
"$venv/bin/python" -m pip install --quiet "ai-dynamo-runtime==$dynamo_version"

echo "[2/2] checking that the mocker's offline trace replay loads"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version

from dynamo._core import _normalize_mocker_config, run_mocker_trace_replay  # noqa: F401

engine = _normalize_mocker_config({"engine": {"block_size": 512}})["engine"]
assert engine["backend"] == "vllm" and engine["enable_prefix_caching"], engine
print(f"mocker venv ready: ai-dynamo-runtime {version('ai-dynamo-runtime')}")
PY
echo "now: .venv/bin/python benchmarks/mocker_bench.py --help"
