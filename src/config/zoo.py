"""The MindSpore model zoo's config keys (mindspore-ai/models, official/cv/ResNet/config/*.yaml).

A zoo config file carries keys this repository has under another name, keys with no meaning here
(ModelArts/OBS transfer, Ascend 310 and Lite inference, the parameter server, graph dumps) and
the GPU benchmark's keys (the Thor optimizer's keys are in the schema: src/training/thor.py).
`translate_zoo_keys` renames the first kind, drops the second (listing them) and refuses, in one
line, a value that would change the run if it were silently dropped. Pure functions over dicts; no I/O.
The loader (src/config/loader.py) applies them to every file and command line it reads.
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from src.errors import UserInputError

# Zoo name -> this repository's name for the same setting.
RENAMED_KEYS = {"output_path": "output_dir", "ckpt_file": "checkpoint_file_path"}

# What refusing each switch says; the fix is always to set the neutral value shown.
_MODELARTS = "ModelArts/OBS transfer is not supported here; copy the data to this machine and pass --data_path"
_LITE = "MindSpore Lite inference is not part of this repository; export with export.py and run predict.py"
_POSITION = ("train.py takes the epoch to continue from out of the checkpoint it resumes; pass "
             "--resume_ckpt CKPT (a checkpoint written by train.py)")
_CACHE = ("MindSpore's dataset cache needs a cache server (cache_admin --start) and a session "
          "(cache_admin -g), and this repository's pipeline does not use it (its samples are augmented "
          "per sample in Python, keyed by seed, epoch and index, which a cache would freeze)")

# Zoo keys with no effect here: key -> (neutral value or None for any value, why another value is refused).
IGNORED_KEYS: Dict[str, Tuple[Any, str]] = {
    "enable_modelarts": (False, _MODELARTS),
    "data_url": (None, ""), "train_url": (None, ""), "checkpoint_url": (None, ""), "load_path": (None, ""),
    "checkpoint_path": (None, ""),         # the zoo's save folder; here checkpoints go to the run folder
    "parameter_server": (False, "parameter-server training is not supported; use data-parallel "
                                "training (scripts/run_distribute_train.sh)"),
    "enable_cache": (False, _CACHE), "cache_session_id": (None, ""),
    "save_graphs": (False, "graph dumps are not supported; use enable_profiling to look inside a run"),
    "save_graphs_path": (None, ""),
    "start_epoch": (0, _POSITION), "has_trained_epoch": (0, _POSITION), "has_trained_step": (0, _POSITION),
    "pretrain_epoch_size": (0, _POSITION),
    # Ascend 310 / Lite inference and prediction scripts
    "infer_label": (None, ""), "network_dataset": (None, ""), "result_path": (None, ""), "label_path": (None, ""),
    "img_path": (None, ""), "mindir_path": (None, ""),
    "enable_predict_lite_backend": (False, _LITE), "enable_predict_lite_mindir": (False, _LITE),
    # LARS (until this repository's optimizer takes them; then the schema has them and they are not ignored)
    "lars_epsilon": (None, ""), "lars_coefficient": (None, ""),
    # gpu_resnet_benchmark.py's own keys (a file with print_per_steps is refused as a whole, see BENCHMARK_FILE)
    "lr": (None, ""), "learning_rate": (None, ""), "save_checkpoint_path": (None, ""), "print_per_steps": (None, ""),
    "eval": (None, ""), "save_ckpt": (None, ""), "dtype": (None, ""), "train_epoch_size": (None, ""),
}
# resnet_benchmark_GPU.yaml configures the zoo's gpu_resnet_benchmark.py, not training: it names no
# network, dataset or schedule, so train.py would run on the schema's defaults, which it does not mean.
BENCHMARK_FILE = ("print_per_steps", "the model zoo's gpu_resnet_benchmark.py configuration (it names no network, "
                  "dataset or lr schedule to train with); measure speed with benchmark.py (docs/performance.md) "
                  "or train with a training config such as the zoo's resnet50_imagenet2012_config.yaml")


def refuse_if_active(key: str, value: Any, where: str) -> None:
    """A one-line error when an ignored zoo key holds a value that would change the run."""
    neutral, why = IGNORED_KEYS[key]
    if neutral is None or value == neutral or (neutral is False and value in ("", None)):
        return
    raise UserInputError(f"{key} {value!r} ({where}): {why}; set {key} {neutral!r}")


def translate_zoo_keys(values: Dict[str, Any], schema: Sequence[str], where: str) -> Tuple[Dict[str, Any], List[str]]:
    """Zoo keys -> this repository's: renamed keys take their new name, keys with no effect here
    are dropped (returned in order) after checking their values change nothing. Keys the schema
    knows are left alone (e.g. `lars_*` once the LARS optimizer exists)."""
    if BENCHMARK_FILE[0] in values and BENCHMARK_FILE[0] not in schema:
        raise UserInputError(f"{where} is {BENCHMARK_FILE[1]}")
    out: Dict[str, Any] = {}
    ignored: List[str] = []
    for key, value in values.items():
        if key in schema:
            out[key] = value
        elif key in RENAMED_KEYS:
            target = RENAMED_KEYS[key]
            if value in ("", None):
                continue  # an empty zoo default must not clear the setting under our name
            if values.get(target) not in ("", None, value):
                raise UserInputError(f"{where} sets both {key} ({value!r}) and {target} ({values[target]!r}); "
                                     f"keep one ({key} is the model zoo's name for {target})")
            out[target] = value
        elif key in IGNORED_KEYS:
            refuse_if_active(key, value, where)
            ignored.append(key)
        else:
            out[key] = value  # unknown: the schema check names it and suggests the closest key
    return out, ignored


def check_optimizer_available(optimizer: str, schema: Sequence[str]) -> None:
    """The zoo's Boost config asks for LARS; say plainly when this build has no LARS keys yet."""
    if str(optimizer).upper() == "LARS" and "lars_coefficient" not in schema:
        raise UserInputError("optimizer LARS (the model zoo's Boost config) is not available in this repository "
                             "yet; pass --optimizer Momentum")


def ignored_line(ignored: Sequence[str], source: str) -> Optional[str]:
    """The one log line naming the zoo keys that were accepted and have no effect."""
    if not ignored:
        return None
    return f"config: model-zoo keys with no effect here, ignored ({source}): {', '.join(ignored)}"
