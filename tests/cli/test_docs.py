"""The docs stay true to the code and short where they must be.

* Every option of every command (read from its own `--help`) is named in the part of the docs
  that documents that command: docs/usage.md's section for train, eval, plot and bench,
  docs/datasets.md for `data`. Every option of `train` (declared once, in TrainConfig) is
  named in docs/usage.md's `train` section.
* docs/env.md's switch table is dptrain/switches.py's declarations; every DPTRAIN_* name the
  code, the tests, the scripts or a page uses is declared there, every declared switch is
  read, and only through dptrain.switches.
* Relative links between the docs point at files (and headings) that exist.
* README.md stays under 250 lines and BENCHMARKS.md under 300.
"""
import ast
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

from dptrain import switches
from dptrain.cli.commands import COMMANDS
from dptrain.run.config import flag, options

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
USAGE = DOCS / "usage.md"
DATASETS = DOCS / "datasets.md"
ENV = DOCS / "env.md"

# command line -> (the page that documents it, the heading of its section there, or None for
# the whole page)
COMMAND_DOCS = {
    ("train",): (USAGE, "train"),
    ("eval",): (USAGE, "eval"),
    ("plot",): (USAGE, "plot"),
    ("bench", "ops"): (USAGE, "Benchmarks"),
    ("bench", "train"): (USAGE, "Benchmarks"),
    ("bench", "comm"): (USAGE, "Benchmarks"),
    ("bench", "startup"): (USAGE, "Benchmarks"),
    ("bench", "data"): (USAGE, "Benchmarks"),
    ("data", "pack"): (DATASETS, None),
    ("data", "info"): (DATASETS, None),
    ("data", "synth"): (DATASETS, None),
}
# The pages whose prose must name only switches that exist (history/ keeps dated records).
CURRENT_PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]


def section(path: Path, heading) -> str:
    """The text of `path` under the level-2 heading `heading` (to the next one), or all of it."""
    text = path.read_text()
    if heading is None:
        return text
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{path.relative_to(ROOT)} has no section '## {heading}'"
    return match.group(1)


def help_text(command) -> str:
    """What `python -m dptrain COMMAND --help` prints, run in this process."""
    out = io.StringIO()
    module = importlib.import_module(COMMANDS[command[0]][0])
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main([*command[1:], "--help"])
    return out.getvalue()


def options_in_usage(help_output: str) -> set:
    """The options a parser's usage lines list (from `usage:` to the first blank line)."""
    usage = help_output[help_output.index("usage:"):].split("\n\n", 1)[0]
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", usage)) - {"--help"}


def undocumented(names, text: str) -> list:
    """The names in `names` that `text` never mentions as a whole word."""
    return sorted(n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text))


@pytest.mark.parametrize("command", list(COMMAND_DOCS), ids=" ".join)
def test_every_option_of_every_command_is_documented(command):
    names = options_in_usage(help_text(command))
    assert names, f"no options found in `{' '.join(command)} --help`"
    page, heading = COMMAND_DOCS[command]
    missing = undocumented(names, section(page, heading))
    assert missing == [], (f"`{' '.join(command)}` options that {page.relative_to(ROOT)} "
                           f"({heading or 'the whole page'}) never names: {missing}")


def test_every_command_has_its_docs():
    documented = {c[0] for c in COMMAND_DOCS}
    assert documented == set(COMMANDS), "a command without a row in COMMAND_DOCS"


def test_every_train_option_is_in_the_usage_page():
    missing = undocumented([flag(f) for f in options()], section(USAGE, "train"))
    assert missing == [], f"train options docs/usage.md never names: {missing}"


def test_the_option_check_bites():
    """An option named only inside a longer one, or not at all, counts as undocumented."""
    assert undocumented(["--batch", "--seed", "--lr"], "`--batch-size` and `--seed`") == [
        "--batch", "--lr"]
    usage = "usage: x [-h] [--foo F]\n         [--bar-baz]\n\nThe --ignored flag of prose."
    assert options_in_usage(usage) == {"--foo", "--bar-baz"}


def test_every_option_declares_its_help_and_group():
    for f in options():
        assert f.metadata.get("help") and f.metadata.get("group"), f.name


# Where DPTRAIN_* names may appear: the package, its kernels, the tests and the scripts
SOURCES = [ROOT / d for d in ("dptrain", "kernels", "tests", "scaling", "datasets", "examples",
                              "launch")]
CODE = {".py", ".cu", ".cuh"}
SKIPPED = {Path(switches.__file__).resolve(), Path(__file__).resolve()}
DECLARED = {s.var for s in switches.SWITCHES.values()}
NAME = r"\bDPTRAIN_[A-Z0-9_]*[A-Z0-9]\b"  # a whole name, not a prefix (DPTRAIN_TEST_*)
READ_CALL = r"switches\.(?:on|value|var)\(\s*[\"']([A-Z0-9_]+)[\"']"  # -> the switch's name


def source_files(roots) -> dict:
    """{path from the folder holding the roots: text} of the Python and CUDA files under
    `roots`, and the launch scripts; dptrain/switches.py (the declarations) and this file
    (whose examples break the rules) aside."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and (path.suffix in CODE or root.name == "launch") \
                    and path.resolve() not in SKIPPED:
                found[path.relative_to(root.parent).as_posix()] = path.read_text()
    return found


def names_used(files) -> dict:
    """Every DPTRAIN_* name the files name, in code or prose, and every switch a
    ``switches.on/value/var("NAME")`` or ``switches.override(NAME=...)`` call names ->
    the first file naming it."""
    found = {}
    for where, text in files.items():
        names = set(re.findall(NAME, text))
        names |= {switches.PREFIX + n for n in re.findall(READ_CALL, text)}
        for args in re.findall(r"switches\.override\(([^)]*)\)", text):
            names |= {switches.PREFIX + n for n in re.findall(r"\b([A-Z0-9_]+)\s*=", args)}
        for name in names:
            found.setdefault(name, where)
    return found


def reads_around_switches(files) -> list:
    """Where a file reads a DPTRAIN_* variable itself: the package's string literals that are
    a variable's whole name (a constant, a key, a read), and anyone's environ/getenv with
    one."""
    found = []
    for where, text in files.items():
        if where.startswith("dptrain/"):
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"DPTRAIN_[A-Z0-9_]+", node.value):
                    found.append(f"{where}:{node.lineno}: {node.value!r}")
        for m in re.finditer(r"(?:environ|getenv)\b\s*(?:\.get)?\s*[\[(]\s*[\"'](DPTRAIN_\w+)",
                             text):
            found.append(f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}")
    return found


def switch_table_on_the_page() -> str:
    """docs/env.md's table: from its header row to the first blank line."""
    text = ENV.read_text()
    start = text.index("| variable |")
    return text[start:text.index("\n\n", start)]


def test_the_switch_table_is_the_declarations():
    assert switch_table_on_the_page() == switches.table(), (
        "docs/env.md's table differs from dptrain/switches.py's declarations; print the "
        "table with: python -c 'from dptrain import switches; print(switches.table())'")


def test_every_switch_the_code_names_is_declared():
    used = names_used(source_files(SOURCES))
    assert {n: f for n, f in used.items() if n not in DECLARED} == {}, (
        "DPTRAIN_* names (-> a file naming it) that dptrain/switches.py does not declare")


def test_every_declared_switch_is_read():
    """A switch no code reads is gone: delete its declaration (and its row)."""
    read = set()
    for text in source_files([ROOT / "dptrain", ROOT / "tests" / "helpers"]).values():
        read |= set(re.findall(READ_CALL, text))
    assert sorted(set(switches.SWITCHES) - read) == []


def test_each_read_fits_its_switch():
    """on() for on/off switches, value() for valued ones: checked here, since many reads run
    only on a GPU (where the other would raise)."""
    wrong = []
    for where, text in source_files([ROOT / "dptrain", ROOT / "tests" / "helpers"]).items():
        for reader, name in re.findall(r"switches\.(on|value)\(\s*[\"']([A-Z0-9_]+)", text):
            s = switches.SWITCHES.get(name)
            if s is not None and (reader == "on") != s.on_off:
                wrong.append(f"{where}: switches.{reader}({name!r})")
    assert wrong == []


def test_switches_are_read_only_through_switches():
    assert reads_around_switches(source_files(SOURCES)) == []


def test_the_switch_checks_bite(tmp_path):
    """An undeclared switch read through the module, a constant holding a variable's name in
    the package, an environ read in a test and a renamed injector are each caught."""
    (tmp_path / "dptrain").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "dptrain" / "a.py").write_text(
        '"""Mentions DPTRAIN_FUSE."""\nX = "DPTRAIN_NOPE"\n'
        'def f():\n    return switches.on("GONE") or switches.value("CACHE")\n')
    (tmp_path / "tests" / "t.py").write_text(
        'import os\nos.environ.get("DPTRAIN_FAULT")\nwith switches.override(OLD="0"): pass\n')
    files = source_files([tmp_path / "dptrain", tmp_path / "tests"])
    used = names_used(files)
    assert sorted(n for n in used if n not in DECLARED) == [
        "DPTRAIN_FAULT", "DPTRAIN_GONE", "DPTRAIN_NOPE", "DPTRAIN_OLD"]
    assert reads_around_switches(files) == ["dptrain/a.py:2: 'DPTRAIN_NOPE'",
                                            "tests/t.py:2: DPTRAIN_FAULT"]


def test_every_switch_has_a_kind():
    kinds = [s.kind for s in switches.SWITCHES.values()]
    assert set(kinds) <= {"user", "A/B", "test"}, kinds
    for s in switches.SWITCHES.values():
        assert (s.kind == "test") == s.name.startswith("TEST_"), s.var
    assert kinds.count("user") <= 8, "more than 8 switches a user needs: fold some away"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_switch_that_is_gone(page):
    named = set(re.findall(NAME, page.read_text()))
    assert sorted(named - DECLARED) == []


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def links(path: Path):
    """(target, anchor) of every relative Markdown link in `path`."""
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        yield file, anchor


@pytest.mark.parametrize("page", [*CURRENT_PAGES, *sorted((DOCS / "history").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_what_exists(page):
    broken = []
    for file, anchor in links(page):
        target = (page.parent / file).resolve() if file else page
        if not target.exists():
            broken.append(file)
        elif anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(f"{file}#{anchor}")
    assert broken == []


@pytest.mark.parametrize("name, most", [("README.md", 250), ("BENCHMARKS.md", 300)])
def test_the_front_pages_stay_short(name, most):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines < most, f"{name} has {lines} lines: keep it under {most} (details go to docs/)"
