"""A name -> class registry whose entries register themselves from the modules of one package.

`nats.attention.registry` (attention cores) and `nats.cache.registry` (KV-cache policies) are instances:
adding a method is adding one module with the registry's decorator; unknown names fail with the known ones.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable


class Registry:
    def __init__(self, kind: str, package: str, skip: set[str], hint: str):
        self.kind = kind  # e.g. "attention" (used in messages)
        self.package = package  # the package whose modules hold the entries
        self.skip = set(skip)  # its modules that hold none
        self.hint = hint  # how to fix an unknown name, e.g. "model.attention.name=..."
        self.entries: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register `cls` under `name` (and set `cls.name`)."""

        def deco(cls: type) -> type:
            if name in self.entries and self.entries[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self.entries[name]} and {cls})")
            cls.name = name
            self.entries[name] = cls
            return cls

        return deco

    def import_all(self) -> None:
        """Import every module of the package so that their decorators run."""
        pkg = importlib.import_module(self.package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            if mod.name not in self.skip:
                importlib.import_module(f"{self.package}.{mod.name}")

    def names(self) -> list[str]:
        self.import_all()
        return sorted(self.entries)

    def get(self, name: str) -> type:
        self.import_all()
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} {name!r}: choose one of {sorted(self.entries)} ({self.hint})")
        return self.entries[name]
