"""KV event tests need pyzmq and msgspec: skipped as a whole, naming the extra."""

import pytest

for _name in ("zmq", "msgspec"):
    pytest.importorskip(_name, reason=f"KV event tests need {_name}: pip install -e '.[events]'")
