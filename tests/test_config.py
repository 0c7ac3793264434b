"""src/config/: the schema, recipe files + `--key value` overrides, type checks, clear errors."""
import glob
import json
import os

import pytest
import yaml

from conftest import PYTHON, REPO, run
from src.config import (
    DEFAULT_CONFIG,
    SCHEMA_PATH,
    Config,
    load_config,
    read_schema,
    read_yaml,
    recipe_keys,
    run_dir,
    save_config,
)
from src.config.schema import TYPES, conform, format_reference
from src.errors import UserInputError

SCHEMA = {
    "net_name": "resnet50",
    "dataset": "cifar10",
    "output_dir": "./output",
    "epoch_size": 90,
    "batch_size": 32,
    "lr_max": 0.1,
    "lr_end": 0.00001,
    "weight_decay": 0.0001,
    "run_eval": True,
    "resume": False,
    "lr_decay_epochs": [30, 60, 80],
    "all_reduce_fusion_config": [],
    "checkpoint_file_path": "",
    "anything": None,
}


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "schema.yaml"
    path.write_text(yaml.safe_dump(SCHEMA, sort_keys=False), encoding="utf-8")
    return str(path)


def load(cfg_path, *args):
    """Load a config that is its own schema (the repository's files are checked separately)."""
    return load_config(["--config_path", cfg_path, *args], reference_path=None)


def test_defaults_come_from_the_file(cfg_path):
    cfg = load(cfg_path)
    for key, value in SCHEMA.items():
        assert getattr(cfg, key) == value
    assert cfg.config_path == cfg_path
    assert cfg.source == cfg_path


def test_config_path_with_equals_sign(cfg_path):
    cfg = load_config([f"--config_path={cfg_path}", "--epoch_size", "3"], reference_path=None)
    assert cfg.epoch_size == 3 and cfg.config_path == cfg_path


@pytest.mark.parametrize("style", ["space", "equals"])
@pytest.mark.parametrize("key,text,expected", [
    ("epoch_size", "7", 7),
    ("anything", "-1", -1),  # a negative number is a value, not an option
    ("lr_max", "0.25", 0.25),
    ("lr_end", "1e-6", 1e-6),
    ("net_name", "resnet18", "resnet18"),
    ("dataset", "imagenet2012", "imagenet2012"),
    ("run_eval", "False", False),
    ("run_eval", "false", False),
    ("run_eval", "0", False),
    ("run_eval", "no", False),
    ("resume", "True", True),
    ("resume", "1", True),
    ("resume", "yes", True),
    ("lr_decay_epochs", "[10, 20]", [10, 20]),
    ("lr_decay_epochs", "5,15,25", [5, 15, 25]),
    ("lr_decay_epochs", "", []),
    ("all_reduce_fusion_config", "[85, 160]", [85, 160]),
    ("checkpoint_file_path", "/a/b.ckpt", "/a/b.ckpt"),
    ("anything", "3", 3),
    ("anything", "[1, 2]", [1, 2]),
])
def test_override_types(cfg_path, style, key, text, expected):
    args = [f"--{key}={text}"] if style == "equals" else [f"--{key}", text]
    value = getattr(load(cfg_path, *args), key)
    assert value == expected
    assert type(value) is type(expected)


def test_several_overrides_together(cfg_path):
    cfg = load(cfg_path, "--epoch_size", "2", "--lr_max=0.5", "--run_eval", "false", "--net_name", "resnet34")
    assert (cfg.epoch_size, cfg.lr_max, cfg.run_eval, cfg.net_name) == (2, 0.5, False, "resnet34")
    # untouched keys keep their file values
    assert cfg.batch_size == 32 and cfg.lr_decay_epochs == [30, 60, 80]


def test_bare_bool_flag_means_true(cfg_path):
    assert load(cfg_path, "--resume").resume is True
    assert load(cfg_path, "--resume", "--epoch_size", "4").epoch_size == 4


def test_bare_non_bool_flag_needs_a_value(cfg_path):
    with pytest.raises(UserInputError, match="epoch_size"):
        load(cfg_path, "--epoch_size")


def test_int_is_accepted_for_a_float_key_and_becomes_float(cfg_path):
    value = load(cfg_path, "--lr_max", "1").lr_max
    assert value == 1.0 and type(value) is float


def test_float_is_rejected_for_an_int_key(cfg_path):
    with pytest.raises(UserInputError, match="epoch_size"):
        load(cfg_path, "--epoch_size", "2.5")


@pytest.mark.parametrize("key,text", [("lr_max", "fast"), ("run_eval", "maybe"), ("batch_size", "many")])
def test_values_of_the_wrong_type_are_rejected(cfg_path, key, text):
    with pytest.raises(UserInputError, match=key):
        load(cfg_path, f"--{key}", text)


def test_unknown_key_suggests_the_closest(cfg_path):
    with pytest.raises(UserInputError) as info:
        load(cfg_path, "--lr_mx", "0.2")
    assert "lr_mx" in str(info.value)
    assert "did you mean 'lr_max'" in str(info.value)


def test_unknown_key_without_close_match(cfg_path):
    with pytest.raises(UserInputError) as info:
        load(cfg_path, "--zzzzzzzz", "1")
    assert "zzzzzzzz" in str(info.value) and "did you mean" not in str(info.value)


def test_positional_argument_is_rejected(cfg_path):
    with pytest.raises(UserInputError, match="stray"):
        load(cfg_path, "stray")


def test_missing_config_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(UserInputError) as info:
        load_config(["--config_path", missing])
    assert missing in str(info.value)


def test_malformed_yaml_names_the_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n", encoding="utf-8")
    with pytest.raises(UserInputError) as info:
        load_config(["--config_path", str(path)])
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", ["- 1\n- 2\n", "just a string\n", ""])
def test_non_mapping_yaml_names_the_path(tmp_path, content):
    path = tmp_path / "list.yaml"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserInputError) as info:
        load_config(["--config_path", str(path)])
    assert str(path) in str(info.value)


def test_missing_attribute_raises_user_input_error(cfg_path):
    cfg = load(cfg_path)
    with pytest.raises(UserInputError, match="no_such_key"):
        cfg.no_such_key  # noqa: B018
    assert "no_such_key" not in cfg
    assert "epoch_size" in cfg
    assert cfg.get("no_such_key", 5) == 5


def test_config_attribute_assignment():
    cfg = Config({"a": 1})
    cfg.b = 2
    cfg.a = 3
    assert cfg.to_dict() == {"a": 3, "b": 2}


def test_save_config_round_trips(cfg_path, tmp_path):
    cfg = load(cfg_path, "--lr_max", "0.3", "--lr_decay_epochs", "1,2", "--resume", "true")
    out = tmp_path / "nested" / "dir" / "config.yaml"
    save_config(cfg, str(out))
    with open(out, encoding="utf-8") as handle:
        assert yaml.safe_load(handle) == cfg.to_dict()
    # and the saved file is itself a valid config file
    again = load_config(["--config_path", str(out)], reference_path=None)
    assert again.to_dict() == dict(cfg.to_dict(), config_path=str(out))
    assert not [name for name in os.listdir(out.parent) if name.startswith(".tmp-")]


def test_run_dir(cfg_path):
    cfg = load(cfg_path, "--output_dir", "/x/out", "--net_name", "resnet18", "--dataset", "imagenet2012")
    assert run_dir(cfg) == os.path.join("/x/out", "resnet18", "imagenet2012")


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_zero(cfg_path, flag, capsys):
    with pytest.raises(SystemExit) as info:
        load(cfg_path, flag)
    assert info.value.code in (0, None)
    assert "--epoch_size" in capsys.readouterr().out


CONFIG_FILES = sorted(glob.glob(str(REPO / "config" / "*.yaml")))
# Every shipped recipe's resolved config (all keys, config_path aside) as the tree gave it before the
# schema left config/resnet50_cifar10.yaml: moving keys between the schema and the recipes must not
# change a value. A new recipe adds its entry (python -m src.config --config_path config/NEW.yaml).
EFFECTIVE_FILE = REPO / "tests" / "data" / "recipe_effective_configs.json"
EFFECTIVE = json.loads(EFFECTIVE_FILE.read_text())
SCHEMA_KEYS = read_schema()


def test_config_folder_is_not_empty():
    assert len(CONFIG_FILES) >= 2


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_file_loads_with_the_schema_keys(path):
    cfg = load_config(["--config_path", path])
    assert set(cfg.to_dict()) - {"config_path"} == set(SCHEMA_KEYS)
    for name, key in SCHEMA_KEYS.items():
        assert conform(getattr(cfg, name), TYPES[key.type])[0], (name, getattr(cfg, name), key.type)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_recipe_resolves_to_its_recorded_config(path):
    """Every key of every shipped recipe, with its type (0.0 is not 0), as recorded."""
    name = os.path.basename(path)
    assert name in EFFECTIVE, f"{name}: a new recipe; add its resolved config to {EFFECTIVE_FILE}"
    got = load_config(["--config_path", path]).to_dict()
    assert got.pop("config_path") == path
    assert set(got) == set(EFFECTIVE[name])
    wrong = {key: (got[key], want) for key, want in EFFECTIVE[name].items()
             if got[key] != want or type(got[key]) is not type(want)}
    assert not wrong, f"{name}: (resolved, recorded) {wrong}"


def test_every_recorded_recipe_is_shipped():
    assert sorted(EFFECTIVE) == sorted(os.path.basename(path) for path in CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_recipe_says_what_it_is_and_states_every_recipe_key(path):
    """The rule (src/config/schema.yaml): a file in config/ is a recipe, says so in its first line,
    and states every recipe key itself, so no schema default decides a shipped recipe."""
    with open(path, encoding="utf-8") as handle:
        first = handle.readline()
    assert first.startswith("# Recipe: ") and len(first.strip()) > len("# Recipe: ") + 10, first
    stated = read_yaml(path)
    missing = [key for key in recipe_keys() if key not in stated]
    assert not missing, f"{os.path.basename(path)} leaves recipe keys to the schema: {missing}"


def test_the_schema_has_every_key_each_with_a_type_a_default_and_a_help():
    every = set(next(iter(EFFECTIVE.values())))
    assert len(every) == 116 and all(set(values) == every for values in EFFECTIVE.values())
    assert set(SCHEMA_KEYS) == every
    for name, key in SCHEMA_KEYS.items():
        assert key.type in TYPES and conform(key.default, TYPES[key.type])[0], name
        assert key.help.strip() and "\n" not in key.help, name
    # docs/config_reference.md renders every key (tests/test_docs.py keeps the file equal to this)
    reference = format_reference()
    assert all(f"| `{name}` |" in reference for name in SCHEMA_KEYS)


# What makes a recipe; each is marked in the schema (more keys may be).
RECIPE_CORE = ["net_name", "dataset", "class_num", "train_image_size", "eval_image_size", "batch_size", "epoch_size",
               "optimizer", "momentum", "weight_decay", "lr_decay_mode", "warmup_epochs", "lr_init", "lr_max",
               "lr_end", "lr_decay_epochs", "lr_decay_factor", "lr_poly_power", "use_label_smooth",
               "label_smooth_factor", "auto_augment", "random_erase", "mixup_alpha", "cutmix_alpha", "ra_reps",
               "amp_level", "loss_scale_type", "loss_scale", "model_ema", "model_ema_decay", "model_ema_steps",
               "grad_accumulation_steps", "lars_coefficient", "damping_init"]
# Run keys, with the neutral defaults the schema must keep: nothing set, off, the usual value.
NEUTRAL = {"data_path": "", "output_dir": "./output", "checkpoint_file_path": "", "resume": False, "resume_ckpt": "",
           "pre_trained": "", "run_eval": False, "run_distribute": False, "device_num": 1, "enable_profiling": False,
           "file_name": "", "model_file": "", "report_dir": "", "quantize": "none"}


def test_recipe_keys_are_marked_and_the_other_defaults_are_neutral():
    marked = recipe_keys()
    assert not [key for key in RECIPE_CORE if key not in marked]
    assert {name: SCHEMA_KEYS[name].default for name in NEUTRAL} == NEUTRAL
    assert not set(NEUTRAL) & set(marked)


def test_the_default_recipe_is_a_recipe_and_not_the_schema():
    """train.py, eval.py and export.py without --config_path run config/resnet50_cifar10.yaml; the
    keys a file leaves out come from the schema, never from that recipe."""
    assert os.path.samefile(DEFAULT_CONFIG, REPO / "config" / "resnet50_cifar10.yaml")
    assert os.path.samefile(SCHEMA_PATH, REPO / "src" / "config" / "schema.yaml")
    default = load_config([]).to_dict()
    assert default.pop("config_path") == DEFAULT_CONFIG
    assert default == EFFECTIVE["resnet50_cifar10.yaml"]


def test_a_partial_file_takes_the_schema_defaults(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text("net_name: resnet18\nepoch_size: 3\n", encoding="utf-8")
    values = load_config(["--config_path", str(path)]).to_dict()
    assert values.pop("config_path") == str(path)
    assert values == {**{name: key.default for name, key in SCHEMA_KEYS.items()}, "net_name": "resnet18",
                      "epoch_size": 3}


@pytest.mark.parametrize("entry, words", [
    ("{type: int, default: 3}", "expected a mapping of type, default, help"),
    ("{type: integer, default: 3, help: x}", "type 'integer'"),
    ("{type: int, default: 0.5, help: x}", "is not an integer"),
    ("{type: int, default: 3, help: ''}", "help must say"),
    ("{type: int, default: 3, help: x, recipe: maybe}", "recipe must be true or false"),
])
def test_a_malformed_schema_entry_names_the_key(tmp_path, entry, words):
    path = tmp_path / "schema.yaml"
    path.write_text(f"epoch_size: {{type: int, default: 1, help: epochs}}\nbroken: {entry}\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="broken") as info:
        read_schema(str(path))
    assert words in str(info.value)


def test_importing_the_modules_does_not_parse_argv():
    code = ("import sys; sys.argv = ['x', '--bogus', 'value']; "
            "import src.config, src.dataset, src.resnet, src.training.lr_schedule, src.training.loss, "
            "src.training.optimizer, src.training.callbacks, src.training.checkpoint, src.device, "
            "src.training.train_step")
    result = run([PYTHON, "-c", code], cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_config_survives_copy_and_pickle(cfg_path):
    import copy
    import pickle
    cfg = load(cfg_path, "--epoch_size", "3")
    for clone in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert clone.to_dict() == cfg.to_dict()
        assert clone.source == cfg.source
        with pytest.raises(UserInputError):
            clone.no_such_key  # noqa: B018
    deep = copy.deepcopy(cfg)
    deep.epoch_size = 99
    assert cfg.epoch_size == 3


DEFAULT_RECIPE = os.path.join(REPO, "config", "resnet50_cifar10.yaml")


def user_config(tmp_path, edit) -> str:
    """A copy of the default recipe with `edit` applied to its text."""
    with open(DEFAULT_RECIPE, encoding="utf-8") as handle:
        text = edit(handle.read())
    path = tmp_path / "mine.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_user_config_is_checked_against_the_schema(tmp_path):
    typo = user_config(tmp_path, lambda t: t.replace("lr_max:", "lr_maxx:"))
    with pytest.raises(UserInputError, match=r"unknown config key 'lr_maxx' in .*mine.yaml; did you mean 'lr_max'"):
        load_config(["--config_path", typo])
    wrong_type = user_config(tmp_path, lambda t: t.replace("epoch_size: 90", "epoch_size: ninety"))
    with pytest.raises(UserInputError, match="epoch_size must be an integer"):
        load_config(["--config_path", wrong_type])
    missing = user_config(tmp_path, lambda t: t.replace("momentum: 0.9\n", "").replace("lr_max: 0.1", "lr_max: 0.2"))
    cfg = load_config(["--config_path", missing])
    assert cfg.momentum == 0.9 and cfg.lr_max == 0.2  # a key left out takes the schema's default


def test_exponent_floats_and_saved_configs_load(tmp_path):
    path = user_config(tmp_path, lambda t: t.replace("weight_decay: 0.0001", "weight_decay: 1e-4"))
    cfg = load_config(["--config_path", path, "--lr_end", "1E-5"])
    assert cfg.weight_decay == 0.0001 and isinstance(cfg.weight_decay, float) and cfg.lr_end == 1e-5
    saved = tmp_path / "run" / "config.yaml"
    save_config(cfg, str(saved))
    assert load_config(["--config_path", str(saved)]).to_dict() == {**cfg.to_dict(), "config_path": str(saved)}


@pytest.mark.parametrize("key,value", [("batch_size", "0"), ("epoch_size", "-1"), ("save_checkpoint_epochs", "0"),
                                       ("lr_max", "-0.1")])
def test_out_of_range_values_are_refused(key, value):
    with pytest.raises(UserInputError, match=key):
        load_config(["--config_path", DEFAULT_RECIPE, f"--{key}", value])
