"""Tokenizers: bytes by default (no download), or an HF `tokenizer.json` via `tokenizers`.

Torch-free, so the server's fake backend shares them with the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0–255; id 256 is end-of-sequence. Ids ≥ 256 decode to nothing."""

    vocab_size = 257
    eos_token_id: int | None = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`); eos is looked up among common names."""

    EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for bad files
            raise ValueError(f"{path}: not a valid tokenizer.json ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size()
        ids = (self._tok.token_to_id(n) for n in self.EOS_NAMES)
        self.eos_token_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))
