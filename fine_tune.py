"""Fine-tune a pre-trained ResNet on a class-folder dataset of one's own, as the model zoo's
fine_tune.py does: only a new classifier head trains.

    python fine_tune.py --config_path resnet34_cpu_config.yaml --data_path flower_photos/
    python fine_tune.py --config_path CONFIG --checkpoint_path resnet34_imagenet.ckpt --class_num 5

The zoo's keys keep their meaning: `checkpoint_path` names the pre-trained checkpoint (the zoo's
1001-class ImageNet ones load directly), `class_num` sizes the new head, `learning_rate` is the
constant lr of its Momentum optimizer (no weight decay), and the test/ split is evaluated after
the last epoch. It is train.py with these keys set: --pre_trained, --filter_weight True (the old
head is dropped), --freeze_backbone True, a constant lr, --run_eval True from the last epoch; any
of them given on the command line wins.
"""
import os
import sys
from typing import Optional, Sequence

from src.errors import run_cli
from src.migration.zoo_fine_tune import fine_tune_argv

TRAIN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__, flush=True)
        converted = argv
    else:
        converted = fine_tune_argv(argv)
        print(f"fine_tune.py: train.py {' '.join(converted[:20])} (the zoo's checkpoint_path and learning_rate)",
              flush=True)
    # train.py in this process's place: the same process, exit code and signals as if run directly.
    os.execv(sys.executable, [sys.executable, TRAIN_PY, *converted])


if __name__ == "__main__":
    run_cli(main)
