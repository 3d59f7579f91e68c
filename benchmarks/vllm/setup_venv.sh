#!/usr/bin/env bash
# Builds the Python environment in which benchmarks/vllm/core_driver.py runs vLLM's own prefix-cache
# code on the CPU: CPU torch, vLLM 0.33.0 installed without its dependencies (its metadata asks for a
# CUDA build of another torch), and only the packages vLLM's v1 core imports, held to the versions
# in constraints.txt beside this script. kvreuse itself is installed into it too (editable, without
# dependencies: its core and simulator need none), so that `kvreuse simulate --engine vllm` runs there:
#   .venv-vllm-anchor/bin/python -m kvreuse simulate --engine vllm --geometry hybrid-dcp4 grid.jsonl --out out
#
#   bash benchmarks/vllm/setup_venv.sh            # creates .venv-vllm-anchor in the repository root
#
# About 3 GiB and a few minutes; needs the package index. Safe to run again (it reinstalls nothing
# that is already there). Settings, all optional:
#   VENV          where to build it       (default: <repository root>/.venv-vllm-anchor, which is
#                                          where benchmarks/core_bench.py --with-anchor looks)
#   PYTHON        interpreter to build it (default: python3.11, the version it was measured with)
#   TORCH_SPEC    how to ask pip for torch (default: torch==2.13.0; pick a CPU-only wheel there)
#   VLLM_VERSION  (default: 0.33.0; another version may need other import-time packages)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${VENV:-$root/.venv-vllm-anchor}
python=${PYTHON:-python3.11}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
vllm_version=${VLLM_VERSION:-0.33.0}
constraints=$here/constraints.txt

# shellcheck source=../make_venv.sh
source "$here/../make_venv.sh"
make_venv "$python" "$venv" "Python 3.11"
# --no-warn-conflicts: vLLM's metadata lists its whole GPU stack, which is deliberately absent
pip=("$venv/bin/python" -m pip install --quiet --no-warn-conflicts --constraint "$constraints")

echo "[1/5] torch ($torch_spec)"
"${pip[@]}" "$torch_spec"

echo "[2/5] vllm $vllm_version, without its dependencies"
"$venv/bin/python" -m pip install --quiet --no-deps "vllm==$vllm_version"

echo "[3/5] what vllm.v1.core and vllm.v1.request import"
# Found by importing the driver's modules until nothing was missing. xxhash is optional: it only
# serves the driver's --hash-fns xxhash.
"${pip[@]}" \
    aiohttp cachetools cbor2 cloudpickle fastapi llguidance msgspec numpy openai \
    openai-harmony packaging partial-json-parser pillow prometheus_client psutil \
    py-cpuinfo pybase64 pydantic pyzmq regex requests transformers urllib3 uvloop \
    xgrammar apache-tvm-ffi xxhash

echo "[4/5] kvreuse (editable, --no-deps: nothing of vLLM's stack is touched)"
"$venv/bin/python" -m pip install --quiet --no-deps -e "$root"

echo "[5/5] checking that the driver's imports load"
"$venv/bin/python" - <<'PY'
import torch
import vllm
from vllm.sampling_params import SamplingParams  # noqa: F401
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: F401
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: F401
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: F401
from vllm.v1.request import Request  # noqa: F401

# benchmarks/sim_anchor_vllm.py drives vLLM's scheduler too
from vllm.config import CacheConfig, SchedulerConfig, VllmConfig  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.outputs import ModelRunnerOutput  # noqa: F401
from vllm.v1.structured_output import StructuredOutputManager  # noqa: F401

# kvreuse simulate --engine vllm builds vLLM's scheduler from a deployment
import kvreuse
from kvreuse.sim.vllm_build import import_vllm

import_vllm()
print(f"vLLM venv ready: vllm {vllm.__version__}, torch {torch.__version__}, kvreuse from {kvreuse.__file__}")
PY
echo "now: .venv/bin/python benchmarks/core_bench.py --json --with-anchor --rounds 3"
