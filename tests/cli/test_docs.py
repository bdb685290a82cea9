"""The docs stay true to the code and short where they must be.

* Every option of every command (read from its own `--help`) is named in the part of the docs
  that documents that command: docs/usage.md's section for train, eval, plot and bench,
  docs/datasets.md for `data`. Every option of `train` (declared once, in TrainConfig) is
  named in docs/usage.md's `train` section.
* docs/env.md's switch table lists exactly the DPTRAIN_* variables the code reads (and the
  ones the test suite reads), and no page names a switch that no longer exists.
* Relative links between the docs point at files (and headings) that exist.
* README.md stays under 250 lines and BENCHMARKS.md under 300.
"""
import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

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


def switches_read_by_the_code() -> set:
    """DPTRAIN_* names anywhere in the package's source, and those the test suite reads from
    the environment itself."""
    found = set()
    for path in (ROOT / "dptrain").rglob("*.py"):
        found |= set(re.findall(r"\bDPTRAIN_[A-Z0-9_]+\b", path.read_text()))
    for path in (ROOT / "tests").rglob("*.py"):
        found |= set(re.findall(r"environ(?:\.get\(|\[)\s*[\"'](DPTRAIN_[A-Z0-9_]+)",
                                path.read_text()))
    return found


def switch_table() -> dict:
    """docs/env.md's table: switch -> its kind."""
    rows = re.findall(r"^\| `(DPTRAIN_[A-Z0-9_]+)` \| [^|]+ \| ([^|]+?) \|", ENV.read_text(), re.M)
    return dict(rows)


def test_the_switch_table_lists_exactly_the_switches_read():
    table, read = set(switch_table()), switches_read_by_the_code()
    assert read, "no DPTRAIN_* switch found in the code"
    assert sorted(read - table) == [], "switches read by the code that docs/env.md does not list"
    assert sorted(table - read) == [], "switches docs/env.md lists that no code reads"


def test_every_switch_has_a_kind():
    kinds = switch_table()
    assert set(kinds.values()) <= {"user", "A/B", "test"}, kinds
    for name, kind in kinds.items():
        if name.startswith("DPTRAIN_TEST_"):
            assert kind == "test", name


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_switch_that_is_gone(page):
    named = set(re.findall(r"\bDPTRAIN_[A-Z0-9_]+\b", page.read_text()))
    assert sorted(named - switches_read_by_the_code()) == []


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
