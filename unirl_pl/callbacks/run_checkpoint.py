"""Checkpoints that keep to their run's folder, and ``--ckpt_path last`` that finds the newest run.

Lightning's ``ModelCheckpoint`` with a fixed ``dirpath`` shared by every run of a recipe collects
``last.ckpt``, ``last-v1.ckpt`` ... and ``epoch=0-step=10-v2.ckpt`` from different runs in one folder.
Without ``dirpath`` each run writes into its logger's version folder
(``runs/<name>/version_N/checkpoints/``), but then ``--ckpt_path last`` only looks into the new
run's (empty) folder. :class:`RunCheckpoint` keeps the per-run folder and makes ``last`` look
through the run name's version folders instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from unirl_pl.errors import InputError

VERSION = re.compile(r"version_(\d+)")


def newest_last_checkpoints(run_root: str | Path, last_name: str = "last", extension: str = ".ckpt") -> set[str]:
    """The ``last*.ckpt`` files of the highest-numbered ``version_N`` under ``run_root`` that has any.

    The version number, not the file time, says which run is newest: a copied or touched folder keeps
    its order. ``last-v1.ckpt`` (what Lightning writes next to an existing ``last.ckpt``) counts as well;
    among one folder's files Lightning takes the newest by time. An empty set when no run has one.
    """
    root = Path(run_root)
    if not root.is_dir():
        return set()
    pattern = re.compile(rf"^{re.escape(last_name)}(-v?\d+)?$")
    versions = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := VERSION.fullmatch(p.name))),
        reverse=True,
    )
    for _, folder in versions:
        found = {
            str(p)
            for p in (folder / "checkpoints").glob(f"*{extension}")
            if p.is_file() and pattern.match(p.name[: -len(extension)])
        }
        if found:
            return found
    return set()


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``--ckpt_path last`` resumes the newest run of the same logger name.

    Without ``dirpath`` (the shipped recipes) checkpoints go to ``<save_dir>/<name>/version_N/checkpoints/``
    next to that run's ``metrics.csv``, so two runs never share a folder. ``--ckpt_path last`` then
    takes ``last.ckpt`` of the highest-numbered ``version_*`` under ``<save_dir>/<name>`` that has one
    (the run being started has none yet); the resumed run writes into its own new version folder.
    With ``dirpath`` given, it behaves as ``ModelCheckpoint``. Every argument is ``ModelCheckpoint``'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # setup() fills dirpath in from the logger; remember whether the user chose the folder.
        self.user_dirpath = self.dirpath is not None
        # Where the recipe's runs are when this command runs without its logger (validate, predict): the
        # CLI sets it from the recipe's logger settings.
        self.run_root: Path | None = None

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        if self.user_dirpath:
            return super()._find_last_checkpoints(trainer)
        if not trainer.loggers or trainer.loggers[0].save_dir is None:
            if self.run_root is not None:
                return newest_last_checkpoints(self.run_root, self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION)
            if trainer.state.fn != "fit":
                # validate/predict run without the recipe's logger: no run folder to search, and scoring
                # the untrained weights instead would pass unnoticed.
                raise InputError(
                    "--ckpt_path=last looks for the newest run in the logger's folder, and this command has "
                    "no logger: give the file, e.g. --ckpt_path=runs/<name>/version_<N>/checkpoints/last.ckpt"
                )
            return super()._find_last_checkpoints(trainer)
        logger = trainer.loggers[0]
        return newest_last_checkpoints(
            Path(logger.save_dir) / str(logger.name), self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION
        )
