"""Config loading: one recipe file plus `--key value` overrides, checked against the schema, into a
plain object.

The schema (src/config/schema.yaml, read by src/config/schema.py) lists every key a run may set, its
type and default; a recipe (a file in config/, a model-zoo file, one's own) sets any subset of them.
Model-zoo keys are translated on the way in (src/config/zoo.py). Nothing here runs at import; entry
points call `load_config(argv)` once and pass values down.
"""
import difflib
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from src.config.schema import (
    REPO_ROOT,
    SCHEMA_PATH,
    conform,
    format_reference,
    read_schema,
    schema_defaults,
    schema_types,
    type_words,
)
from src.config.yaml_io import read_yaml_documents, safe_yaml
from src.config.zoo import (
    IGNORED_KEYS,
    RENAMED_KEYS,
    check_optimizer_available,
    ignored_line,
    refuse_if_active,
    translate_zoo_keys,
)
from src.errors import UserInputError
from src.files import write_atomic

# The default recipe of train.py, eval.py and export.py (and fine_tune.py) without --config_path.
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "config", "resnet50_cifar10.yaml")
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
                                 f"add it (src/config/schema.yaml lists every key)")
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
    return safe_yaml(key, text)


def _parse_list(key: str, text: str) -> List[Any]:
    stripped = text.strip()
    if stripped.startswith("["):
        value = safe_yaml(key, stripped)
    elif stripped == "":
        value = []
    else:
        value = [safe_yaml(key, item) for item in stripped.split(",")]
    if not isinstance(value, list):
        raise UserInputError(f"--{key} expects a list like '[1, 2]' or '1,2', got '{text}'")
    return value


def _file_types(values: Dict[str, Any]) -> Dict[str, Optional[type]]:
    """A file that is its own schema: each value's type is its key's (null: any)."""
    return {key: None if value is None else type(value) for key, value in values.items()}


def check_against_schema(values: Dict[str, Any], path: str, defaults: Dict[str, Any],
                         types: Dict[str, Optional[type]]) -> Dict[str, Any]:
    """The schema's keys and no other, with values of the schema's types; keys the file leaves out
    take the schema's defaults. A saved run config (config.yaml) also holds `config_path`, dropped here."""
    values = {key: value for key, value in values.items() if key != "config_path"}
    for key in values:
        if key not in defaults:
            raise unknown_key_error(key, defaults.keys(), path)
    checked = {}
    for key, value in {**defaults, **values}.items():
        ok, value = conform(value, types[key])
        if not ok:
            raise UserInputError(f"config file {path}: {key} must be {type_words(types[key])}, got {value!r}")
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
                prog: str = "train.py", reference_path: Optional[str] = SCHEMA_PATH) -> Config:
    """Load `--config_path` (or `default_path`, the default recipe), check it against the schema
    `reference_path` (None: the file is its own schema), and apply `--key value` overrides from argv.

    Model-zoo config files and command lines work as they are: their keys are translated
    (src/config/zoo.py); the keys with no effect here are named in `Config.notes`."""
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
        defaults, types = None, None
    else:
        reference = read_schema(reference_path)
        schema = list(reference) + ["config_path"]
        defaults = schema_defaults(reference)
        types = schema_types(reference)
        # the schema's meaning of a key, unless the file gives its own (as the model zoo's files do)
        helps = {**{name: key.help for name, key in reference.items()}, **helps}
    file_values, ignored = translate_zoo_keys(file_values, schema, f"config file {path}")
    if defaults is None:  # the file is its own schema
        defaults = {key: value for key, value in file_values.items() if key != "config_path"}
        types = _file_types(defaults)
    values = check_against_schema(file_values, path, defaults, types)
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
    return safe_yaml(key, text)


def run_dir(cfg: Config) -> str:
    """The run folder: output_dir/<net_name>/<dataset>."""
    return os.path.join(cfg.output_dir, cfg.net_name, cfg.dataset)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as yaml (atomically)."""
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


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
