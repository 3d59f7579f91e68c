"""Fleet tests need the router's mirrors, hence pyzmq and msgspec: skipped as a whole, naming
the extra."""

import pytest

for _name in ("zmq", "msgspec"):
    pytest.importorskip(_name, reason=f"fleet tests need {_name}: pip install -e '.[events]'")
