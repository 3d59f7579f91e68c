"""Simulator tests need matplotlib and tqdm: skipped as a whole, naming the extra."""

import pytest

for _name in ("matplotlib", "tqdm"):
    pytest.importorskip(_name, reason=f"simulator tests need {_name}: pip install -e '.[sim]'")
