"""Name -> class registries of the rollout components (views, harnesses, policies).

Each component is a small Protocol; a class joins with ``@VIEWS.register("name")``. A run folder
stores a component as ``{"name": ..., "args": {...}}`` so a rerun rebuilds the same object.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownComponentError(ValueError):
    """A component name that no registry entry has (raised before any work)."""


class ComponentRegistry(Generic[T]):
    """A decorator registry of one kind of component (``kind`` is used in error messages)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: register under ``name`` (sets ``cls.name``). Raises ValueError on a duplicate name."""
        def deco(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._classes[name].__name__})")
            self._classes[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls
        return deco

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``. Raises UnknownComponentError listing the known names."""
        try:
            return self._classes[name]
        except KeyError:
            raise UnknownComponentError(f"unknown {self.kind} {name!r}; expected one of {self.names()}") from None

    def build(self, name: str, **args: Any) -> T:
        """``get(name)(**args)``; a bad argument raises TypeError naming the component."""
        cls = self.get(name)
        try:
            return cls(**args)
        except TypeError as err:
            raise TypeError(f"{self.kind} {name!r}: {err}") from None


VIEWS: ComponentRegistry[Any] = ComponentRegistry("view")
HARNESSES: ComponentRegistry[Any] = ComponentRegistry("harness")
POLICIES: ComponentRegistry[Any] = ComponentRegistry("policy")
