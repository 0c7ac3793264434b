"""The model zoo's fine-tuning flow as train.py options: its checkpoint_path and learning_rate keys
become a pre-trained, frozen backbone under a new head trained at a constant lr."""
from typing import List, Sequence

from src.config import DEFAULT_CONFIG, read_yaml_documents, split_overrides
from src.errors import UserInputError

DEFAULT_LEARNING_RATE = 0.001  # the zoo's resnet34_cpu_config.yaml


def zoo_fine_tune_keys(argv: Sequence[str]) -> dict:
    """checkpoint_path, learning_rate and epoch_size, from the command line or else the config file."""
    pairs = dict(split_overrides([a for a in argv if a not in ("-h", "--help")]))
    file_values, _ = read_yaml_documents(pairs.get("config_path") or DEFAULT_CONFIG)
    return {key: pairs[key] if pairs.get(key) is not None else file_values.get(key)
            for key in ("checkpoint_path", "learning_rate", "epoch_size")}


def fine_tune_argv(argv: Sequence[str]) -> List[str]:
    """train.py's command line for the zoo's fine-tuning flow (the user's own options last, so they win)."""
    keys = zoo_fine_tune_keys(argv)
    checkpoint = str(keys["checkpoint_path"] or "")
    if not checkpoint.endswith(".ckpt"):
        raise UserInputError(f"checkpoint_path {checkpoint!r} does not name a pre-trained .ckpt file; set "
                             f"checkpoint_path (in the config file or --checkpoint_path) to the checkpoint to "
                             f"fine-tune")
    lr = str(keys["learning_rate"] if keys["learning_rate"] is not None else DEFAULT_LEARNING_RATE)
    own = ["--pre_trained", checkpoint, "--filter_weight", "True", "--freeze_backbone", "True",
           "--lr_decay_mode", "constant", "--lr_init", lr, "--lr_max", lr, "--warmup_epochs", "0",
           "--weight_decay", "0", "--run_eval", "True", "--eval_start_epoch", str(keys["epoch_size"] or 1)]
    # The two zoo keys are consumed here; train.py would only list them as ignored.
    rest = [token for key, value in split_overrides(argv) if key not in ("checkpoint_path", "learning_rate")
            for token in [f"--{key}"] + ([] if value is None else [value])]
    return own + rest
