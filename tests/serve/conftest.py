"""Server tests need the server stack and the official openai client: skipped as a whole,
naming the extra."""

import pytest

for _name, _extra in (
    ("fastapi", "server"),
    ("uvicorn", "server"),
    ("prometheus_client", "server"),
    ("httpx", "server"),
    ("rich", "server"),
    ("openai", "test"),
):
    pytest.importorskip(_name, reason=f"server tests need {_name}: pip install -e '.[{_extra}]'")
