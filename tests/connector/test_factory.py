"""KVConnectorFactory: built-ins by name imported lazily, user connectors by
dotted path, clear errors naming the field."""

from __future__ import annotations

import pytest
from conn_helpers import RecordingConnector

from kvstrata.connector import KVConnectorFactory, KVTransferConfig, NoOpConnector


def test_builtins_are_registered_but_not_imported():
    f = KVConnectorFactory()
    assert f.names() == ["multi", "noop", "offload"]
    assert not any(f.is_loaded(n) for n in f.names())
    assert f.resolve("noop") is NoOpConnector
    assert f.is_loaded("noop") and not f.is_loaded("offload")


async def test_open_by_dotted_path_both_spellings():
    f = KVConnectorFactory()
    before = RecordingConnector.opened
    for path in ("conn_helpers.RecordingConnector", "conn_helpers:RecordingConnector"):
        c = await f.open(KVTransferConfig(connector=path, options={"x": 1}))
        assert isinstance(c, RecordingConnector) and c.config.options == {"x": 1}
    assert RecordingConnector.opened == before + 2


async def test_register_a_name_for_a_path_then_a_class():
    f = KVConnectorFactory(builtins=False)
    f.register("mine", "conn_helpers:RecordingConnector")
    assert not f.is_loaded("mine")
    assert isinstance(await f.open(KVTransferConfig(connector="mine")), RecordingConnector)
    assert f.is_loaded("mine")
    f.register("noop2", NoOpConnector)
    assert f.resolve("noop2") is NoOpConnector


def test_unknown_name_names_the_field():
    with pytest.raises(ValueError, match=r"kv_transfer.connector 'nope' is not one of \['multi', 'noop', 'offload'\]"):
        KVConnectorFactory().resolve("nope")


def test_unloadable_path_names_the_field():
    with pytest.raises(ValueError, match=r"kv_transfer.connector: cannot load 'no_such_mod.X'"):
        KVConnectorFactory().resolve("no_such_mod.X")


def test_a_class_without_the_protocol_is_refused():
    with pytest.raises(TypeError, match=r"does not implement KVConnector; missing \['flush', 'scheduler_side'"):
        KVConnectorFactory().resolve("conn_helpers.NotAConnector")


@pytest.mark.parametrize("name", ["", "a.b", "a:b"])
def test_register_rejects_bad_names(name):
    with pytest.raises(ValueError, match="connector name must be non-empty"):
        KVConnectorFactory().register(name, NoOpConnector)


async def test_bad_config_fields_are_named():
    f = KVConnectorFactory()
    with pytest.raises(ValueError, match=r"kv_transfer.role must be one of"):
        await f.open(KVTransferConfig(connector="noop", role="sideways"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"kv_transfer.options: Object contains unknown field `bogus`"):
        await f.open(KVTransferConfig(connector="offload", options={"bogus": 1}))
    with pytest.raises(ValueError, match=r"kv_transfer.options.chunk_size must be an integer >= 1"):
        await f.open(KVTransferConfig(connector="offload", options={"chunk_size": 0}))
    with pytest.raises(ValueError, match=r"kv_transfer.options.connectors must be a non-empty list"):
        await f.open(KVTransferConfig(connector="multi", options={}))
