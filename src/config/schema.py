"""The schema (src/config/schema.yaml): every key, its type, default, meaning and whether it is a
recipe key; and the configuration reference (docs/config_reference.md) rendered from it.

The schema is no recipe: the recipes are the files in config/, and each states every recipe key
itself (the rule is written at the top of schema.yaml; tests/test_config.py checks it).
"""
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from src.config.yaml_io import load_yaml_file
from src.errors import UserInputError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.yaml")
# A key's declared type -> its Python type (None: any yaml value).
TYPES: Dict[str, Optional[type]] = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "any": None}
_TYPE_WORDS = {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list"}
_FIELDS = ("type", "default", "recipe", "help")


@dataclass(frozen=True)
class SchemaKey:
    """One key of the schema."""
    name: str
    type: str          # one of TYPES
    default: Any
    help: str
    recipe: bool = False


def type_words(kind: Optional[type]) -> str:
    """'an integer', 'a number', ... for error messages."""
    return _TYPE_WORDS.get(kind, getattr(kind, "__name__", "any value"))


def conform(value: Any, kind: Optional[type]) -> Tuple[bool, Any]:
    """(whether `value` is of `kind`, the value as that type): an int stands for a float; None
    (the type `any`) takes every value."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return kind is None or type(value) is kind, value


def read_schema(path: str = SCHEMA_PATH) -> Dict[str, SchemaKey]:
    """The schema's keys in file order; a malformed entry is an error naming the key."""
    documents = load_yaml_file(path)
    entries = documents[0] if len(documents) == 1 else None
    if not isinstance(entries, dict):
        raise UserInputError(f"schema {path} must be one yaml mapping of key: {{type, default, help}}")
    schema: Dict[str, SchemaKey] = {}
    for name, entry in entries.items():
        where = f"schema {path}, key {name}"
        if not isinstance(entry, dict) or not {"type", "default", "help"} <= set(entry) or set(entry) - set(_FIELDS):
            raise UserInputError(f"{where}: expected a mapping of type, default, help (and recipe: true)")
        if entry["type"] not in TYPES:
            raise UserInputError(f"{where}: type {entry['type']!r} is not one of {', '.join(TYPES)}")
        ok, default = conform(entry["default"], TYPES[entry["type"]])
        if not ok:
            raise UserInputError(f"{where}: default {entry['default']!r} is not {type_words(TYPES[entry['type']])}")
        if not isinstance(entry["help"], str) or not entry["help"].strip():
            raise UserInputError(f"{where}: help must say what the key means")
        if not isinstance(entry.get("recipe", False), bool):
            raise UserInputError(f"{where}: recipe must be true or false")
        schema[str(name)] = SchemaKey(str(name), entry["type"], default, entry["help"], entry.get("recipe", False))
    return schema


def schema_defaults(schema: Dict[str, SchemaKey]) -> Dict[str, Any]:
    """Every key's default."""
    return {name: key.default for name, key in schema.items()}


def schema_types(schema: Dict[str, SchemaKey]) -> Dict[str, Any]:
    """Every key's Python type (TYPES)."""
    return {name: TYPES[key.type] for name, key in schema.items()}


def recipe_keys(path: str = SCHEMA_PATH) -> List[str]:
    """The keys every recipe file in config/ states itself."""
    return [name for name, key in read_schema(path).items() if key.recipe]


def _markdown_cell(value: Any) -> str:
    """A default as a Markdown table cell, written as in the yaml files."""
    if value is None:
        text = "null"
    elif isinstance(value, str):
        text = value or '""'
    elif isinstance(value, list):
        text = "[" + ", ".join(str(item) for item in value) + "]"
    else:
        text = str(value)
    return "`" + text.replace("|", "\\|") + "`"


def _markdown_text(text: str) -> str:
    """Plain text for a Markdown table cell: `|` escaped, and `<` outside code spans written as an
    entity so `<run folder>` is not taken for an HTML tag."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;") for i, part in enumerate(parts))


def format_reference(path: str = SCHEMA_PATH) -> str:
    """The configuration reference as Markdown: every key of the schema with its type, default,
    whether recipes state it, and meaning. docs/config_reference.md is this text."""
    schema = read_schema(path)
    name = os.path.relpath(path, REPO_ROOT)
    lines = ["# Configuration reference", "",
             f"Every key a config file or `--key value` may set: its type, its default (from `{name}`, the",
             "schema, which is no recipe) and what it means. Recipe keys (`yes` below) are stated by every",
             "recipe in `config/`, so their defaults here only fill a file that leaves one out (a model-zoo",
             "file, one's own); the other defaults are neutral. How configs are read: "
             "[configuration](configuration.md).",
             "", "<!-- generated by `python -m src.config --reference > docs/config_reference.md`; "
             "tests/test_docs.py fails when it is out of date -->", "",
             "| key | type | default | recipe | meaning |", "|---|---|---|---|---|"]
    for key in schema.values():
        recipe = "yes" if key.recipe else ""
        lines.append(f"| `{key.name}` | {key.type} | {_markdown_cell(key.default)} | {recipe} | "
                     f"{_markdown_text(key.help)} |")
    return "\n".join(lines) + "\n"
