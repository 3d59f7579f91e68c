"""`kvreuse.serve`: an OpenAI-compatible server over the scheduler and the cache (issue 5),
and `kvreuse qualify`, which checks a server's cached-token accounting end to end."""

from kvreuse.serve.backend import (
    Backend,
    ByteTokenizer,
    ContentEngine,
    default_backend,
    fake_backend,
)

__all__ = ["Backend", "ByteTokenizer", "ContentEngine", "default_backend", "fake_backend"]
