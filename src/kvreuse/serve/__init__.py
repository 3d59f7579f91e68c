"""`kvreuse.serve`: an OpenAI-compatible server over the scheduler and the cache, whose usage
blocks report cached tokens exactly (`kvreuse qualify`, in `kvreuse.qualify`, checks them)."""

from kvreuse.serve.backend import Backend, default_backend, fake_backend
from kvreuse.tokenizer import ByteTokenizer

__all__ = ["Backend", "ByteTokenizer", "default_backend", "fake_backend"]
