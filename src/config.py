"""Config loading: one yaml file plus `--key value` overrides, type-checked, into a plain object.

The yaml file is the schema: every key a run may set is in it, and its value fixes the type.
Nothing here runs at import; entry points call `load_config(argv)` once and pass values down.
"""
import difflib
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from src.errors import UserInputError
from src.files import write_atomic
from src.migration.zoo_config import (
    IGNORED_KEYS,
    RENAMED_KEYS,
    check_optimizer_available,
    ignored_line,
    refuse_if_active,
    translate_zoo_keys,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "config", "resnet50_cifar10.yaml")
# The schema: every key a run may set, its type and its default. A config file sets any subset of
# these keys (with values of the same types); the keys it leaves out take this file's values.
REFERENCE_CONFIG = DEFAULT_CONFIG
# Keys that must be > 0 (checked at load, not hours into a run).
POSITIVE_KEYS = ("batch_size", "epoch_size", "class_num", "train_image_size", "eval_image_size",
                 "num_parallel_workers", "save_checkpoint_epochs", "keep_checkpoint_max", "log_interval",
                 "eval_interval", "profile_steps", "device_num", "loss_scale", "nan_patience",
                 "grad_accumulation_steps", "model_ema_steps", "lr_end_epoch", "damping_init", "frequency")
NON_NEGATIVE_KEYS = ("warmup_epochs", "lr_init", "lr_max", "lr_end", "weight_decay", "momentum",
                     "save_checkpoint_steps", "label_smooth_factor", "eval_start_epoch", "device_id",
                     "eval_resize_size", "norm_weight_decay", "bias_weight_decay", "clip_grad_norm",
                     "lars_coefficient", "lars_epsilon", "lr_decay", "damping_decay")
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class Config:
    """Attribute access over the resolved key/value pairs; a missing key is a clear error."""

    def __init__(self, values: Dict[str, Any], source: str = "<dict>", notes: Sequence[str] = ()):
        self.__dict__["_values"] = dict(values)
        self.__dict__["_source"] = source
        self.__dict__["_notes"] = list(notes)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") and key.endswith("__"):  # copy/pickle protocol, not config keys
            raise AttributeError(key)
        values = self.__dict__["_values"]
        if key not in values:
            raise UserInputError(f"config {self.__dict__['_source']} has no key '{key}'; "
                                 f"add it (the files in config/ list every key)")
        return values[key]

    def __setattr__(self, key: str, value: Any) -> None:
        self.__dict__["_values"][key] = value

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def to_dict(self) -> Dict[str, Any]:
        return dict(self._values)

    @property
    def source(self) -> str:
        return self.__dict__["_source"]

    @property
    def notes(self) -> List[str]:
        """Lines for the run's log about how the config was read (e.g. model-zoo keys ignored);
        loading prints nothing itself, so `python -m src.config --run_dir` stays one line."""
        return list(self.__dict__["_notes"])


def parse_bool(text: str, key: str) -> bool:
    """'True'/'false'/'1'/'no'... to a bool; anything else is an error naming the key."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise UserInputError(f"--{key} expects a bool (true/false), got '{text}'")


def coerce_value(key: str, text: str, reference: Any) -> Any:
    """Turn a command-line string into the type of the yaml value `reference`."""
    if isinstance(reference, bool):
        return parse_bool(text, key)
    if isinstance(reference, int):
        try:
            return int(text)
        except ValueError:
            raise UserInputError(f"--{key} expects an integer, got '{text}'") from None
    if isinstance(reference, float):
        try:
            return float(text)
        except ValueError:
            raise UserInputError(f"--{key} expects a number, got '{text}'") from None
    if isinstance(reference, str):
        return text
    if isinstance(reference, list):
        return _parse_list(key, text)
    # A null default accepts any yaml scalar or list.
    return _safe_yaml(key, text)


def _safe_yaml(key: str, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        raise UserInputError(f"--{key}: cannot parse '{text}'") from None


def _parse_list(key: str, text: str) -> List[Any]:
    stripped = text.strip()
    if stripped.startswith("["):
        value = _safe_yaml(key, stripped)
    elif stripped == "":
        value = []
    else:
        value = [_safe_yaml(key, item) for item in stripped.split(",")]
    if not isinstance(value, list):
        raise UserInputError(f"--{key} expects a list like '[1, 2]' or '1,2', got '{text}'")
    return value


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 1e-4 as a string; read it as the float every Python user means."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789."))


def read_yaml_documents(path: str) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Read a config file: its first yaml document is the values; a second one, as in the model
    zoo's files, maps keys to help texts. A missing or malformed file is a clear error."""
    if not os.path.isfile(path):
        raise UserInputError(f"config file not found: {path} (pass --config_path config/<name>.yaml)")
    try:
        with open(path, encoding="utf-8") as handle:
            documents = list(yaml.load_all(handle, Loader=_Loader))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise UserInputError(f"config file {path} is not valid yaml{line}; fix its syntax") from None
    values = documents[0] if documents else None
    if not isinstance(values, dict):
        raise UserInputError(f"config file {path} must be a mapping of key: value")
    if len(documents) > 2:
        raise UserInputError(f"config file {path} has {len(documents)} yaml documents; expected the values "
                             f"and at most one of help texts")
    helps = documents[1] if len(documents) == 2 else {}
    if not isinstance(helps, dict):
        raise UserInputError(f"config file {path}: its second yaml document must map keys to help texts")
    return values, {str(key): str(text) for key, text in helps.items()}


def read_yaml(path: str) -> Dict[str, Any]:
    """Read a config file's values (its first yaml document)."""
    return read_yaml_documents(path)[0]


def _type_name(value: Any) -> str:
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__)


def check_against_reference(values: Dict[str, Any], path: str, reference_path: Optional[str]) -> Dict[str, Any]:
    """The reference config's keys and no other, with values of the reference's types; keys the
    file leaves out take the reference's values.

    A saved run config (config.yaml) also holds `config_path`, which is dropped here."""
    values = {key: value for key, value in values.items() if key != "config_path"}
    reference = values if reference_path is None else read_yaml(reference_path)
    for key in values:
        if key not in reference:
            raise unknown_key_error(key, reference.keys(), path)
    checked = {}
    for key, value in {**reference, **values}.items():
        expected = reference[key]
        if isinstance(expected, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if expected is not None and type(value) is not type(expected):
            raise UserInputError(f"config file {path}: {key} must be {_type_name(expected)}, got {value!r}")
        checked[key] = value
    return checked


def check_ranges(values: Dict[str, Any], where: str) -> None:
    """Numbers that must be positive or non-negative, checked before any work."""
    for key in POSITIVE_KEYS:
        if key in values and values[key] <= 0:
            raise UserInputError(f"{key} must be > 0, got {values[key]} ({where})")
    for key in NON_NEGATIVE_KEYS:
        if key in values and values[key] < 0:
            raise UserInputError(f"{key} must be >= 0, got {values[key]} ({where})")


def split_overrides(argv: Sequence[str]) -> List[Tuple[str, Optional[str]]]:
    """['--a', '1', '--b=2', '--flag'] -> [('a', '1'), ('b', '2'), ('flag', None)]."""
    pairs: List[Tuple[str, Optional[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise UserInputError(f"unexpected argument '{token}'; options look like --key value")
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            pairs.append((key, value))
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((key, argv[i + 1]))
            i += 2
        else:
            pairs.append((key, None))
            i += 1
    return pairs


def unknown_key_error(key: str, known: Sequence[str], where: str) -> UserInputError:
    """An error for an unknown key that suggests the closest known one."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see --help for the keys"
    return UserInputError(f"unknown config key '{key}' in {where}{hint}")


def format_help(values: Dict[str, Any], path: str, prog: str, helps: Optional[Dict[str, str]] = None) -> str:
    """A --help text listing every key with its type and value from the file, and the file's help
    text for the key where it has one (the model zoo's second yaml document)."""
    helps = helps or {}
    lines = [f"usage: {prog} [--config_path FILE] [--KEY VALUE ...]",
             "", f"Keys and defaults from {path} (override any with --KEY VALUE):"]
    for key, value in values.items():
        kind = "any" if value is None else type(value).__name__
        line = f"  --{key:<28} {kind:<6} {value!r}"
        lines.append(f"{line:<60} {helps[key]}" if key in helps else line)
    return "\n".join(lines)


def load_config(argv: Optional[Sequence[str]] = None, default_path: str = DEFAULT_CONFIG,
                prog: str = "train.py", reference_path: Optional[str] = REFERENCE_CONFIG) -> Config:
    """Load `--config_path` (or `default_path`), check it against `reference_path` (None: the file
    is its own schema), and apply `--key value` overrides from argv.

    Model-zoo config files and command lines work as they are: their keys are translated
    (src/migration/zoo_config.py); the keys with no effect here are named in `Config.notes`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = split_overrides([a for a in argv if a not in ("-h", "--help")])
    path = default_path
    rest = []
    for key, value in pairs:
        if key == "config_path":
            if value is None:
                raise UserInputError("--config_path needs a file path")
            path = value
        else:
            rest.append((key, value))
    file_values, helps = read_yaml_documents(path)
    if reference_path is None:
        schema = list(file_values) + ["config_path"]
    else:
        reference_values, reference_helps = read_yaml_documents(reference_path)
        schema = list(reference_values) + ["config_path"]
        # the schema's meaning of a key, unless the file gives its own (as the model zoo's files do)
        helps = {**reference_helps, **helps}
    file_values, ignored = translate_zoo_keys(file_values, schema, f"config file {path}")
    values = check_against_reference(file_values, path, reference_path)
    if "-h" in argv or "--help" in argv:
        print(format_help(values, path, prog, helps))
        sys.exit(0)
    for key, value in rest:
        if key not in values and key in RENAMED_KEYS:
            key = RENAMED_KEYS[key]
        if key not in values and key in IGNORED_KEYS:
            refuse_if_active(key, _zoo_cli_value(key, value), "the command line")
            ignored += [key] if key not in ignored else []
            continue
        if key not in values:
            raise unknown_key_error(key, values.keys(), "the command line")
        reference = values[key]
        if value is None:
            if not isinstance(reference, bool):
                raise UserInputError(f"--{key} needs a value")
            values[key] = True
        else:
            values[key] = coerce_value(key, value, reference)
    check_ranges(values, f"{path} and the command line")
    check_optimizer_available(values.get("optimizer", ""), schema)
    values["config_path"] = path
    notes = [line for line in [ignored_line(ignored, path)] if line]
    return Config(values, source=path, notes=notes)


def _zoo_cli_value(key: str, text: Optional[str]) -> Any:
    """A zoo key's command-line value, read as yaml ('True' -> True) so its check sees a value."""
    if text is None:
        return True
    return _safe_yaml(key, text)


def run_dir(cfg: Config) -> str:
    """The run folder: output_dir/<net_name>/<dataset>."""
    return os.path.join(cfg.output_dir, cfg.net_name, cfg.dataset)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as yaml (atomically)."""
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


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


def format_reference(path: str = REFERENCE_CONFIG) -> str:
    """The configuration reference as Markdown: every key of the schema with its type, default and
    meaning (the schema's second yaml document). docs/config_reference.md is this text."""
    values, helps = read_yaml_documents(path)
    missing = [key for key in values if not helps.get(key)]
    if missing:
        raise UserInputError(f"{path}: no meaning for {', '.join(missing)}; add each to its second yaml document")
    name = os.path.relpath(path, REPO_ROOT)
    lines = ["# Configuration reference", "",
             f"Every key a config file or `--key value` may set: its type, its default (from `{name}`, the",
             "schema) and what it means. How configs are read: [configuration](configuration.md).",
             "", "<!-- generated by `python -m src.config --reference > docs/config_reference.md`; "
             "tests/test_docs.py fails when it is out of date -->", "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, value in values.items():
        kind = "any" if value is None else type(value).__name__
        meaning = _markdown_text(helps[key])
        lines.append(f"| `{key}` | {kind} | {_markdown_cell(value)} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m src.config --run_dir [--config_path F --key v ...]` prints the run folder;
    `--reference` prints the configuration reference (Markdown) of the schema."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--reference"]:
        print(format_reference(), end="")
        return 0
    if "--run_dir" in argv:
        argv.remove("--run_dir")
        print(run_dir(load_config(argv)))
        return 0
    print(yaml.safe_dump(load_config(argv).to_dict(), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    from src.errors import run_cli
    run_cli(main)
