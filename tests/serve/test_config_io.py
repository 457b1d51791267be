"""EngineConfig from TOML, env and flags: precedence and errors naming the field."""

import argparse

import pytest

from kvstrata.config import EngineConfig
from kvstrata.config_io import ConfigError, add_config_args, config_fields, load_config


def _args(*argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return p.parse_args(list(argv))


def test_every_struct_field_is_a_flag():
    fields = config_fields()
    assert "scheduler.max_num_seqs" in fields and "cache.block_size" in fields and "executor" in fields
    p = argparse.ArgumentParser()
    add_config_args(p)
    flags = {s for a in p._actions for s in a.option_strings}
    assert {"--" + k.replace("_", "-") for k in fields} <= flags


def test_defaults_with_no_sources():
    assert load_config(env={}) == EngineConfig()


def test_precedence_file_then_env_then_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('executor = "null"\n[scheduler]\nmax_num_seqs = 8\nmax_num_batched_tokens = 64\n'
                 '[cache]\nblock_size = 32\n')
    env = {"KVSTRATA_SCHEDULER__MAX_NUM_SEQS": "16", "KVSTRATA_MODEL__MAX_MODEL_LEN": "none",
           "KVSTRATA_REQUIRE_REDIS": "1"}
    cfg = load_config(args=_args("--config", str(f), "--scheduler.max-num-seqs", "4",
                                 "--model", "/ckpt", "--cache.enable-prefix-caching", "false"), env=env)
    assert cfg.executor == "null"
    assert cfg.scheduler.max_num_seqs == 4            # flag beats env beats file
    assert cfg.scheduler.max_num_batched_tokens == 64  # file
    assert cfg.cache.block_size == 32
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.model.model == "/ckpt"
    assert cfg.model.max_model_len is None


@pytest.mark.parametrize("env, needle", [
    ({"KVSTRATA_CACHE__BLOCK_SIZE": "big"}, "cache.block_size"),
    ({"KVSTRATA_CACHE__BLOK_SIZE": "16"}, "cache.blok_size"),
    ({"KVSTRATA_SCHEDULER__MAX_NUM_SEQS": "0"}, "scheduler.max_num_seqs"),
    ({"KVSTRATA_SCHEDULER__POLICY": "lifo"}, "scheduler.policy"),
    ({"KVSTRATA_EXECUTOR": "gpu"}, "executor"),
])
def test_env_errors_name_the_field(env, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(env=env)


def test_file_errors_name_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[scheduler]\nmax_num_seqs = \"many\"\n")
    with pytest.raises(ConfigError, match=r"scheduler\.max_num_seqs"):
        load_config(toml_path=str(f), env={})
    f.write_text("[schedular]\nmax_num_seqs = 3\n")
    with pytest.raises(ConfigError, match=r"schedular\.max_num_seqs"):
        load_config(toml_path=str(f), env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(toml_path=str(tmp_path / "missing.toml"), env={})


def test_flag_error_names_the_flag():
    with pytest.raises(ConfigError, match=r"cache\.num_blocks.*--cache\.num-blocks"):
        load_config(args=_args("--cache.num-blocks", "x"), env={})


def test_optional_kv_transfer_section_from_toml_env_and_flags(tmp_path):
    """``kv_transfer`` is None until one of its fields is set, from any source."""
    assert load_config(env={}).kv_transfer is None
    f = tmp_path / "tiers.toml"
    f.write_text(
        '[kv_transfer]\nconnector = "offload"\n[kv_transfer.options]\nchunk_size = 64\n'
        '[[kv_transfer.options.store.tiers]]\ntype = "disk"\noptions = { path = "/x", capacity_bytes = 1024 }\n'
    )
    cfg = load_config(toml_path=str(f), env={"KVSTRATA_KV_TRANSFER__ROLE": "producer"})
    assert cfg.kv_transfer.connector == "offload" and cfg.kv_transfer.role == "producer"
    assert cfg.kv_transfer.options == {
        "chunk_size": 64, "store": {"tiers": [{"type": "disk", "options": {"path": "/x", "capacity_bytes": 1024}}]}
    }
    with pytest.raises(ConfigError, match="kv_transfer.role"):
        load_config(env={"KVSTRATA_KV_TRANSFER__ROLE": "sideways"})


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto"])
def test_a_device_or_a_gpu_by_number(device):
    assert load_config(args=_args("--device", device), env={}).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cuda:1:2", "mps"])
def test_another_device_is_named(device):
    with pytest.raises(ConfigError, match=r"device.*'cuda:N'"):
        load_config(args=_args("--device", device), env={})
