"""dptrain.switches: how a switch is read (at call time), and the scoped override tests use.
(docs/env.md against the declarations, and the code against both: test_docs.py.)"""
import os

import pytest

from dptrain import switches
from dptrain.distributed import slurm
from dptrain.nn import fusion
from dptrain.run import amp


def environ(name):
    """What the environment holds for switch `name` (None: unset)."""
    return os.environ.get(switches.var(name))


@pytest.mark.parametrize("text, on", [(None, True), ("0", False), (" 0\n", False),
                                      ("1", True), ("", True), ("no", True), ("00", True)])
def test_an_on_off_switch_is_on_unless_its_value_is_0(text, on, monkeypatch):
    if text is None:
        monkeypatch.delenv("DPTRAIN_FUSE", raising=False)
    else:
        monkeypatch.setenv("DPTRAIN_FUSE", text)
    assert switches.on("FUSE") is on
    assert fusion.enabled() is on  # its reader reads it now, not at import


def test_a_valued_switch_is_its_text_as_set(monkeypatch):
    monkeypatch.delenv("DPTRAIN_TEST_ROUTES_OFF", raising=False)
    assert switches.value("TEST_ROUTES_OFF") is None
    assert switches.value("TEST_ROUTES_OFF", "") == ""
    for text in ("", "0", "x3", " x3,nhwc"):  # kept as set: each reader parses its own values
        monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", text)
        assert switches.value("TEST_ROUTES_OFF", "auto") == text
    env = {"DPTRAIN_RENDEZVOUS_TIMEOUT": "7"}  # another mapping than the environment
    assert switches.value("RENDEZVOUS_TIMEOUT", env=env) == "7"
    assert slurm.rendezvous_timeout(env) == 7.0
    assert slurm.rendezvous_timeout({}) == slurm.DEFAULT_RENDEZVOUS_TIMEOUT


def test_a_switch_is_read_its_own_way_and_must_be_declared():
    with pytest.raises(TypeError, match="DPTRAIN_CACHE is a valued switch"):
        switches.on("CACHE")
    with pytest.raises(TypeError, match="DPTRAIN_FUSE is an on/off switch"):
        switches.value("FUSE")
    gone = "FAULT"  # now TEST_FAULT (spelled so that test_docs.py's scan passes it by)
    for read in (switches.on, switches.value, switches.var):
        with pytest.raises(KeyError, match=f"no switch {switches.PREFIX}{gone} is declared"):
            read(gone)
    assert switches.var("TEST_FAULT") == "DPTRAIN_TEST_FAULT"


def test_override_sets_switches_for_a_block_then_restores_them(monkeypatch):
    monkeypatch.setenv("DPTRAIN_SHADOW", "1")
    monkeypatch.delenv("DPTRAIN_FUSE", raising=False)
    monkeypatch.setenv("DPTRAIN_CACHE", "/somewhere")
    with switches.override(SHADOW="0", FUSE=False, CACHE=None):
        assert amp.shadow_dtype("bf16") is None and not fusion.enabled()
        assert environ("FUSE") == "0" and environ("CACHE") is None
        with switches.override(FUSE=True):
            assert fusion.enabled()
        assert not fusion.enabled()
    assert environ("SHADOW") == "1" and environ("FUSE") is None
    assert environ("CACHE") == "/somewhere"
    assert amp.shadow_dtype("bf16") is not None and fusion.enabled()


def test_override_restores_after_an_error_and_refuses_undeclared_names(monkeypatch):
    monkeypatch.delenv("DPTRAIN_FUSE", raising=False)
    with pytest.raises(RuntimeError), switches.override(FUSE="0"):
        raise RuntimeError
    assert environ("FUSE") is None
    with pytest.raises(KeyError), switches.override(FUSE="0", **{"NO" + "PE": "1"}):
        pass
    assert environ("FUSE") is None


def test_the_table_has_a_row_per_switch():
    rows = switches.table().splitlines()
    assert len(rows) == 2 + len(switches.SWITCHES)
    assert rows[2].startswith("| `DPTRAIN_CACHE` | `~/.cache/dptrain` | user | ")
