"""PyTorch's side: the same ResNet trained and evaluated in eager mode. Its measuring process
never loads MindSpore."""
import argparse
import functools
import os

from tools.benchmarking.cpu_paths import CLASSES, CPU_ISAS, TORCH_WORKERS


class TorchRunner:
    """The same ResNet, SGD with momentum and cross-entropy in PyTorch eager: float32 in NCHW or
    channels_last, or bfloat16 autocast."""

    name = "torch"

    def __init__(self, net_name: str, batch: int, size: int, threads: int, memory_format: str = "nchw",
                 bf16: bool = False):
        import torch

        from src.migration import torch_resnet
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        layout = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
        self.net = getattr(torch_resnet, net_name)(num_classes=CLASSES).to(memory_format=layout)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        self.images = torch.rand(batch, 3, size, size).contiguous(memory_format=layout)
        self.labels = torch.arange(batch) % CLASSES
        self.one = torch.rand(1, 3, size, size).contiguous(memory_format=layout)
        self.autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=bf16)

    def compile_seconds(self) -> float:
        self.train_step()
        return 0.0  # eager: nothing to compile

    def train_step(self) -> None:
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss(self.net(self.images), self.labels)
        loss.backward()
        self.optimizer.step()

    def eval_step(self, single: bool) -> None:
        self.net.eval()
        with self.torch.no_grad(), self.autocast():
            self.net(self.one if single else self.images)


def torch_runner(args: argparse.Namespace) -> TorchRunner:
    """The worker's runner: its memory format and precision, PyTorch capped at --cpu_isa."""
    capability, onednn_isa = CPU_ISAS[args.cpu_isa]
    if capability:  # read when torch is imported
        os.environ.update(ATEN_CPU_CAPABILITY=capability, ONEDNN_MAX_CPU_ISA=onednn_isa)
    memory_format, bf16 = TORCH_WORKERS[args.worker]
    return TorchRunner(args.net, args.batch_size, args.image_size, args.threads, memory_format, bf16)
