"""`kvreuse.engine`: the PyTorch reference engine (the only layer that imports torch).

A tiny decoder (full / sliding attention, a gated linear recurrence, an EAGLE-style draft head)
run over paged KV whose block ids come from the core's step plans, with DCP simulated as
interleaved shares merged by log-sum-exp. `LLM` is the offline API; `ModelRunner` is the engine
callable a `kvreuse.sched.Scheduler` drives.
"""

from kvreuse.engine.checkpoint import load_model, save_model
from kvreuse.engine.config import ModelConfig
from kvreuse.engine.llm import LLM, RequestOutput, default_model_config
from kvreuse.engine.model import DenseContext, TinyModel
from kvreuse.engine.paged import PagedCache
from kvreuse.engine.runner import ModelRunner, ngram_propose
from kvreuse.engine.sampling import SamplingParams
from kvreuse.tokenizer import ByteTokenizer, HFTokenizer

__all__ = [
    "LLM",
    "ByteTokenizer",
    "DenseContext",
    "HFTokenizer",
    "ModelConfig",
    "ModelRunner",
    "PagedCache",
    "RequestOutput",
    "SamplingParams",
    "TinyModel",
    "default_model_config",
    "load_model",
    "ngram_propose",
    "save_model",
]
