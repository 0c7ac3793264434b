"""Evaluation metrics beyond MindSpore's built-ins."""
from mindspore.train import Metric


class SampleCount(Metric):
    """How many samples were evaluated (to prove none was dropped or repeated)."""

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self) -> None:
        self.count = 0

    def update(self, *inputs) -> None:
        self.count += int(inputs[-1].shape[0])

    def eval(self) -> int:
        return self.count
