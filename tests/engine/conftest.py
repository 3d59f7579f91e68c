"""Engine tests need torch, safetensors and tokenizers: skipped as a whole, naming the extra."""

import pytest

for _name in ("torch", "safetensors", "tokenizers"):
    pytest.importorskip(_name, reason=f"engine tests need {_name}: pip install -e '.[engine]'")
