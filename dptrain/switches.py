"""Environment switches: every ``DPTRAIN_*`` variable dptrain reads, declared once, here.

Each switch has a name, a default, a kind and one line of doc; docs/env.md's table is
``table()`` (a test keeps them equal, and fails on a ``DPTRAIN_*`` name the code or the tests
use without declaring it here). Switches are read through this module, at call time, so a
test's ``monkeypatch.setenv`` or ``override`` takes effect at once:

    switches.on("FUSE")                  an on/off switch: on unless its value is "0"
                                         (blanks ignored); unset, its default
    switches.value("CACHE", default)     a valued switch: its text as set ("" included),
                                         else `default`; `env=` reads another mapping
    switches.var("CACHE")                its variable, "DPTRAIN_CACHE" (for messages and the
                                         environments of child processes)
    with switches.override(FUSE="0"):    set for a block (None: unset), then restored

Kinds: "user", a setting a user may need; "A/B", turns a kernel route or an optimisation off
(or forces it) to measure what it gives; "test", a test-only injector of faults or topology,
named DPTRAIN_TEST_*, never set in real runs. A switch exists while someone needs it.

The package face: any layer may import it, and it imports nothing but the standard library.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

PREFIX = "DPTRAIN_"
KINDS = ("user", "A/B", "test")
ON_OFF = ("on", "off")  # the defaults of on/off switches; any other default: a valued one


@dataclass(frozen=True)
class Switch:
    name: str  # without the prefix: "FUSE" is DPTRAIN_FUSE
    default: str  # what holds while it is unset, as docs/env.md says it ("on": an on/off one)
    kind: str  # one of KINDS
    doc: str  # one line (Markdown): what it does

    @property
    def var(self) -> str:
        return PREFIX + self.name

    @property
    def on_off(self) -> bool:
        return self.default in ON_OFF


def _declare(*rows) -> dict:
    switches = {}
    for row in rows:
        s = Switch(*row)
        assert s.kind in KINDS, s
        assert (s.kind == "test") == s.name.startswith("TEST_"), s
        assert s.name not in switches, s
        switches[s.name] = s
    return switches


SWITCHES = _declare(
    ("CACHE", "`~/.cache/dptrain`", "user",
     "where generated and decoded datasets are cached (`--cache-dir` wins)"),
    ("KERNEL_DIR", "the package's kernels", "user", "where the `.cu` files are read from"),
    ("COMPILE_WORKERS", "one per core", "user",
     "threads that build kernels before the first step (a positive integer)"),
    ("RENDEZVOUS", "`$SLURM_SUBMIT_DIR`, else the working directory", "user",
     "srun without MPI: a directory every node sees for the rendezvous file, or `host:port` "
     "for rank 0 to listen on"),
    ("RENDEZVOUS_TIMEOUT", "300", "user", "seconds srun's ranks wait for each other to meet"),
    ("FUSE", "on", "A/B",
     "`0`: no fused layers (ReLU + max-pool and Linear + ReLU in `Sequential`; batch norm's "
     "residual add and ReLU in ResNet's blocks, and its stem's max-pool)"),
    ("SHADOW", "on", "A/B",
     "`0`: no 16-bit parameter shadow in bf16/fp16; fp32 all-gather and a cast in every layer "
     "(same bits)"),
    ("TEST_SIMULATED_HOSTS", "unset", "test",
     "`a,a,b,b` names rank r's host, to play several hosts on one"),
    ("TEST_FAULT", "unset", "test", "`RANK:STEP`: that rank raises after that step"),
    ("TEST_STALL", "unset", "test", "`RANK:STEP:SECONDS`: that rank sleeps after that step"),
    ("TEST_KILL", "unset", "test", "`RANK:STEP`: that rank SIGKILLs itself after that step"),
    ("TEST_OVERFLOW", "unset", "test",
     "`RANK:STEP` (STEP >= 2): that rank's fp16 gradients overflow at that step"),
    ("TEST_ROUTES_OFF", "unset", "test",
     "`name,name`: the kernel routes of those names refuse every shape, so the fallback "
     "kernels run (names: `dptrain/backend/cuda/conv/passes.py`'s route tables, `gemm_wgmma`, "
     "`gemm_wgmma_splitk`, `gemm_thin`, `bwdw_reduce_tiled`)"),
    ("TEST_LAUNCHER", "`auto`", "test",
     "read by the test suite (`tests/helpers/mpilaunch.py`): `mpirun`, `mpiexec` or `srun` "
     "picks the launcher the multi-process tests use"),
)


def declared(name: str) -> Switch:
    """The declaration of switch `name` (without the prefix); KeyError if there is none."""
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"no switch {PREFIX}{name} is declared in dptrain/switches.py") from None


def var(name: str) -> str:
    """The environment variable of switch `name`: var("FUSE") == "DPTRAIN_FUSE"."""
    return declared(name).var


def on(name: str) -> bool:
    """An on/off switch: on unless its value is "0" (blanks ignored); unset, its default."""
    s = declared(name)
    if not s.on_off:
        raise TypeError(f"{s.var} is a valued switch: read it with switches.value")
    text = os.environ.get(s.var)
    return s.default == "on" if text is None else text.strip() != "0"


def value(name: str, default=None, env=None):
    """A valued switch's text as set (an empty one included), else `default`; from `env` (a
    mapping) where given, else the process's environment."""
    s = declared(name)
    if s.on_off:
        raise TypeError(f"{s.var} is an on/off switch: read it with switches.on")
    return (os.environ if env is None else env).get(s.var, default)


@contextlib.contextmanager
def override(**values):
    """Set switches for the block and restore them after: ``override(FUSE="0")``; None
    unsets one, True / False are "1" / "0". Through the environment, so child processes
    started inside see them too."""
    saved = {}
    try:
        for name, v in values.items():
            key = var(name)
            saved.setdefault(key, os.environ.get(key))
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = ("1" if v else "0") if isinstance(v, bool) else str(v)
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def table() -> str:
    """docs/env.md's table of the switches, in declaration order."""
    rows = ["| variable | default | kind | what it does |", "|---|---|---|---|"]
    rows += [f"| `{s.var}` | {s.default} | {s.kind} | {s.doc} |" for s in SWITCHES.values()]
    return "\n".join(rows)
