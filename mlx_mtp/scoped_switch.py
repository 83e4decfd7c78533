"""A module-level switch that is on while a ``with`` body is open.

mlx-lm's forward passes carry no context, so a layer that must behave differently inside a verify
asks a module-level scope whether one is open (``row_exact_layers.verifying``,
``compiled_layers.compiling``). Bodies nest: the scope stays on until the outermost one closes.
"""

from __future__ import annotations

from contextlib import contextmanager


class ScopedSwitch:
    def __init__(self):
        self.depth = 0  # open bodies

    @contextmanager
    def open(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextmanager
    def suspended(self):
        """Off inside this body, whatever is open around it."""
        saved, self.depth = self.depth, 0
        try:
            yield
        finally:
            self.depth = saved

    def __bool__(self) -> bool:
        return self.depth > 0
