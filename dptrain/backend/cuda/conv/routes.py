"""Route tables: each pass of a convolution tries its routes in order, and the first that
does not refuse the geometry plans it.

A Route has a name, `refuses(geometry)` (why it cannot take the pass, a short phrase, or
None) and `plan(geometry)` (the launcher: a plan, run(...) with `.kernel`). A refusal says
why in words, so explain() can list, for a shape, the routes passed over and the one that
takes it (tests, and a one-line debug print through describe()).

DPTRAIN_TEST_ROUTES_OFF=name,name (switches.py) refuses the routes of those names in every
pass that has one, so the tests can run the fallback kernels on a GPU that the faster route
would take (the fallbacks are what non-Hopper GPUs and the shapes a fast route refuses run).
It is read when a plan is made: clear the plan cache (gemm.clear_plans) after changing it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dptrain import switches

# Names the injector may refuse outside the route tables: gemm.py's routes, the tiled
# reduce of backward-weight on wgmma (bwdw_wgmma.reducer), the TMA kernel's resident
# weights (conv/wgmma.py's resident) and the weights reordered ahead (conv/ahead.py).
OTHER_NAMES = ("gemm_wgmma", "gemm_wgmma_splitk", "gemm_thin", "bwdw_reduce_tiled",
               "wgmma_resident", "weights_ahead")


@dataclass(frozen=True)
class Route:
    name: str
    refuses: Callable  # (geometry) -> why not, or None
    plan: Callable  # (geometry) -> a plan


def routes_off() -> frozenset:
    """The routes DPTRAIN_TEST_ROUTES_OFF names (comma-separated, blanks ignored)."""
    text = switches.value("TEST_ROUTES_OFF", "")
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def refused(name: str) -> bool:
    """Whether DPTRAIN_TEST_ROUTES_OFF names route `name`."""
    return name in routes_off()


def check_names(tables) -> None:
    """Raise on a name in DPTRAIN_TEST_ROUTES_OFF that no route of `tables` (nor
    OTHER_NAMES) has: a test that turns off a route that is not there tests nothing."""
    known = {r.name for table in tables for r in table} | set(OTHER_NAMES)
    unknown = sorted(routes_off() - known)
    if unknown:
        raise ValueError(f"{switches.var('TEST_ROUTES_OFF')}: no route named "
                         f"{', '.join(unknown)} (routes: {', '.join(sorted(known))})")


def refusal(route: Route, g):
    """Why `route` does not take geometry g, or None."""
    if refused(route.name):
        return f"turned off by {switches.var('TEST_ROUTES_OFF')}"
    return route.refuses(g)


def first(table, g) -> Route:
    """The first route of `table` that takes g (the last route of a table takes any)."""
    for route in table:
        if refusal(route, g) is None:
            return route
    raise ValueError(f"cuda.conv2d: no route takes {g} (turned off by "
                     f"{switches.var('TEST_ROUTES_OFF')}?)")


def choose(table, g):
    """The plan of the first route of `table` that takes g."""
    return first(table, g).plan(g)


def explain(table, g) -> list[tuple[str, str | None]]:
    """[(route name, why it refuses g)] in table order, up to the route that takes g (its
    reason None)."""
    rows = []
    for route in table:
        why = refusal(route, g)
        rows.append((route.name, why))
        if why is None:
            break
    return rows
