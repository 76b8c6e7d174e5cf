"""Save a resumable checkpoint when the run is told to stop (SIGTERM, SIGUSR1), then exit with status 143.

Schedulers preempt with a signal and a grace period: Kubernetes and most clouds send SIGTERM, SLURM
sends SIGTERM (or, with ``--signal=USR1@<seconds>``, SIGUSR1 ahead of the time limit). The handler only
records the signal; the checkpoint is written at the end of the training step (or validation) that
is running, the points where ``ModelCheckpoint`` saves, so ``--ckpt_path=<dir>/last.ckpt`` (or
``--ckpt_path=last``) resumes exactly.

What Lightning 2.6 does by itself (``_SignalConnector``, outside SLURM auto-requeue): after
``on_fit_start`` it installs a SIGTERM handler that sets ``trainer.received_sigterm`` and then calls
the handler it found; the loops then raise ``SIGTERMException`` (a ``SystemExit`` with status 0) at
the end of the step, or after the current batch of a validation, and write no checkpoint. SIGUSR1
it leaves alone. So this callback installs its handlers at ``on_fit_start`` (Lightning chains them)
and takes SIGTERM over for the training itself at ``on_train_start``: a signal during validation lets
the validation finish and saves at its end instead of aborting it with nothing saved. Under SLURM with
``auto_requeue`` Lightning owns the requeue signal (SIGUSR1: it saves an HPC checkpoint and requeues),
and this callback leaves that signal alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from unirl_pl.checkpoint import remove_stale_tmp

EXIT_CODE = 143  # 128 + SIGTERM: what a shell reports for a process that SIGTERM ended


def _log(message: str) -> None:
    print(f"[PreemptionCheckpoint] {message}", file=sys.stderr, flush=True)


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM/SIGUSR1: finish the running training step, save ``<dirpath>/<filename>``, exit with 143.

    The checkpoint is a full resumable one (``trainer.save_checkpoint``; the CLI's ``AtomicCheckpointIO``
    writes it atomically). It is written at the end of the training step during which the signal came,
    or at the end of the validation it interrupted, and the process exits right after
    (``SystemExit(143)``). Before the exit the saved step's metrics reach the loggers, ``self.log`` ones
    included (the loop logs those after the hook the exit leaves from), and the loggers are saved, so
    this run's metrics plus the resumed run's hold every step once. With several processes the ranks
    agree every step (one small all-reduce) so they save and exit together even if only one got the
    signal. A signal during the last step lets the run end normally (status 0). A signal before
    training starts (model loading, sanity check) is acted on after the first step.

    Args:
        dirpath: Folder of the checkpoint; None uses the first ``ModelCheckpoint``'s folder, else
            ``<log_dir>/checkpoints`` (``<default_root_dir>/checkpoints`` without a logger).
        filename: Checkpoint file name; ``last.ckpt`` lets ``--ckpt_path=last`` find it when it is in
            a ``ModelCheckpoint``'s folder.
        signals: Names of the signals to act on.
    """

    def __init__(
        self, dirpath: str | None = None, filename: str = "last.ckpt", signals: list[str] | None = None
    ) -> None:
        names = ["SIGTERM", "SIGUSR1"] if signals is None else list(signals)
        unknown = [n for n in names if not isinstance(getattr(signal, str(n), None), signal.Signals)]
        if unknown or not names:
            raise ValueError(f"signals must be signal names such as SIGTERM or SIGUSR1, got {names}")
        if not filename.endswith(".ckpt") or "/" in filename or "\\" in filename:
            raise ValueError(f"filename must be a file name ending in .ckpt, got {filename!r}")
        self.dirpath, self.filename = dirpath, filename
        self.signals = [signal.Signals[n] for n in names]
        self.received: signal.Signals | None = None
        self.saved_path: Path | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._active = False
        self._handler = self._on_signal  # one bound method, so "is it still ours" is an identity check

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
        if not self._active:
            # Still installed after the fit (Lightning's teardown restores what it found, which was this
            # handler): behave as the handler this one replaced.
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        if self.received is None:
            self.received = signal.Signals(signum)
            _log(f"received {self.received.name}: a checkpoint is saved at the end of this step")
        if callable(previous):  # a handler installed before the fit (not Lightning's: see on_train_start)
            previous(signum, frame)

    def _signals(self, trainer: pl.Trainer) -> list[signal.Signals]:
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            requeue = environment.requeue_signal or signal.SIGUSR1
            return [s for s in self.signals if s != requeue]  # Lightning's SLURM handler saves and requeues
        return self.signals

    @staticmethod
    def _main_thread() -> bool:
        return threading.current_thread() is threading.main_thread()

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received, self.saved_path, self._previous = None, None, {}
        if trainer.is_global_zero:
            removed = remove_stale_tmp(self._folder(trainer))
            if removed:
                _log(f"removed temp files of interrupted checkpoint writes: {[p.name for p in removed]}")
        if not self._main_thread():
            _log("the fit does not run on the main thread: no signal handlers installed")
            return
        for signum in self._signals(trainer):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        self._active = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registered its SIGTERM handler after on_fit_start, chaining this one. Take the signal
        # over so Lightning does not abort a validation (and exit 0) without a checkpoint.
        if self._active and self._main_thread():
            for signum in self._previous:
                if signal.getsignal(signum) is not self._handler:
                    signal.signal(signum, self._handler)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
            return  # the last step: the run ends normally anyway
        self._save_if_signalled(trainer, in_training_step=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._save_if_signalled(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SystemExit) and self.received is not None and exception.code in (None, 0):
            # Lightning's own SIGTERM stop (a signal before training started) exits 0; a preempted run
            # must not look finished to its scheduler.
            exception.code = EXIT_CODE
        self._restore_after_lightning(trainer)
        self._uninstall()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    # ------------------------------------------------------------------ actions
    def _save_if_signalled(self, trainer: pl.Trainer, in_training_step: bool = False) -> None:
        if self.saved_path is not None:
            return
        signalled = self.received is not None
        if trainer.world_size > 1:
            signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        if not signalled:
            return
        path = self._folder(trainer) / self.filename
        trainer.save_checkpoint(path)
        self.saved_path = path
        if trainer.is_global_zero:
            _log(f"saved {path} at step {trainer.global_step}; resume with --ckpt_path={path}")
        self._flush_metrics(trainer, in_training_step)
        # Right away: the checkpoint is safe, and the next step's rollout would only eat the grace period.
        raise SystemExit(EXIT_CODE)

    @staticmethod
    def _flush_metrics(trainer: pl.Trainer, in_training_step: bool) -> None:
        """Hand the loggers what the loop would log after this hook, which the exit skips: in a training
        step, the step's ``self.log`` values (``reward/mean``); the resume starts at the next step.

        After the checkpoint, so a failing logger costs a row, never the checkpoint or the exit status.
        """
        if not getattr(trainer, "loggers", None):
            return
        try:
            if in_training_step:
                # What _TrainingEpochLoop.advance calls after on_train_batch_end, at the same logger step
                # (_batches_that_stepped is incremented only after it). Values are synced when logged: no collective.
                trainer._logger_connector.update_train_step_metrics()
            for logger in trainer.loggers:
                logger.save()
        except Exception as err:  # the checkpoint is safe: exit as planned
            _log(f"could not log the saved step's metrics: {type(err).__name__}: {err}")

    def _restore_after_lightning(self, trainer: pl.Trainer) -> None:
        # On an exception Lightning restores the handlers it found at its start (this callback's) after
        # on_exception: make it restore the ones this callback found, so no stale handler stays installed.
        originals = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
        if not self._active or not isinstance(originals, dict):
            return
        for signum, previous in self._previous.items():
            if originals.get(signum) is self._handler and previous is not None:
                originals[signum] = previous

    def _uninstall(self) -> None:
        if not self._active:
            return
        self._active = False
        if not self._main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) is self._handler and previous is not None:
                signal.signal(signum, previous)

    def _folder(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        for callback in trainer.callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"
