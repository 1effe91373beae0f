"""A module attribute replaced by a wrapper of it, and put back (the integrations' hooks).

Dask and distributed expose no hook for what :mod:`.local` and
:mod:`.distributed.tracebacks` change, so each replaces one function of theirs
with a wrapper that calls the function it replaced (:attr:`Patch.original`).
"""

from __future__ import annotations

from typing import Any


class Patch:
    """``module.name`` (an attribute of a module or a class) replaced by ``replacement``
    between :meth:`install` and :meth:`uninstall`.

    Idempotent both ways. :attr:`original` is what ``replacement`` wraps: the
    function found at :meth:`install` (Dask's own, or another wrapper of it),
    and the one there at creation until then.
    """

    __slots__ = ("module", "name", "replacement", "original")

    def __init__(self, module: Any, name: str, replacement: Any):
        self.module = module
        self.name = name
        self.replacement = replacement
        self.original = getattr(module, name)

    def install(self) -> None:
        """Put :attr:`replacement` in place, keeping what it replaces as :attr:`original`."""
        current = getattr(self.module, self.name)
        if current is not self.replacement:
            self.original = current
            setattr(self.module, self.name, self.replacement)

    def uninstall(self) -> None:
        """Put :attr:`original` back, if :attr:`replacement` is still in place."""
        if getattr(self.module, self.name) is self.replacement:
            setattr(self.module, self.name, self.original)
