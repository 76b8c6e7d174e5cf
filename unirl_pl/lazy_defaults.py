"""Typed class defaults for the signatures LightningCLI reads: jsonargparse's lazy instances, made cheaply.

``jsonargparse.lazy_instance`` finds the module that calls it with ``inspect.stack()``, which resolves every
frame on the stack to its module; during an import that stack is deep and each unresolved frame scans every
loaded module, so one call took 0.5 s once diffusers was loaded (7 calls: about 2 s of every CLI start).
:func:`lazy_default` builds the same lazy instance from the caller's frame alone.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

from jsonargparse.typing import _LazyInitBaseClass

T = TypeVar("T")


def lazy_default(class_type: type[T], **kwargs: Any) -> T:
    """What ``jsonargparse.lazy_instance(class_type, **kwargs)`` returns when called where this is called: an
    instance of ``LazyInstance_<name>`` (a subclass of ``class_type``, kept on the calling module so that it
    pickles by name) whose ``__init__`` runs at its first method call, and which jsonargparse reads as
    ``class_type`` with ``kwargs``."""
    module = sys.modules[sys._getframe(1).f_globals["__name__"]]
    name = f"LazyInstance_{class_type.__name__}"
    lazy_class = getattr(module, name, None)
    if lazy_class is None:
        doc = f"Class for lazy instances of {class_type}"
        lazy_class = type(name, (_LazyInitBaseClass, class_type), {"__doc__": doc, "__module__": module.__name__})
        setattr(module, name, lazy_class)
    return lazy_class(class_type, kwargs)
