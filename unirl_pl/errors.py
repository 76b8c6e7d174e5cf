"""The errors a user's bad input raises, wherever it is found: a file that is not what it should be
(:class:`InputError`), a configuration the CLI refuses (:class:`ConfigError`).

Configuration mistakes found while the CLI parses and instantiates are already one line and exit 2;
some inputs are only read later, when the models are built (a pipeline folder's ``model_index.json``,
a shipped asset checked against its manifest). Raising :class:`InputError` there lets the CLI say
those in one line and exit 2 too, instead of a traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """A bad input file or folder, worded for the user (names the file, and the line where there is one).

    The CLI prints its message as one line and exits with status 2, during parsing or while running.
    """


class ConfigError(Exception):
    """A configuration mistake, already worded for the user: the CLI (and ``plan``) prints it on one line and
    exits with status 2.

    Not a ``ValueError``: the CLI turns the library's ``ValueError``s into this one, which must not be taken
    for one of them and wrapped again.
    """
