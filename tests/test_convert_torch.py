"""PyTorch migration: name mapping, torchvision <-> MindSpore conversion, model-zoo import, parity.

The PyTorch side is src/migration/torch_resnet.py (torchvision's architecture and keys; torchvision itself
has no CPU-only build). torch is a test dependency (requirements-dev.txt); the name-mapping tests
run without it.
"""
import contextlib
import io
import os
import pickle
import re
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from conftest import NO_TORCH, PYTHON, last_json, needs_torch, one_line_error, run
from src.errors import run_cli
from src.migration import convert_torch as ct
from src.resnet import ARCHS, create_model
from src.training.checkpoint import is_training_state, read_checkpoint

pytestmark = pytest.mark.slow  # trains, exports or starts processes: not in the quick tier

CONVERT = [PYTHON, "-m", "src.migration.convert_torch"]
PARITY = [PYTHON, "-m", "src.migration.parity"]
CLASSES = {"resnet18": 10, "resnet50": 1000, "resnext50_32x4d": 10, "wide_resnet50_2": 10}


def ok(result) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def convert(*argv: str) -> str:
    """The conversion command's main (`python -m src.migration.convert_torch`) called in this
    process: its stdout. The command itself runs as a subprocess in some refusal tests below."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ct.main(list(argv)) == 0
    return out.getvalue()


def refused(*argv: str) -> str:
    """The conversion command run in this process as its `__main__` runs it (src.errors.run_cli):
    a user error exits 2 with exactly one line on stderr; that line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        run_cli(ct.main, list(argv))
    lines = err.getvalue().strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Name mapping (no torch needed).

def test_torchvision_names_map_to_mindspore_names():
    assert ct.torch_to_ms_name("conv1.weight") == "conv1.weight"
    assert ct.torch_to_ms_name("bn1.weight") == "bn1.gamma"
    assert ct.torch_to_ms_name("bn1.bias") == "bn1.beta"
    assert ct.torch_to_ms_name("layer1.0.bn3.running_mean") == "layer1.0.bn3.moving_mean"
    assert ct.torch_to_ms_name("layer2.0.downsample.1.running_var") == "layer2.0.downsample.1.moving_variance"
    assert ct.torch_to_ms_name("layer2.0.downsample.0.weight") == "layer2.0.downsample.0.weight"
    assert ct.torch_to_ms_name("layer3.1.bn2.num_batches_tracked") is None
    assert ct.torch_to_ms_name("fc.weight") == "fc.weight" and ct.torch_to_ms_name("fc.bias") == "fc.bias"
    assert ct.ms_to_torch_name("layer4.2.bn3.moving_variance") == "layer4.2.bn3.running_var"
    assert ct.ms_to_torch_name("fc.bias") == "fc.bias"


def test_every_resnet50_name_maps_both_ways():
    names = [p.name for p in create_model("resnet50", num_classes=1000, initialize=False).get_parameters()]
    torch_keys = ct.torch_state_dict_order(names)
    assert len(names) == 267 and len(torch_keys) == 320
    assert sum(k.endswith(".num_batches_tracked") for k in torch_keys) == 53
    mapped = [ct.torch_to_ms_name(k) for k in torch_keys]
    assert sorted(n for n in mapped if n is not None) == sorted(names)
    assert all(ct.torch_to_ms_name(ct.ms_to_torch_name(n)) == n for n in names)
    assert torch_keys[:7] == ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
                              "bn1.num_batches_tracked", "layer1.0.conv1.weight"]


def test_model_zoo_names_map_to_this_repos_names():
    zoo = {
        "conv1.weight": "conv1.weight",
        "bn1.moving_mean": "bn1.moving_mean",
        "layer1.0.bn1d.gamma": "layer1.0.bn1.gamma",                        # zoo resnet18/34 blocks
        "layer3.1.bn2d.moving_variance": "layer3.1.bn2.moving_variance",
        "layer1.0.bn3.beta": "layer1.0.bn3.beta",                            # zoo resnet50 blocks
        "layer2.0.down_sample_layer.0.weight": "layer2.0.downsample.0.weight",
        "layer2.0.down_sample_layer.1.gamma": "layer2.0.downsample.1.gamma",
        "end_point.weight": "fc.weight",
        "end_point.bias": "fc.bias",
    }
    assert {name: ct.zoo_to_ms_name(name) for name in zoo} == zoo
    assert ct.zoo_to_ms_name("layer2.0.downsample.1.gamma") == "layer2.0.downsample.1.gamma"  # ours: as is
    for key in ("moments.conv1.weight", "learning_rate", "global_step", "momentum", "adam_m.fc.bias"):
        assert is_training_state(key)
    assert not is_training_state("layer1.0.bn1.moving_mean")


def test_wrapper_prefix_is_found_from_the_stem():
    keys = ["layer1.0.conv1.weight", "module.layer1.0.conv1.weight", "module.conv1.weight"]
    assert ct.common_prefix(keys) == "module."
    assert ct.common_prefix(["layer1.0.conv1.weight", "conv1.weight"]) == ""
    assert ct.common_prefix(["_orig_mod.conv1.weight"]) == "_orig_mod."
    assert ct.common_prefix(["layer1.0.conv1.weight"]) == ""


def test_arch_is_guessed_from_the_block_layout_and_the_3x3_groups():
    for name, arch in ARCHS.items():
        convs = ("conv1", "conv2", "conv3") if arch.kind == "bottleneck" else ("conv1", "conv2")
        params = {f"layer{s + 1}.{i}.{c}.weight": np.zeros(1) for s, n in enumerate(arch.layers)
                  for i in range(n) for c in convs}
        width = arch.groups * arch.width_per_group  # layer1's 3x3: [width, width / groups, 3, 3]
        params["layer1.0.conv2.weight"] = np.zeros((width, arch.width_per_group, 3, 3), np.float32)
        assert ct.guess_arch(params) == name
    assert ct.guess_arch({"conv1.weight": np.zeros(1), "fc.weight": np.zeros(1)}) is None


def test_same_padding_is_asymmetric_at_stride_2():
    """The README's claim: the zoo's pad_mode='same' puts the extra row/column at the bottom/right,
    so the same 3x3/2 weights see a window one pixel off from torchvision's symmetric padding."""
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((1, 2, 8, 8)).astype(np.float32))
    weight = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)

    def conv(**kwargs):
        cell = nn.Conv2d(2, 3, 3, stride=2, has_bias=False, weight_init=Tensor(weight), **kwargs)
        return cell

    same = conv(pad_mode="same")(x).asnumpy()
    symmetric = conv(pad_mode="pad", padding=1)(x).asnumpy()
    bottom_right = conv(pad_mode="pad", padding=(0, 1, 0, 1))(x).asnumpy()
    assert same.shape == symmetric.shape == (1, 3, 4, 4)
    np.testing.assert_allclose(same, bottom_right, rtol=1e-5, atol=1e-5)
    assert np.abs(same - symmetric).max() > 0.1


# ---------------------------------------------------------------------------------------------
# torchvision-style .pth files from the test's PyTorch ResNet.

def make_torch_resnet(arch: str, num_classes: int, seed: int):
    """A torchvision-keyed ResNet with random weights and non-trivial BatchNorm fields.

    Running statistics come from a forward pass in train mode (so they normalize like a trained
    network's, and differ from 0/1), gamma and beta are random, so swapping any two BN fields shows.
    The last BatchNorm of each block gets a small gamma, as trained ResNets have: at full-scale
    residual branches a random ResNet50 amplifies float32 rounding (per-block differences of ~6e-7
    relative grow to ~1e-4 on the logits, in either framework against the other), which would test
    the random network's conditioning instead of the conversion."""
    import torch

    from src.migration import torch_resnet

    torch.manual_seed(seed)
    model = getattr(torch_resnet, arch)(num_classes=num_classes)
    last = {m.bn3 if isinstance(m, torch_resnet.Bottleneck) else m.bn2
            for m in model.modules() if isinstance(m, (torch_resnet.BasicBlock, torch_resnet.Bottleneck))}
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for bn in norms:
            bn.weight.uniform_(0.1, 0.3) if bn in last else bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.2)
            bn.momentum = None  # cumulative average: the running stats become the batch's statistics
        model.train()
        model(torch.randn(8, 3, 64, 64))
        for bn in norms:
            bn.momentum = 0.1
            bn.num_batches_tracked.zero_()  # as a never-trained torchvision model (see the round trip)
    return model.eval()


@pytest.fixture(scope="module")
def torch_files(tmp_path_factory):
    """resnet18 (10 classes) saved as a DataParallel training checkpoint ({'state_dict': {'module.*'},
    'epoch', 'best_acc1'}); resnet50 (1000 classes), resnext50_32x4d and wide_resnet50_2 (10) as bare
    state dicts."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    folder = tmp_path_factory.mktemp("torch")
    files = {}
    for seed, arch in enumerate(CLASSES):
        state = make_torch_resnet(arch, CLASSES[arch], seed).state_dict()
        path = folder / f"{arch}.pth"
        if arch == "resnet18":
            torch.save({"epoch": 90, "best_acc1": torch.tensor(69.7),
                        "state_dict": {f"module.{k}": v for k, v in state.items()}}, path)
        else:
            torch.save(state, path)
        files[arch] = (path, state)
    return files


@pytest.fixture(scope="module")
def converted(torch_files, tmp_path_factory):
    """Each .pth converted by the command's main, in this process; returns {arch: (ckpt path, stdout)}."""
    folder = tmp_path_factory.mktemp("converted")
    out = {}
    for arch, (pth, _) in torch_files.items():
        ckpt = folder / f"{arch}.ckpt"
        out[arch] = (ckpt, convert("--arch", arch, "--pth", str(pth), "--ckpt", str(ckpt)))
    return out


@needs_torch
@pytest.mark.parametrize("arch", list(CLASSES))
def test_converted_checkpoint_holds_the_torch_values(arch, torch_files, converted):
    _, state = torch_files[arch]
    ckpt, stdout = converted[arch]
    if arch == "resnet18":
        assert "under 'state_dict'" in stdout and "prefix 'module.' stripped" in stdout
    else:
        assert "53 BatchNorm layers" in stdout and "53 num_batches_tracked dropped" in stdout
    assert f"num_classes {CLASSES[arch]} (from" in stdout and "verified" in stdout
    params = read_checkpoint(str(ckpt))
    expected = {ct.torch_to_ms_name(k): v.numpy() for k, v in state.items()
                if not k.endswith("num_batches_tracked")}
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(params[name].asnumpy(), value), name
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".convert-")]


@needs_torch
@pytest.mark.parametrize("arch", list(CLASSES))
def test_parity_logits_agree_within_1e_4(arch, torch_files, converted):
    pth, _ = torch_files[arch]
    ckpt, _ = converted[arch]
    result = run(PARITY + ["--arch", arch, "--pth", str(pth), "--ckpt", str(ckpt), "--image_size", "64",
                           "--batch_size", "2", "--torch_model", f"src.migration.torch_resnet:{arch}"])
    report = last_json(ok(result))
    stages = report["stages"]
    assert list(stages) == ["stem", "layer1", "layer2", "layer3", "layer4", "logits"]
    assert report["ok"] is True and report["input"] == [2, 3, 64, 64]
    assert stages["logits"]["shape"] == [2, CLASSES[arch]]
    assert stages["logits"]["max_abs_diff"] < 1e-4, stages["logits"]
    assert stages["logits"]["cosine"] > 0.999999
    assert stages["stem"]["max_abs_diff"] < 1e-5
    for row in stages.values():
        assert row["rel_diff"] < 1e-4 and row["cosine"] > 0.99999, row
    print(f"{arch}: logits max abs diff {stages['logits']['max_abs_diff']:.3e}, "
          f"1 - cosine {1 - stages['logits']['cosine']:.1e}")


@needs_torch
@pytest.mark.parametrize("arch", list(CLASSES))
def test_round_trip_pth_ckpt_pth_is_exact(arch, torch_files, converted, tmp_path):
    import torch

    from src.migration import torch_resnet

    _, state = torch_files[arch]
    ckpt, _ = converted[arch]
    back = tmp_path / "back.pth"
    convert("--arch", arch, "--ckpt_in", str(ckpt), "--pth_out", str(back))
    loaded = torch.load(back, map_location="cpu", weights_only=True)
    assert list(loaded) == list(state)  # torchvision's order, num_batches_tracked included
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    model = getattr(torch_resnet, arch)(num_classes=CLASSES[arch])
    model.load_state_dict(loaded, strict=True)


@needs_torch
def test_model_zoo_checkpoint_imports(converted, tmp_path):
    """A zoo-style resnet18 training checkpoint (bn1d/bn2d, down_sample_layer, end_point with 1001
    classes, Momentum slots, lr and step) converts with the same command, to .ckpt and to .pth."""
    import torch

    from src.migration import torch_resnet

    ours = read_checkpoint(str(converted["resnet18"][0]))
    rng = np.random.default_rng(3)
    values = {name: p.asnumpy() for name, p in ours.items()}
    values["fc.weight"] = rng.standard_normal((1001, 512)).astype(np.float32)
    values["fc.bias"] = rng.standard_normal(1001).astype(np.float32)

    def zoo_name(name: str) -> str:
        name = re.sub(r"^(layer\d\.\d+\.)bn([12])\.", r"\1bn\2d.", name)
        return name.replace("downsample", "down_sample_layer").replace("fc.", "end_point.")

    entries = [{"name": zoo_name(n), "data": Tensor(v)} for n, v in values.items()]
    entries += [{"name": "moments." + zoo_name(n), "data": Tensor(np.zeros_like(v))} for n, v in values.items()
                if not n.endswith(("moving_mean", "moving_variance"))]
    entries += [{"name": "learning_rate", "data": Tensor(np.array(0.1, np.float32))},
                {"name": "global_step", "data": Tensor(np.array([5004], np.int32))}]
    zoo = tmp_path / "resnet18_zoo.ckpt"
    ms.save_checkpoint(entries, str(zoo))
    assert "layer1.0.bn1d.gamma" in read_checkpoint(str(zoo))

    out_ckpt, out_pth = tmp_path / "resnet18.ckpt", tmp_path / "resnet18.pth"
    stdout = convert("--arch", "resnet18", "--zoo_ckpt", str(zoo), "--ckpt", str(out_ckpt), "--pth_out", str(out_pth))
    assert "num_classes 1001 (from end_point.weight [1001, 512])" in stdout
    assert "optimizer entries dropped" in stdout and "model-zoo names" in stdout and "eps 1e-4" in stdout
    params = read_checkpoint(str(out_ckpt))
    assert sorted(params) == sorted(values)
    assert all(np.array_equal(params[n].asnumpy(), v) for n, v in values.items())
    model = torch_resnet.resnet18(num_classes=1001)
    model.load_state_dict(torch.load(out_pth, weights_only=True), strict=True)
    assert torch.equal(model.layer2[0].downsample[1].running_var,
                       torch.from_numpy(values["layer2.0.downsample.1.moving_variance"]))


# ---------------------------------------------------------------------------------------------
# Refusals and clear errors.

class _RunsCode:
    """Unpickling this runs a shell command (here: creating a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@needs_torch
def test_malicious_pth_is_refused_without_running_it(torch_files, tmp_path):
    import torch

    _, state = torch_files["resnet18"]
    payloads = {}
    for kind in ("zip", "legacy"):
        for role in ("proof", "attack"):
            marker = tmp_path / f"{kind}-{role}-MARKER"
            path = tmp_path / f"{kind}-{role}.pth"
            if kind == "zip":  # torch.save's format, real weights next to the payload
                torch.save({"state_dict": dict(state), "hook": _RunsCode(marker)}, path)
            else:  # a plain pickle (torch's legacy format)
                with open(path, "wb") as handle:
                    pickle.dump({"hook": _RunsCode(marker)}, handle)
            payloads[kind, role] = (path, marker)

    # The payloads are live: an unsafe load does run them (here, in this process: a `touch`).
    loaders = {"zip": lambda path: torch.load(path, weights_only=False),
               "legacy": lambda path: pickle.loads(path.read_bytes())}
    for kind, load in loaders.items():
        path, marker = payloads[kind, "proof"]
        load(path)
        assert marker.exists(), f"the {kind} test payload did not run under an unsafe load"

    for kind in ("zip", "legacy"):
        path, marker = payloads[kind, "attack"]
        out = tmp_path / f"{kind}.ckpt"
        line = refused("--arch", "resnet18", "--pth", str(path), "--ckpt", str(out))
        assert "refused" in line and "weights_only" in line, line
        assert not marker.exists() and not out.exists()
    path, marker = payloads["zip", "attack"]
    line = one_line_error(run(PARITY + ["--arch", "resnet18", "--pth", str(path), "--ckpt", "none.ckpt",
                                        "--torch_model", "src.migration.torch_resnet:resnet18"]))
    assert "refused" in line and not marker.exists()


@needs_torch
def test_mismatched_arch_is_a_clear_error(torch_files, tmp_path):
    pth, _ = torch_files["resnet18"]
    out = tmp_path / "wrong.ckpt"
    line = one_line_error(run(CONVERT + ["--arch", "resnet50", "--pth", str(pth), "--ckpt", str(out)]))
    assert "does not fit resnet50" in line and "missing" in line and "shape mismatch" in line
    assert "module.layer1.0.conv1.weight [64, 64, 3, 3] vs [64, 64, 1, 1]" in line
    assert "pass --arch resnet18" in line
    assert not out.exists() and not list(tmp_path.iterdir())


def test_not_a_state_dict_is_a_clear_error(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "numbers.pth"
    torch.save({"epoch": 3, "lr": 0.1}, path)
    line = refused("--arch", "resnet18", "--pth", str(path), "--ckpt", str(tmp_path / "x"))
    assert "holds no state dict" in line and "epoch" in line


@needs_torch
def test_without_torch_the_command_says_how_to_install_it(torch_files, tmp_path):
    pth, _ = torch_files["resnet18"]
    code = ("import sys; sys.modules['torch'] = None\n"
            "from src.errors import run_cli; from src.migration.convert_torch import main; run_cli(main)")
    line = one_line_error(run([PYTHON, "-c", code, "--arch", "resnet18", "--pth", str(pth),
                               "--ckpt", str(tmp_path / "x.ckpt")]))
    assert "pip install torch==2.13.0+cpu" in line and "CPU build" in line


@needs_torch
def test_parity_without_torchvision_asks_for_torch_model(torch_files, converted):
    import importlib.util
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the default --torch_model applies")
    pth, _ = torch_files["resnet18"]
    ckpt, _ = converted["resnet18"]
    line = one_line_error(run(PARITY + ["--arch", "resnet18", "--pth", str(pth), "--ckpt", str(ckpt)]))
    assert "torchvision is not installed" in line and "--torch_model src.migration.torch_resnet:resnet18" in line


@needs_torch
def test_parity_locates_a_wrong_parameter(torch_files, converted, tmp_path):
    """A checkpoint whose layer3.0.bn1 statistics are swapped: exit 1, and the first stage over
    tolerance is layer3 (the earlier stages still agree)."""
    pth, _ = torch_files["resnet18"]
    ckpt, _ = converted["resnet18"]
    params = read_checkpoint(str(ckpt))
    entries = []
    for name, value in params.items():
        data = value.asnumpy()
        if name == "layer3.0.bn1.moving_variance":
            data = data[::-1].copy()
        entries.append({"name": name, "data": Tensor(data)})
    broken = tmp_path / "broken.ckpt"
    ms.save_checkpoint(entries, str(broken))
    result = run(PARITY + ["--arch", "resnet18", "--pth", str(pth), "--ckpt", str(broken), "--image_size", "64",
                           "--torch_model", "src.migration.torch_resnet:resnet18"])
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    report = last_json(result.stdout)
    assert report["ok"] is False
    assert all(report["stages"][s]["rel_diff"] < 1e-4 for s in ("stem", "layer1", "layer2"))
    assert report["stages"]["layer3"]["rel_diff"] > 1e-2
    assert "first stage over rel" in result.stderr and "layer3" in result.stderr
