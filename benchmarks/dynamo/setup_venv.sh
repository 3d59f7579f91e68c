#!/usr/bin/env bash
# Builds the Python environment in which NVIDIA Dynamo's standalone KV indexer runs, unmodified,
# as a consumer of a kvreuse replica's KV events (tests/events/test_dynamo_indexer.py and
# benchmarks/dynamo_prediction.py start it as `python -m dynamo.indexer`).
#
#   bash benchmarks/dynamo/setup_venv.sh          # creates .venv-dynamo in the repository root
#
# About 250 MiB and a minute; needs the package index. Safe to run again. Settings, all optional:
#   VENV            where to build it       (default: <repository root>/.venv-dynamo, which is
#                                            where the test and the benchmark look)
#   PYTHON          interpreter to build it (default: python3.11)
#   DYNAMO_VERSION  ai-dynamo-runtime's version (default: 1.6.1, the version the indexer's
#                   command line and HTTP API were checked against)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${VENV:-$root/.venv-dynamo}
python=${PYTHON:-python3.11}
dynamo_version=${DYNAMO_VERSION:-1.6.1}

# shellcheck source=../make_venv.sh
source "$here/../make_venv.sh"
make_venv "$python" "$venv" "Python >= 3.10"

echo "[1/2] ai-dynamo-runtime $dynamo_version (a Rust runtime with Python bindings; no GPU needed)"
"$venv/bin/python" -m pip install --quiet "ai-dynamo-runtime==$dynamo_version"

echo "[2/2] checking that the standalone indexer loads"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version

from dynamo.indexer.main import main  # noqa: F401
from dynamo.llm import run_kv_indexer  # noqa: F401

print(f"Dynamo venv ready: ai-dynamo-runtime {version('ai-dynamo-runtime')}")
PY
echo "now: .venv/bin/python -m pytest tests/events/test_dynamo_indexer.py"
