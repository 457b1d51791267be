"""EngineConfig from a TOML file, environment variables and CLI flags.

Precedence, lowest first: the Struct defaults, the TOML file, the environment,
the command line. Every source is read by introspecting the msgspec Structs of
``kvstrata.config``, so a field added there is configurable everywhere at once:

    TOML  [scheduler]\\nmax_num_seqs = 64      top-level keys for top-level fields
    env   KVSTRATA_SCHEDULER__MAX_NUM_SEQS=64   KVSTRATA_EXECUTOR=null
    CLI   --scheduler.max-num-seqs 64           --executor null   (--model PATH)

Errors are ``ConfigError`` (a ValueError) naming the field and the source.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeAlias

import msgspec

from kvstrata.config import EngineConfig

ENV_PREFIX = "KVSTRATA_"
_NONE_WORDS = ("none", "null")

# A field's annotation: a class, a union, a Literal or a generic alias
# (``dict[str, Any]``); read with ``typing.get_args`` and ``msgspec.convert``.
FieldType: TypeAlias = object


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the field."""


def config_fields(root: type = EngineConfig, prefix: str = "") -> dict[str, FieldType]:
    """Every leaf field as ``{"section.field": type}``; nested Structs recurse."""
    out: dict[str, FieldType] = {}
    for f in msgspec.structs.fields(root):
        path = f"{prefix}{f.name}"
        section = _struct_of(f.type)
        if section is not None:
            out.update(config_fields(section, path + "."))
        else:
            out[path] = f.type
    return out


def _struct_of(typ: FieldType) -> type | None:
    """The section Struct of a field typed ``Section`` or ``Section | None``
    (an optional section, like ``kv_transfer``, exists once any of its fields is set)."""
    for t in _union_args(typ):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def parse_value(path: str, raw: object, typ: FieldType, source: str) -> object:
    """Convert one value to the field's type; strings (env, CLI) are parsed."""
    try:
        if isinstance(raw, str):
            if raw.strip().lower() in _NONE_WORDS and _allows_none(typ):
                return None
            if _is_container(typ):
                raw = msgspec.json.decode(raw)
            return msgspec.convert(raw, typ, strict=False)
        return msgspec.convert(raw, typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ConfigError(f"{path}: {e} (from {source}: {raw!r})") from None


def values_from_toml(path: str, fields: Mapping[str, FieldType]) -> dict[str, object]:
    """Read a TOML file (sync: called at start, before any event loop)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    out: dict[str, object] = {}
    for key, raw in _flatten(data):
        if key not in fields:
            raise ConfigError(f"unknown config field {key!r} in {path} (known: {_sections(fields)})")
        out[key] = parse_value(key, raw, fields[key], f"file {path}")
    return out


def values_from_env(env: Mapping[str, str], fields: Mapping[str, FieldType]) -> dict[str, object]:
    """``KVSTRATA_<SECTION>__<FIELD>``; top-level fields as ``KVSTRATA_<FIELD>``.
    A variable with ``__`` that names no field is an error (a typo would
    otherwise be ignored); other KVSTRATA_* variables belong to other tools."""
    out: dict[str, object] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower().replace("__", ".")
        if key in fields:
            out[key] = parse_value(key, raw, fields[key], f"env {name}")
        elif "." in key:
            raise ConfigError(f"unknown config field {key!r} from env {name}")
    return out


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` plus one ``--section.field-name VALUE`` flag per field."""
    g = parser.add_argument_group("engine config (also TOML via --config, env KVSTRATA_<SECTION>__<FIELD>)")
    g.add_argument("--config", metavar="FILE", default=None, help="TOML file with the engine config")
    g.add_argument("--model", dest="cfg:model.model", default=argparse.SUPPRESS, metavar="PATH",
                   help="shortcut for --model.model: a local Hugging Face checkpoint directory, a .gguf "
                        "file, 'smollm2' (SmolLM2-135M-Instruct, the CLI's default) or 'random' (seeded "
                        "random weights, no download)")
    defaults = msgspec.to_builtins(EngineConfig())
    for path, typ in config_fields().items():
        flag = "--" + path.replace("_", "-")
        g.add_argument(flag, dest=f"cfg:{path}", default=argparse.SUPPRESS, metavar="V",
                       help=f"{_type_name(typ)} (default {_lookup(defaults, path)!r})")


def values_from_args(args: argparse.Namespace, fields: Mapping[str, FieldType]) -> dict[str, object]:
    out: dict[str, object] = {}
    for dest, raw in vars(args).items():
        if dest.startswith("cfg:"):
            key = dest[4:]
            out[key] = parse_value(key, raw, fields[key], "flag --" + key.replace("_", "-"))
    return out


def load_config(*, toml_path: str | None = None, env: Mapping[str, str] | None = None,
                args: argparse.Namespace | None = None,
                overrides: Mapping[str, object] | None = None) -> EngineConfig:
    """Merge every source, build the EngineConfig and validate it."""
    fields = config_fields()
    merged: dict[str, object] = {}
    if toml_path is None and args is not None:
        toml_path = getattr(args, "config", None)
    if toml_path:
        merged.update(values_from_toml(toml_path, fields))
    merged.update(values_from_env(os.environ if env is None else env, fields))
    if args is not None:
        merged.update(values_from_args(args, fields))
    for key, raw in (overrides or {}).items():
        if key not in fields:
            raise ConfigError(f"unknown config field {key!r}")
        merged[key] = parse_value(key, raw, fields[key], "override")
    return build_config(merged)


def build_config(flat: Mapping[str, object]) -> EngineConfig:
    nested: dict[str, Any] = {}  # Any: sections (dicts) and leaf values, built by path
    for key, value in flat.items():
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    try:
        cfg = msgspec.convert(nested, EngineConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(str(e)) from None
    try:
        cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def _flatten(data: Mapping[str, object], prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in data.items():
        if isinstance(v, dict) and not _is_leaf_table(prefix + k):
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((prefix + k, v))
    return out


def _is_leaf_table(path: str) -> bool:
    """A TOML table that is a dict-typed field rather than a section."""
    typ = config_fields().get(path)
    return typ is not None and _is_container(typ)


def _is_container(typ: FieldType) -> bool:
    for t in _union_args(typ):
        origin = typing.get_origin(t) or t
        if origin in (list, dict, tuple, set, frozenset):
            return True
    return False


def _allows_none(typ: FieldType) -> bool:
    return any(t is type(None) for t in _union_args(typ))


def _union_args(typ: FieldType) -> tuple[FieldType, ...]:
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        return typing.get_args(typ)
    return (typ,)


def _type_name(typ: FieldType) -> str:
    return getattr(typ, "__name__", None) or str(typ).replace("typing.", "")


def _lookup(tree: Mapping[str, object], path: str) -> object:
    node: object = tree
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _sections(fields: Mapping[str, FieldType]) -> str:
    return ", ".join(sorted({k.split(".")[0] for k in fields}))


REDACTED = "<redacted>"
_SECRET_KEYS = frozenset({"password", "passwd", "secret", "token", "api_key", "access_key", "secret_key",
                          "auth_token", "credentials", "private_key"})


def is_secret_key(key: str) -> bool:
    """A config key whose value is a secret (passwords, tokens, keys)."""
    k = key.lower()
    return k in _SECRET_KEYS or k.endswith(("_password", "_secret", "_token", "_api_key", "_secret_key"))


def redact_secrets(data: Any) -> Any:  # Any: plain config data; the result has its shape
    """``data`` (plain config data: dicts, lists, scalars) with every secret
    value replaced by ``REDACTED``, at any depth (tier options are free-form)."""
    if isinstance(data, Mapping):
        return {k: (REDACTED if isinstance(k, str) and is_secret_key(k) and v is not None else redact_secrets(v))
                for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_secrets(v) for v in data]
    return data
