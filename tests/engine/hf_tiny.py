"""Tiny random-weight checkpoints of each Hugging Face family, built with `transformers`' own
config and model classes and written with `save_pretrained` (plus a byte-level tokenizer.json),
so the engine loads them through its real loading path. Nothing is downloaded.

Weights are redrawn after construction: `transformers`' init (std 0.02, norms at 1 or 0) gives
almost flat logits and would hide a missing norm offset or a wrong scale. Here projections are
N(0, 1/fan_in), every norm weight is its init plus N(0, 0.1²) (so a +1 offset matters) and every
other 1-D parameter (A_log, dt_bias, D, biases) is perturbed the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def configs() -> dict[str, tuple[Any, Any]]:
    """family -> (config, model class), 4 layers each, every layer kind of the family present."""
    import transformers as T

    return {
        "granite": (
            T.GraniteMoeHybridConfig(
                **COMMON,
                num_hidden_layers=4,
                intermediate_size=32,
                shared_intermediate_size=48,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=[
                    "linear_attention",
                    "full_attention",
                    "linear_attention",
                    "linear_attention",
                ],
                mamba_n_heads=4,
                mamba_n_groups=2,
                mamba_d_state=16,
                mamba_d_head=32,
                mamba_d_conv=4,
                mamba_chunk_size=32,
                embedding_multiplier=2.0,
                residual_multiplier=0.5,
                attention_multiplier=0.15,
                logits_scaling=0.5,
            ),
            T.GraniteMoeHybridForCausalLM,
        ),
        "gemma3": (
            T.Gemma3TextConfig(
                **COMMON,
                num_hidden_layers=4,
                intermediate_size=96,
                head_dim=16,
                sliding_window=24,
                query_pre_attn_scalar=16,
                layer_types=[
                    "sliding_attention",
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                ],
                final_logit_softcapping=30.0,
            ),
            T.Gemma3ForCausalLM,
        ),
        "lfm2": (
            T.Lfm2Config(
                **COMMON,
                num_hidden_layers=4,
                intermediate_size=96,
                block_multiple_of=16,
                conv_L_cache=3,
                layer_types=["conv", "full_attention", "conv", "conv"],
            ),
            T.Lfm2ForCausalLM,
        ),
        "qwen3_next": (
            T.Qwen3NextConfig(
                **COMMON,
                num_hidden_layers=4,
                intermediate_size=96,
                head_dim=16,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
                mlp_only_layers=[1],
            ),
            T.Qwen3NextForCausalLM,
        ),
    }


def _redraw(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                scale = 1.0 if "embed" in name else 1.0 / math.sqrt(fan_in)
                p.copy_(noise * scale)
            else:
                p.add_(0.1 * noise)


def byte_tokenizer_json(path: Path) -> None:
    """A byte-level BPE without merges: ids 0–255 are the bytes, 256 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
    assert set(byte_map.values()) == set(alphabet)
    vocab = {byte_map[b]: b for b in range(256)} | {"<|endoftext|>": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def build(family: str, directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """Write the family's tiny checkpoint to `directory`; return the `transformers` model.
    `overrides` set config attributes first (e.g. a `rope_parameters` of another rope type)."""
    cfg, cls = configs()[family]
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    _redraw(model, seed)
    model.save_pretrained(str(directory))
    byte_tokenizer_json(directory / "tokenizer.json")
    return model


def hf_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """`transformers`' own forward over the whole sequence: logits [L, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
