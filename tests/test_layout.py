"""The layout of src/: import directions one way, no circles, few modules at the top (README, "Layout")."""
import ast
from pathlib import Path
from typing import Dict, Set

REPO = Path(__file__).resolve().parents[1]
# Every script at the top: run, never imported (what two of them share lives in src/ or tools/).
ENTRY_POINTS = {"train", "eval", "export", "predict", "fine_tune", "benchmark", "train_parity"}
BUILDING_BLOCKS = {"src.errors", "src.files", "src.device", "src.openmp", "src.cpu", "src.collective"}
LEAF_FACES = {"src.resnet", "src.training.loss", "src.training.lr_schedule"}   # faces that sub-packages may use
COMPOSING_FACES = {"src.config", "src.dataset"}   # the config and the input pipeline: entry points and composers
# The modules that build a run's parts from its config, for the entry points (the only others that
# read the config or compose the input pipeline).
COMPOSERS = {"src.runtime", "src.training.factory", "src.training.resume", "src.training.loop",
             "src.deploy.exporting", "src.migration.zoo_fine_tune", "src.migration.dumped_batches",
             "src.migration.learning", "src.migration.nonfinite_replay", "src.migration.train_sides",
             "src.migration.train_steps"}
# Sub-packages below a leaf face (src.resnet builds its convolutions with src.cpu_layers): they
# import building blocks only.
LEAF_PACKAGES = {"src.cpu_layers"}


def within(name: str, packages) -> bool:
    """Whether module `name` is one of `packages` or inside one."""
    return any(name == package or name.startswith(package + ".") for package in packages)


def in_leaf_package(name: str) -> bool:
    return within(name, LEAF_PACKAGES)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: Set[str]) -> Set[str]:
    """Project modules `path` imports anywhere in its body (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known or name.split(".")[0] in ENTRY_POINTS)
    return found


def import_graph() -> Dict[str, Set[str]]:
    paths = {module_name(p): p for p in (REPO / "src").rglob("*.py")}
    known = set(paths)
    return {name: imported_modules(path, known) - {name} for name, path in paths.items()}


def test_every_top_level_script_is_a_named_entry_point():
    assert {p.stem for p in REPO.glob("*.py")} == ENTRY_POINTS


def test_nothing_imports_an_entry_point():
    """Not the library, the tools, the tests or another entry point: they run them as processes."""
    files = [*REPO.glob("*.py"), *(REPO / "src").rglob("*.py"), *(REPO / "tools").rglob("*.py"),
             *(REPO / "tests").rglob("*.py")]
    for path in files:
        imported = {name.split(".")[0] for name in imported_modules(path, set())}
        assert not imported & ENTRY_POINTS, f"{path.relative_to(REPO)} imports {sorted(imported & ENTRY_POINTS)}"


def test_src_top_level_keeps_the_faces_and_at_most_12_modules():
    top = sorted(p.name for p in (REPO / "src").glob("*.py"))
    assert len(top) <= 12, top
    for face in ("dataset.py", "resnet.py", "runtime.py"):
        assert face in top
    packages = sorted(p.parent.name for p in (REPO / "src").glob("*/__init__.py"))
    assert packages == ["compression", "config", "cpu_layers", "data", "deploy", "evaluation", "migration",
                        "training"]


def test_imports_go_one_way():
    graph = import_graph()
    for module, imports in graph.items():
        assert not {name for name in imports if name.split(".")[0] in ENTRY_POINTS}, module
        if not within(module, COMPOSING_FACES | COMPOSERS):
            faces = {name for name in imports if within(name, COMPOSING_FACES)}
            assert not faces, f"{module} imports {faces}"
            assert not imports & COMPOSERS, f"{module} imports {imports & COMPOSERS}"
        if module in BUILDING_BLOCKS | LEAF_FACES or in_leaf_package(module):
            below = {name for name in imports if name != "src" and not in_leaf_package(name)}
            assert below <= BUILDING_BLOCKS, f"{module} imports {below - BUILDING_BLOCKS}"
        if module in BUILDING_BLOCKS:
            assert not any(in_leaf_package(name) for name in imports), module


# Sub-packages in layers: a module imports its own layer and those below, never one above (the
# input pipeline knows nothing of deployment, deployment nothing of training, ...).
SUBPACKAGE_LAYERS = {"src.config": 0, "src.cpu_layers": 0, "src.data": 0, "src.compression": 1, "src.deploy": 1,
                     "src.evaluation": 1, "src.training": 2, "src.migration": 3}


def layer_of(module: str) -> int:
    package = ".".join(module.split(".")[:2])
    return SUBPACKAGE_LAYERS.get(package, -1)


def test_sub_packages_import_only_their_layer_and_below():
    packages = {p.parent.name for p in (REPO / "src").glob("*/__init__.py")}
    assert {f"src.{name}" for name in packages} == set(SUBPACKAGE_LAYERS)
    for module, imports in import_graph().items():
        if layer_of(module) < 0:
            continue
        upward = {name for name in imports if layer_of(name) > layer_of(module)}
        assert not upward, f"{module} imports {upward} from a layer above it"


def test_src_data_holds_what_training_runs():
    """Every module of src/data is reached from the input pipeline (src.dataset), or makes data
    (the generators and the MindRecord converter); the reference the fidelity tests compare
    against lives with the PyTorch-side references in src/migration."""
    graph = import_graph()
    reached, stack = set(), ["src.dataset"]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in reached:
                reached.add(target)
                stack.append(target)
    makers = {"src.data.sample_data", "src.data.digits_data", "src.data.photo_data", "src.data.mindrecord"}
    assert {m for m in graph if m.startswith("src.data.")} - reached <= makers
    assert "src.migration.augment_reference" in graph


def test_no_import_cycles():
    graph = import_graph()
    state: Dict[str, int] = {}   # 1 on the current path, 2 done

    def visit(module, path):
        state[module] = 1
        for target in graph.get(module, ()):
            assert state.get(target) != 1, " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(state) == len(graph) > 25
