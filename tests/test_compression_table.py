"""tools/compression_table.py: its latency worker times the network eval.py builds from a checkpoint,
pruned or not (the table's full run trains for minutes: docs/compression.md shows its output)."""
import json

import mindspore as ms
import pytest

from conftest import PYTHON, REPO, run
from src.compression.prune import prune_blocks
from src.resnet import create_model


@pytest.mark.slow
def test_latency_worker_times_float_and_pruned_checkpoints_on_the_same_layers(tmp_path):
    net = create_model("resnet18", num_classes=10)
    float_path, pruned_path = tmp_path / "float.ckpt", tmp_path / "pruned.ckpt"
    ms.save_checkpoint(net, str(float_path))
    prune_blocks(net, 0.5)
    ms.save_checkpoint(net, str(pruned_path))
    figures = {}
    for name, path, compression in (("float", float_path, "none"), ("pruned", pruned_path, "prune")):
        done = run([PYTHON, str(REPO / "tools" / "compression_table.py"), "--latency_of", str(path),
                    "--compression", compression])
        assert done.returncode == 0, done.stderr[-2000:]
        figures[name] = json.loads(done.stdout.strip().splitlines()[-1])
    for measured in figures.values():
        assert measured["batch_1_ms"] > 0 and measured["batch_32_ms"] > measured["batch_1_ms"]
    assert figures["pruned"]["convolutions"] == figures["float"]["convolutions"]  # pruning keeps the CPU layers
