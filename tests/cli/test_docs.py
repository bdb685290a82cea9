"""The README stays true to the code: every option of `train` (declared once, in TrainConfig)
and every DPTRAIN_* environment switch the code reads is documented there."""
import re
from pathlib import Path

from dptrain.run.config import flag, options

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_train_option_is_in_the_readme():
    missing = [flag(f) for f in options() if flag(f) not in README]
    assert missing == [], f"train options the README never names: {missing}"


def test_every_option_declares_its_help_and_group():
    for f in options():
        assert f.metadata.get("help") and f.metadata.get("group"), f.name


def switches_read_by_the_code() -> set:
    found = set()
    for path in (ROOT / "dptrain").rglob("*.py"):
        found |= set(re.findall(r"\bDPTRAIN_[A-Z0-9_]+\b", path.read_text()))
    return found


def test_the_switch_table_lists_exactly_the_switches_read():
    section = README[README.index("### Environment switches"):]
    section = section[:section.index("\n#")]
    table = set(re.findall(r"^\| `(DPTRAIN_[A-Z0-9_]+)` \|", section, re.M))
    assert table == switches_read_by_the_code()
