"""Fixtures of the text tests: transformers' own tokenizer for the real
SmolLM2 GGUF (``smollm2_gguf``, from tests/conftest.py), the oracle."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
