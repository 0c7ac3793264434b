"""The config room's face: `from src.config import load_config, ...` for the entry points.

    schema.yaml   every key: its type, default, meaning, and whether recipes state it (no recipe)
    schema.py     reads and checks the schema; renders docs/config_reference.md from it
    loader.py     a recipe file + `--key value` overrides -> one checked Config (load_config)
    zoo.py        the model zoo's keys, translated on the way in
    yaml_io.py    reading the yaml files

The recipes are config/*.yaml; config/resnet50_cifar10.yaml is the default one (DEFAULT_CONFIG).
`python -m src.config --run_dir | --reference` is src/config/__main__.py.
"""
from src.config.loader import (
    DEFAULT_CONFIG,
    NON_NEGATIVE_KEYS,
    POSITIVE_KEYS,
    Config,
    check_against_schema,
    check_ranges,
    coerce_value,
    format_help,
    load_config,
    main,
    parse_bool,
    run_dir,
    save_config,
    split_overrides,
    unknown_key_error,
)
from src.config.schema import (
    REPO_ROOT,
    SCHEMA_PATH,
    SchemaKey,
    format_reference,
    read_schema,
    recipe_keys,
)
from src.config.yaml_io import read_yaml, read_yaml_documents

__all__ = [
    "DEFAULT_CONFIG", "NON_NEGATIVE_KEYS", "POSITIVE_KEYS", "REPO_ROOT", "SCHEMA_PATH",
    "Config", "SchemaKey", "check_against_schema", "check_ranges", "coerce_value",
    "format_help", "format_reference", "load_config", "main", "parse_bool", "read_schema", "read_yaml",
    "read_yaml_documents", "recipe_keys", "run_dir", "save_config", "split_overrides", "unknown_key_error",
]
