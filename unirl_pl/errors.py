"""The error a user's bad input raises, wherever it is found: a file that is not what it should be.

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
