"""``lazy_default``: jsonargparse's lazy instance for a signature default, without its stack walk."""

from __future__ import annotations

import inspect
import sys

import pytest
from jsonargparse import lazy_instance

from unirl_pl.lazy_defaults import lazy_default


class Part:
    built = 0

    def __init__(self, width: int = 4) -> None:
        Part.built += 1
        self.width = width

    def size(self) -> int:
        return self.width


def test_lazy_default_is_the_lazy_instance_jsonargparse_makes():
    ours = lazy_default(Part, width=8)
    theirs = lazy_instance(Part, width=8)
    assert type(ours) is type(theirs), "the same class, kept on this module, as jsonargparse's"
    assert type(ours).__module__ == __name__ and sys.modules[__name__].LazyInstance_Part is type(ours)
    assert isinstance(ours, Part)
    assert ours.lazy_get_init_data().as_dict() == theirs.lazy_get_init_data().as_dict()
    assert ours.lazy_get_init_data().as_dict() == {"class_path": f"{__name__}.Part", "init_args": {"width": 8}}
    before = Part.built
    assert ours.size() == 8 and Part.built == before + 1, "__init__ runs at the first method call"


def test_lazy_default_does_not_walk_the_stack(monkeypatch):
    def walk(*args, **kwargs):
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", walk)
    assert lazy_default(Part).size() == 4
    with pytest.raises(AssertionError, match="inspect.stack"):
        lazy_instance(Part)


def test_the_cli_defaults_are_lazy_defaults():
    from unirl_pl.generators import ComponentGenerator
    from unirl_pl.module import UniRLModule

    default = inspect.signature(UniRLModule).parameters["generator"].default
    assert type(default).__name__ == "LazyInstance_ComponentGenerator" and isinstance(default, ComponentGenerator)
    assert type(default).__module__ == "unirl_pl.module"
