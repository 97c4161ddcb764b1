"""Offline tokenizers that Zephon can call.

Zephon's ``tokenize()`` silently falls back to a Python-``hash()`` tokenizer, whose ids differ between
processes, when it is given no tokenizer. Every pipeline in zephon-ray is built through
:func:`build_tokenizer`, which only returns one of the two deterministic tokenizers below and raises for
anything else, so that fallback is unreachable.

Usage: a recipe's ``tokenizer`` is ``"bytes"`` (:class:`ByteTokenizer`) or a path to a HF ``tokenizer.json``
(:class:`TokenizerFile`); ``build_tokenizer(spec)`` builds it and ``tokenizer_identity(spec)`` is its content hash
for the fingerprint. Both are picklable, importable objects with the HF-like call Zephon expects:
``tok(texts, add_special_tokens=False, ...) -> {"input_ids": [np.ndarray, ...]}`` plus
``bos_token_id``, ``eos_token_id``, ``pad_token_id`` and ``name_or_path``.

Guarantee: the same text gives the same ids in every process. Limits: only these two kinds; a ``tokenizer.json``
needs BOS, EOS and PAD tokens (named in a ``tokenizer_config.json`` beside it, else ``<|bos|>``, ``<|eos|>``,
``<|pad|>`` in its vocab).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

BYTES = "bytes"
BYTES_IDENTITY = "bytes/v1"
DEFAULT_SPECIAL_TOKENS = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS=256, EOS=257, PAD=258. Vocabulary size 259."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    name_or_path = BYTES

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    @staticmethod
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TokenizerFile:
    """A HF ``tokenizers`` ``tokenizer.json`` (the file TorchTitan reads from ``hf_assets_path``).

    BOS/EOS/PAD are read from a ``tokenizer_config.json`` beside the file when present (keys ``bos_token``,
    ``eos_token``, ``pad_token``), else the tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` must be in the vocab.
    """

    def __init__(self, path: str | Path) -> None:
        self.name_or_path = str(path)
        self._tok: Any = None
        tok = self._tokenizer()
        names = _special_token_names(Path(path))
        ids = {}
        for role, token in names.items():
            tid = tok.token_to_id(token)
            if tid is None:
                raise ValueError(f"{path}: special token {token!r} ({role}) is not in the vocabulary")
            ids[role] = tid
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids["bos"], ids["eos"], ids["pad"]
        self.vocab_size = tok.get_vocab_size()

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.name_or_path)
        return self._tok

    def __getstate__(self) -> dict[str, Any]:
        # Rebuilt from the file in the worker rather than pickled: the Rust object is not picklable.
        return {k: v for k, v in self.__dict__.items() if k != "_tok"} | {"_tok": None}

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        tok = self._tokenizer()
        if isinstance(texts, str):
            return {"input_ids": np.asarray(tok.encode(texts, add_special_tokens=False).ids, dtype=np.int64)}
        encs = tok.encode_batch(list(texts), add_special_tokens=False)
        return {"input_ids": [np.asarray(e.ids, dtype=np.int64) for e in encs]}

    def decode(self, ids: Any) -> str:
        return self._tokenizer().decode([int(i) for i in ids], skip_special_tokens=False)


def _special_token_names(path: Path) -> dict[str, str]:
    names = dict(DEFAULT_SPECIAL_TOKENS)
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        for role in names:
            value = data.get(f"{role}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                names[role] = value
    return names


def validate_tokenizer_spec(spec: str) -> None:
    """Raise ValueError unless ``spec`` is ``"bytes"`` or a readable ``tokenizer.json`` with special tokens."""
    if spec == BYTES:
        return
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f'tokenizer file not found: {path} (use "bytes" or a path to a tokenizer.json)')
    try:
        TokenizerFile(path)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception types for malformed files
        raise ValueError(f"cannot load tokenizer file {path}: {exc}") from None


def build_tokenizer(spec: str) -> ByteTokenizer | TokenizerFile:
    if spec == BYTES:
        return ByteTokenizer()
    if not spec:
        raise ValueError("a tokenizer is required; zephon-ray never uses Zephon's hash() fallback")
    return TokenizerFile(spec)


def tokenizer_identity(spec: str) -> str:
    """A stable identity for the fingerprint: the content hash of the tokenizer file(s), not their path."""
    if spec == BYTES:
        return BYTES_IDENTITY
    path = Path(spec)
    h = hashlib.sha256(path.read_bytes())
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        h.update(config.read_bytes())
    return f"tokenizers-json/sha256:{h.hexdigest()}"
