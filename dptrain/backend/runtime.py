"""What every backend's runtime shares: calls that are the same sequence of the runtime's own
primitives on any device (see ``RUNTIME`` in this package for the whole contract)."""
from __future__ import annotations

import contextlib


class RuntimeBase:
    def order(self, waiter, signaller):
        """`waiter` waits for all the work issued so far on `signaller`."""
        self.wait(self.record(signaller), waiter)

    @contextlib.contextmanager
    def precision_scope(self, name: str):
        """``with runtime.precision_scope("fp32"): ...``: `name` inside, the previous after."""
        old = self.precision
        self.set_precision(name)
        try:
            yield
        finally:
            self.set_precision(old)
