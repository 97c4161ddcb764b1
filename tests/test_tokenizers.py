"""Offline tokenizers: deterministic, picklable, and Zephon's hash() fallback is unreachable."""

from __future__ import annotations

import pickle

import numpy as np
import oracle
import pytest
from conftest import RECIPES

from zephon_ray.tokenizers import ByteTokenizer, TokenizerFile, build_tokenizer, tokenizer_identity

TOKENIZER_JSON = RECIPES / "tokenizer" / "tokenizer.json"


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "déjà vu — λ"
    ids = tok([text])["input_ids"][0]
    assert ids.dtype == np.int64 and ids.max() < 256
    assert tok.decode(ids) == text
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}


def test_tokenizer_file_encodes_and_survives_pickle():
    tok = TokenizerFile(TOKENIZER_JSON)
    ids = tok(["def f(x):\n    return x"])["input_ids"][0]
    clone = pickle.loads(pickle.dumps(tok))
    assert np.array_equal(clone(["def f(x):\n    return x"])["input_ids"][0], ids)
    assert tok.decode(ids) == "def f(x):\n    return x"
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_identity_is_content_not_path(tmp_path):
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(TOKENIZER_JSON.read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((TOKENIZER_JSON.parent / "tokenizer_config.json").read_bytes())
    assert tokenizer_identity(str(copy)) == tokenizer_identity(str(TOKENIZER_JSON))
    assert tokenizer_identity("bytes") == "bytes/v1"


def test_no_tokenizer_never_reaches_zephons_hash_fallback():
    with pytest.raises(ValueError, match="hash"):
        build_tokenizer("")


def test_missing_special_token_is_named(tmp_path):
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(TOKENIZER_JSON.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|nope|>"}')
    with pytest.raises(ValueError, match="<\\|nope\\|>"):
        TokenizerFile(copy)


def test_pipeline_tokenizer_is_ours(tiny_recipe):
    """The built pipeline's tokenize stage holds our tokenizer object, not Zephon's fallback."""
    from zephon_ray.pipeline import build_pipeline

    pipeline = build_pipeline(tiny_recipe)
    found = [op for op in _walk(pipeline) if isinstance(op, ByteTokenizer)]
    assert found, "no ByteTokenizer found in the pipeline's operators"


def _walk(obj, depth=0, seen=None):
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    yield obj
    children = []
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    for child in children:
        yield from _walk(child, depth + 1, seen)


def test_tokenizers_agree_with_the_oracles_own():
    """The oracle's tokenizers (tests/oracle.py: written from the documented contract, no zephon_ray import) give
    the same ids and special tokens as ours, on multi-byte text (and a lone surrogate, which JSON can carry as an
    escape, for the byte tokenizer: replaced by "?"; the ``tokenizers`` library refuses such a string)."""
    texts = ["déjà vu — λ 🙂", "def f(x):\n    return x  # \t tabs", "", "a" * 5000]
    for ours, theirs, extra in (
        (ByteTokenizer(), oracle.OracleByteTokenizer(), ["bad \udcff surrogate"]),
        (TokenizerFile(TOKENIZER_JSON), oracle.OracleJsonTokenizer(TOKENIZER_JSON), []),
    ):
        texts = texts[:4] + extra
        assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
            theirs.bos_token_id,
            theirs.eos_token_id,
            theirs.pad_token_id,
        )
        a, b = ours(texts, add_special_tokens=False)["input_ids"], theirs(texts, add_special_tokens=False)["input_ids"]
        assert len(a) == len(b) == len(texts)
        for x, y in zip(a, b):
            assert np.array_equal(x, y) and x.dtype == y.dtype == np.int64
        clone = pickle.loads(pickle.dumps(theirs))  # picklable and importable, as Zephon's runners need
        assert np.array_equal(clone(texts[:1])["input_ids"][0], b[0])
