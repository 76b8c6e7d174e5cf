"""``python -m unirl_pl {fit,validate,predict,ablate,bench,export,plan,serve-reward}``: one command line.

``fit``, ``validate`` and ``predict`` are one LightningCLI for every recipe. The tools (``ablate``,
``bench``, ``export``, ``plan``, ``serve-reward``) are dispatched to their modules before LightningCLI
parses anything (``python -m unirl_pl.bench`` and the other module forms stay as aliases), and
``python -m unirl_pl --help`` lists them all without loading torch.

A recipe names its LightningModule and DataModule by ``class_path`` (the RL trainer
:class:`unirl_pl.module.UniRLModule` with :class:`unirl_pl.data.PromptDataModule`, or a pretraining
module), so RL and pretraining run through the same entry point; dotted overrides may skip
``init_args`` (``--model.mode=prompt_only``). Optimizers are per expert, so LightningCLI's
single-optimizer auto-configuration is off. Unknown or mistyped keys are errors.

What the command line adds to LightningCLI:

- on a CPU run (no GPU visible, or ``trainer.accelerator: cpu``) one intra-op thread per process unless
  ``OMP_NUM_THREADS`` is set (:mod:`unirl_pl.threads`);
- input paths of a recipe resolve relative to the recipe or the package (:mod:`unirl_pl.paths`);
- only ``fit`` creates a logger version folder and saves ``config.yaml``; ``validate`` and
  ``predict`` run without a logger unless ``--trainer.logger`` is given on the command line;
- a configuration error (parsing, instantiation, a missing input file) and a bad input file found
  while running (:class:`~unirl_pl.errors.InputError`) print one short message and exit with status 2;
  ``JSONARGPARSE_DEBUG=1`` shows the traceback instead.
- :func:`parse_config`: a command line's configuration, parsed and defaults filled, with nothing built: how
  ``plan`` reads a recipe, so the constructors hold the only defaults (the files themselves are read in
  :mod:`unirl_pl.recipes`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO

from unirl_pl.callbacks.run_checkpoint import RunCheckpoint
from unirl_pl.checkpoint import AtomicCheckpointIO, gather_trainable_on_save
from unirl_pl.commands import PROG, run_before_lightning
from unirl_pl.errors import ConfigError, InputError
from unirl_pl.option_hints import option_homes, refused_option
from unirl_pl.paths import resolve_inputs, search_roots
from unirl_pl.recipes import config_paths, load_recipe
from unirl_pl.threads import set_threads

_PACKAGE = Path(__file__).resolve().parent
_UNION = "Does not validate against any of the Union subtypes"
_CONFIG_ERRORS = (argparse.ArgumentError, ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError)


def config_error_message(err: BaseException) -> str:
    """The innermost meaningful message of ``err``'s cause chain, prefixed by the config key it concerns.

    jsonargparse wraps a class's own error (``samples_per_prompt must be >= 2``) in union dumps
    (``Does not validate against any of the Union subtypes ... Given value: Namespace(...)``) and
    reports the key as ``Parser key "model"`` then ``Parser key "mode"``; this keeps the key path
    (``model.mode``) and the deepest message that is not a dump.
    """
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        # As Python's traceback does: past `raise ... from None` the replaced error is not shown.
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    keys: list[str] = []
    for exc in chain:
        found = re.match(r'\s*Parser key "([^"]+)"', str(exc))
        if found and (not keys or keys[-1] != found.group(1)):
            keys.append(found.group(1))
    texts = [_message_text(exc) for exc in chain]
    message = next((t for t in reversed(texts) if t and _UNION not in t), "")
    # A message the project wrote around a library's error ("install the extra ...") is the one to show, with
    # the library's after it: the outermost one raised in unirl_pl/ whose text is not a dump.
    ours = next((i for i, exc in enumerate(chain) if _raised_here(exc) and texts[i] and _UNION not in texts[i]), None)
    if ours is not None:
        message = texts[ours]
        cause = next((t for t in reversed(texts[ours + 1 :]) if t and _UNION not in t), "")
        if cause and cause not in message:
            message = f"{message} (cause: {cause})"
    message = message or " ".join(str(err).split())
    key = ".".join(keys)
    return f"{key}: {message}" if key and not message.startswith(key) else message


def _message_text(exc: BaseException) -> str:
    """``exc``'s message on one line, without jsonargparse's ``Parser key "..."`` header lines."""
    lines = [
        line.strip()
        for line in _unquote(str(exc).strip()).splitlines()
        if not re.match(r'\s*(Parser key "[^"]+"|Problem with given class_path .*):\s*$', line)
    ]
    return " ".join(line for line in lines if line)


def _raised_here(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by this package's code (its innermost traceback frame is in unirl_pl/)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)


def _unquote(text: str) -> str:
    """A ``KeyError``'s message without the quotes its ``str()`` adds."""
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


def fsdp1_refusal(strategy: Any) -> str | None:
    """Why ``trainer.strategy`` (a name, or a ``class_path`` namespace) cannot run here, or None when it can.

    Lightning's ``FSDPStrategy`` (FSDP1, names ``fsdp``/``fsdp_cpu_offload``) needs a GPU and does not
    support manual optimization; checked before the trainer is built, so the user sees this, not Lightning's error.
    """
    name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "") or ""
    if "fsdp" in str(name).lower() and "ModelParallel" not in str(name):
        return (
            "FSDPStrategy (FSDP1) is not supported: it needs a GPU and Lightning does not support it with manual "
            "optimization. Use FSDP2 instead: trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy "
            "(see recipes/fsdp.yaml)."
        )
    return None


class UniRLParser(LightningArgumentParser):
    """LightningCLI's parser named as the user runs it: jsonargparse builds the parser of a ``--model.help``
    answer as ``type(parser)(...)`` without a ``prog``, which argparse would take from ``sys.argv[0]``
    (``__main__.py``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prog", PROG)
        # The parsers jsonargparse builds this way read a class's own keys (--model.rollout.micro_batch=4): without
        # this, argparse would take that prefix for micro_batch_size, as main refuses at the top level.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class UniRLCLI(LightningCLI):
    """LightningCLI with the project's module and data, and checks Lightning itself does not make.

    Args:
        friendly_errors: Turn configuration errors into :class:`ConfigError` with a short message
            (``main`` with ``run=True``); otherwise they propagate unchanged.
        parse_only: Stop once the configuration is parsed, raising :class:`_Parsed` with it (:func:`parse_config`).
    """

    def __init__(self, *args: Any, friendly_errors: bool = False, parse_only: bool = False, **kwargs: Any) -> None:
        self.friendly_errors = friendly_errors
        self.parse_only = parse_only
        self.raw_args: list[str] = []
        self._run_root: Path | None = None  # the recipe's runs, for --ckpt_path last without a logger
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # No `test`: the RL module has no test step; `validate` scores held-out prompts.
        subcommands = dict(LightningCLI.subcommands())
        subcommands.pop("test", None)
        return subcommands

    @contextlib.contextmanager
    def _config_phase(self) -> Iterator[None]:
        try:
            yield
        except _CONFIG_ERRORS as err:
            if not self.friendly_errors:
                raise
            raise ConfigError(config_error_message(err)) from err

    def parse_arguments(self, parser: Any, args: Any) -> None:
        given = [] if isinstance(args, dict) else sys.argv[1:] if args is None else args
        self.raw_args = [a for a in given if isinstance(a, str)]
        with self._config_phase():
            super().parse_arguments(parser, args)
        if self.parse_only:
            # LightningCLI's constructor goes on to seed the process's RNGs (seed_everything) and to build the
            # trainer, the model and the data; a caller that wants the settings only leaves it here.
            raise _Parsed(self.config)

    def _parse_ckpt_path(self) -> None:
        with self._config_phase():
            super()._parse_ckpt_path()

    def _user_set(self, key: str) -> bool:
        """Whether the command line (not a recipe) gives ``key`` itself (``--trainer.logger=...``, not a sub-key)."""
        return any(a == f"--{key}" or a.startswith((f"--{key}=", f"--{key}+=")) for a in self.raw_args)

    def before_instantiate_classes(self) -> None:
        with self._config_phase():
            config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
            refusal = fsdp1_refusal(config.get("trainer", {}).get("strategy"))
            if refusal:
                raise ValueError(refusal)
            recipes = [str(p) for p in (config.get("config") or []) if p is not None]
            resolve_inputs(config, search_roots(recipes))
            if self.subcommand in ("validate", "predict") and not self._user_set("trainer.logger"):
                # Only fit makes a run: evaluating a checkpoint must not add an empty version folder. Where
                # the recipe's runs are is kept, so --ckpt_path last still finds the newest one.
                self._run_root = recipe_run_root(config["trainer"].get("logger"))
                config["trainer"]["logger"] = False
            if config.get("trainer", {}).get("enable_progress_bar") is False:
                # Lightning refuses a progress-bar callback next to enable_progress_bar=false with a traceback;
                # the user asked for no bar, so the recipe's bar goes.
                callbacks = config["trainer"].get("callbacks") or []
                config["trainer"]["callbacks"] = [c for c in callbacks if not _is_progress_bar(c)]

    def instantiate_classes(self) -> None:
        with self._config_phase():
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any):
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.accelerator, CPUAccelerator):
            # A CPU run on a machine with a GPU: main's set_threads saw the GPU and left torch's default; one
            # thread as on any CPU run (a no-op when OMP_NUM_THREADS is set). Before fit, so DDP ranks inherit it.
            set_threads(cpu=True)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # A crash while writing must leave the previous checkpoint usable; a user-chosen IO is kept.
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        # FSDP2: a checkpoint gathers the trained (LoRA) tensors only, not the frozen base weights it drops.
        gather_trainable_on_save(trainer.strategy)
        if self.subcommand not in (None, "fit"):
            # config.yaml describes a run; without a logger it would land in the current directory.
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, SaveConfigCallback)]
        for callback in trainer.callbacks:
            if isinstance(callback, RunCheckpoint) and self._run_root is not None:
                callback.run_root = self._run_root
        return trainer


def recipe_run_root(logger: Any) -> Path | None:
    """``<save_dir>/<name>`` of the recipe's (first) logger when it is given with both, else None."""
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    init = logger.get("init_args") if hasattr(logger, "get") else None
    save_dir = init.get("save_dir") if hasattr(init, "get") else None
    name = init.get("name") if hasattr(init, "get") else None
    return Path(str(save_dir)) / str(name) if save_dir and name else None


def _is_progress_bar(callback: Any) -> bool:
    """Whether a configured callback (a class_path entry or an instance) is a Lightning progress bar."""
    from lightning.pytorch.callbacks import ProgressBar

    if isinstance(callback, ProgressBar):
        return True
    class_path = getattr(callback, "class_path", None)
    if not isinstance(class_path, str):
        return False
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, ProgressBar)


def check_recipe_files(args: list[str]) -> None:
    """Raise :class:`ConfigError` naming the file (and line) of a ``--config`` that is missing, not UTF-8 or not YAML.

    jsonargparse reports a YAML syntax error against ``"<unicode string>"``, without the file, and a file
    that is not UTF-8 (or is binary) ends in a codec traceback.
    """
    for path in config_paths(args):
        load_recipe(path)


class _Parsed(Exception):
    """How a parse-only :class:`UniRLCLI` hands its configuration out of LightningCLI's constructor, which
    parses, seeds and instantiates in one call with no hook between parsing and seeding."""

    def __init__(self, config: Namespace) -> None:
        super().__init__("configuration parsed")
        self.config = config


def parse_config(args: list[str]) -> Namespace:
    """The configuration ``fit`` runs ``args`` with: the ``--config`` recipes and dotted overrides (later wins)
    through the CLI's own parser, every key they leave out at its constructor's default. Nothing is
    instantiated and no seed is set. The parser is the one without subcommands (``main(args, run=False)``'s):
    ``fit``'s keys less its ``ckpt_path``.

    This is how a command other than ``fit``/``validate``/``predict`` reads a recipe's settings (``plan``), so
    defaults live in the constructors only. Raises :class:`ConfigError` worded as ``fit`` words it (with
    ``JSONARGPARSE_DEBUG=1``, the library's error as is).
    """
    friendly = not os.environ.get("JSONARGPARSE_DEBUG")
    if friendly:
        check_recipe_files(args)
    try:
        with warnings.catch_warnings():
            # LightningCLI warns when it is given args while sys.argv holds others: the caller's own command line.
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            _build_cli(args, run=False, friendly=friendly, parse_only=True)
    except _Parsed as parsed:
        return parsed.config
    raise AssertionError("a parse-only UniRLCLI hands its configuration out by raising _Parsed")


def config_refusal(err: ConfigError, args: list[str], command: str) -> str:
    """What a command prints for a configuration error (two lines, or three with a hint): the message,
    where a refused option is accepted in the recipes of ``args`` (or close spellings), and the help to read.
    ``command`` is the command line's start (``python -m unirl_pl fit``)."""
    name = refused_option(str(err))
    homes = option_homes(args, name) if name else []
    exact = all(h.rsplit(".", 1)[-1] == name for h in homes)
    where = f"\n{f'{name!r} is accepted at' if exact else 'did you mean'}: {', '.join(homes)}" if homes else ""
    return f"error: {err}{where}\nThe options: {command} --help"


def quiet_library_warnings() -> None:
    """Drop the libraries' warnings about what this project does on purpose or cannot change."""
    # Frozen components (text encoder, VAE) stay in eval mode on purpose; Lightning warns about it.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    # The module builds each experience from the prompt batch in its on_after_batch_transfer, by design.
    warnings.filterwarnings("ignore", message=r"You have overridden `on_after_batch_transfer` in `LightningModule`")
    # Lightning's own pytree helper builds torch's deprecated LeafSpec at the first step of every fit.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )


def _build_cli(
    args: list[str] | dict[str, Any] | None, run: bool, friendly: bool, parse_only: bool = False
) -> UniRLCLI:
    """The project's LightningCLI over ``args``; ``friendly``: configuration errors as :class:`ConfigError`."""
    # No abbreviations: argparse would take a typo such as --trainer.max_step=3 for --trainer.max_steps.
    parser_kwargs: dict[str, Any] = {"prog": PROG, "allow_abbrev": False}
    each: dict[str, Any] = {"allow_abbrev": False}
    if friendly:
        parser_kwargs["exit_on_error"] = each["exit_on_error"] = False
    parser_kwargs.update({name: dict(each) for name in UniRLCLI.subcommands()})
    return UniRLCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        parser_class=UniRLParser,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        args=args,
        run=run,
        friendly_errors=friendly,
        parse_only=parse_only,
    )


def main(args: list[str] | dict[str, Any] | None = None, run: bool = True) -> UniRLCLI:
    """Run the CLI (``args`` as on the command line; None reads ``sys.argv``; a mapping is one recipe's
    content, read already, with no command line: ``export`` passes the model and data of a saved run).

    With ``run`` (a subcommand is run), a configuration error, and a bad input file
    (:class:`~unirl_pl.errors.InputError`) wherever it is found, print one short message to stderr and
    exit with status 2; other errors while the subcommand runs propagate. ``run=False`` only parses and
    instantiates, and raises every error as is.
    """
    given = [] if isinstance(args, dict) else list(sys.argv[1:] if args is None else args)
    handled = run_before_lightning(given)
    if handled is not None:
        raise SystemExit(handled)
    set_threads()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_library_warnings()
    friendly = run and not os.environ.get("JSONARGPARSE_DEBUG")
    try:
        if friendly:
            check_recipe_files(given)
        return _build_cli(args, run=run, friendly=friendly)
    except ConfigError as err:
        subcommand = next((f" {a}" for a in given if a in UniRLCLI.subcommands()), "")
        print(config_refusal(err, given, f"{PROG}{subcommand}"), file=sys.stderr)
        raise SystemExit(2) from None
    except InputError as err:
        if not friendly:
            raise
        # A bad input file found while the run builds its models (after parsing): as one line too.
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
