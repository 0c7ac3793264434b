"""The README and docs/ stay true: links and anchors resolve, the commands they name answer --help,
and the configuration reference is the one the schema generates."""
import re
import shlex
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

from conftest import PYTHON, REPO, run
from src.config import format_reference

PAGES = ([REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
         + sorted((REPO / "docs" / "results").glob("*.md")))
# the dated measurements: one page per day, listed by the folder's index (which the README links)
RESULTS_INDEX = REPO / "docs" / "results" / "README.md"
# pages whose content moved, kept so that old links resolve: each only links to its new place
MOVED = {REPO / "docs" / "results_log.md": RESULTS_INDEX}
# placeholders the docs write in commands, and a value that runs here
PLACEHOLDERS = {"CONFIG": "config/sample_resnet18.yaml"}
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def without_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked out (links inside code are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCED.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> Set[str]:
    found: Set[str] = set()
    counts: Dict[str, int] = {}
    for line in FENCED.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            found.add(base if base not in counts else f"{base}-{counts[base]}")
            counts[base] = counts.get(base, 0) + 1
    return found


def links(page: Path) -> List[str]:
    return re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.name}: {broken}"


def linked_from(page: Path) -> Set[Path]:
    return {(page.parent / target.partition("#")[0]).resolve() for target in links(page)
            if not re.match(r"[a-z]+:", target)}


def test_every_docs_page_is_linked_from_the_readme():
    topics = [page for page in PAGES[1:] if page.parent == REPO / "docs" and page not in MOVED]
    linked = linked_from(REPO / "README.md")
    assert [page.name for page in topics + [RESULTS_INDEX] if page.resolve() not in linked] == []


def test_every_results_page_is_in_the_index():
    days = [page for page in PAGES if page.parent == RESULTS_INDEX.parent and page != RESULTS_INDEX]
    assert days, "docs/results/ holds no dated page"
    linked = linked_from(RESULTS_INDEX)
    assert [page.name for page in days if page.resolve() not in linked] == []


@pytest.mark.parametrize("page", sorted(MOVED), ids=lambda p: p.name)
def test_a_moved_page_only_points_to_its_new_place(page):
    assert linked_from(page) == {MOVED[page].resolve()}
    assert len(page.read_text().splitlines()) <= 5


def help_commands() -> List[Tuple[str, List[str]]]:
    """Every command the README and docs show with --help, ready to run here."""
    commands = {}
    for page in PAGES:
        for command in re.findall(r"`((?:python|bash) [^`\n]*--help)`", page.read_text()):
            args = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)]
            commands[command] = [PYTHON if args[0] == "python" else args[0]] + args[1:]
    return sorted(commands.items())


def test_docs_name_the_help_of_every_entry_point():
    named = " ".join(command for command, _ in help_commands())
    for entry in ("train.py", "eval.py", "export.py", "predict.py", "fine_tune.py", "benchmark.py",
                  "src.migration.convert_torch", "src.migration.parity", "run_standalone_train.sh",
                  "run_distribute_train.sh", "run_eval.sh"):
        assert entry in named, entry


@pytest.mark.slow
@pytest.mark.parametrize("command, args", help_commands(), ids=[c for c, _ in help_commands()])
def test_documented_help_runs(command, args):
    result = run(args, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower() and "Traceback" not in result.stderr


def test_config_reference_is_up_to_date():
    """docs/config_reference.md is what `python -m src.config --reference` prints from the schema
    (which fails when a key has no meaning)."""
    assert (REPO / "docs" / "config_reference.md").read_text() == format_reference(), (
        "regenerate: python -m src.config --reference > docs/config_reference.md")
