#!/usr/bin/env bash
# Builds the Python environment in which kvreuse's fleet runs on Ray Serve
# (src/kvreuse/fleet/ray_serve/app.py; tests/fleet/test_ray.py starts a local Ray cluster with it).
#
#   bash benchmarks/ray/setup_venv.sh             # creates .venv-ray in the repository root
#
# About 1 GiB and a few minutes; needs the package index. Safe to run again. Settings, all
# optional:
#   VENV          where to build it         (default: <repository root>/.venv-ray, which is where
#                                            the test looks)
#   PYTHON        interpreter to build it   (default: python3.11)
#   RAY_VERSION   ray[serve]'s version      (default: 2.60.0, the version the request-router API
#                                            was checked against)
#   EXTRAS        kvreuse's extras          (default: server; add engine for the embedded PyTorch
#                                            model instead of `--fake` replicas)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${VENV:-$root/.venv-ray}
python=${PYTHON:-python3.11}
ray_version=${RAY_VERSION:-2.60.0}
extras=${EXTRAS:-server}

# shellcheck source=../make_venv.sh
source "$here/../make_venv.sh"
make_venv "$python" "$venv" "Python >= 3.11"

echo "[1/3] ray[serve] $ray_version"
"$venv/bin/python" -m pip install --quiet "ray[serve]==$ray_version"

echo "[2/3] kvreuse, editable, with the extras: $extras"
"$venv/bin/python" -m pip install --quiet -e "$root[$extras]"

echo "[3/3] checking that the request-router API and the app load"
"$venv/bin/python" - <<'PY'
from importlib.metadata import version

from ray.serve.request_router import RequestRouter  # noqa: F401

from kvreuse.fleet.ray_serve.app import build_app  # noqa: F401
from kvreuse.fleet.ray_serve.router import KvreuseRequestRouter  # noqa: F401

print(f"Ray venv ready: ray {version('ray')}, kvreuse {version('kvreuse')}")
PY
echo "now: .venv/bin/python -m pytest tests/fleet/test_ray.py"
