"""``RewardHackingMonitor``: reward hacking caught while it happens, from signals that move when a policy games
its reward (issue 42): image and refinement statistics against their own baselines, and gold rewards never
trained on that fall while the training reward rises. An alarm warns, stops the run with a resumable checkpoint,
or rolls the trainable weights back to the last checkpoint saved before it. The math is :mod:`unirl_pl.monitors`;
``docs/monitors.md`` says what each signal catches and how to read it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from unirl_pl.callbacks.rollback import checkpoint_folder, restore_trainable
from unirl_pl.metrics import log_step
from unirl_pl.monitors import Direction, baseline, crossed, gold_divergence, image_stats, refinement_stats
from unirl_pl.records import Experience
from unirl_pl.rewards import RewardTerm, WeightedSum

Action = Literal["warn", "stop", "rollback"]


@dataclass(frozen=True)
class Signal:
    """How one signal alarms: the way it moves under hacking and its default threshold (absolute or relative)."""

    direction: Direction
    threshold: float
    relative: bool


SIGNALS: dict[str, Signal] = {
    "dark_frac": Signal("up", 0.25, relative=False),
    "luminance": Signal("up", 0.15, relative=False),
    "blank_frac": Signal("up", 0.25, relative=False),
    "saturated_frac": Signal("up", 0.25, relative=False),
    "high_freq": Signal("up", 0.5, relative=True),
    "colourfulness": Signal("up", 1.0, relative=True),
    "diversity": Signal("down", 0.5, relative=True),
    "length": Signal("up", 1.0, relative=True),
    "distinct_2": Signal("down", 0.3, relative=False),
    "novel_share": Signal("up", 0.3, relative=False),
    "recurring_phrase": Signal("up", 0.4, relative=False),
}
IMAGE_SIGNALS = ("dark_frac", "luminance", "blank_frac", "saturated_frac", "high_freq", "colourfulness", "diversity")
REFINEMENT_SIGNALS = ("length", "distinct_2", "novel_share", "recurring_phrase")


@dataclass
class Alarm:
    """One alarm: the signal (``gold/<name>`` for a gold rule), the step, its value and baseline."""

    signal: str
    step: int
    value: float
    baseline: float

    def describe(self) -> str:
        return f"hack/{self.signal} at step {self.step}: {self.value:.4g} against baseline {self.baseline:.4g}"


def _log(message: str) -> None:
    print(f"[RewardHackingMonitor] {message}", file=sys.stderr, flush=True)


class RewardHackingMonitor(pl.Callback):
    """Log ``hack/<signal>`` every training step and ``hack/gold/<name>`` at every validation; alarm when a
    signal leaves its baseline or the gold rule fires, and act on the alarm.

    Each training step's rollout (its images, prompts, refinements and rewards) gives the image statistics
    (``hack/dark_frac``, ``luminance``, ``blank_frac``, ``saturated_frac``, ``high_freq``, ``colourfulness``,
    ``diversity`` within a prompt's group) and the refinement statistics (``hack/length``, ``distinct_2``,
    ``novel_share``, ``recurring_phrase``) of :mod:`unirl_pl.monitors`. A signal's baseline is its mean over the first
    ``baseline_steps`` steps this monitor sees; after that it alarms when it moves past the baseline by its
    threshold in the direction hacking moves it (``docs/monitors.md`` lists each default), once per excursion:
    it alarms again only after coming back. The gold rewards score the images validation already makes (its
    first batch, the one it returns); the gold rule alarms when, over the last ``window`` validations, the
    training reward's mean rose while a gold reward fell by more than ``gold_drop``. ``hack/alarms`` counts the
    alarms so far; the :class:`~unirl_pl.callbacks.RunSummary` lists each with its step. Baselines, histories and
    alarms are saved with the checkpoint and restored on resume.

    Args:
        image_stats: Compute the image statistics of each rollout.
        refinement_stats: Compute the refinement statistics of each rollout's refined prompts (skipped when no
            refiner runs).
        gold_rewards: Reward terms never trained on, as ``model.rewards`` takes them (a list of
            ``{reward: {class_path, init_args}, weight, name}`` or the short form name -> weight); each is logged
            as ``hack/gold/<name>`` and checked by the gold rule. None: no gold rewards.
        gold_reward_args: Short form only: gold reward name -> its keyword arguments.
        baseline_steps: Steps (from this monitor's first) whose mean is a signal's baseline; no alarm before.
        window: Validations the gold rule looks back over.
        gold_drop: How far a gold reward must fall over ``window`` validations (absolute) for the gold rule.
        thresholds: Per-signal threshold overrides (signal name -> threshold, in the signal's own absolute or
            relative unit); signals not named keep their defaults.
        action: ``warn`` logs a warning naming signal, step and values; ``stop`` saves a resumable checkpoint
            (``hack-stop-step<N>.ckpt`` in the run's checkpoint folder) and stops the run; ``rollback`` restores
            the trainable weights and optimizer states from the newest checkpoint saved before the alarm and
            continues (a warning when there is none).
    """

    def __init__(
        self,
        image_stats: bool = True,
        refinement_stats: bool = True,
        gold_rewards: list[RewardTerm] | dict[str, float] | None = None,
        gold_reward_args: dict[str, dict[str, Any]] | None = None,
        baseline_steps: int = 5,
        window: int = 3,
        gold_drop: float = 0.05,
        thresholds: dict[str, float] | None = None,
        action: Action = "warn",
    ) -> None:
        if baseline_steps < 1:
            raise ValueError(f"RewardHackingMonitor baseline_steps must be >= 1, got {baseline_steps}")
        if window < 1:
            raise ValueError(f"RewardHackingMonitor window must be >= 1, got {window}")
        if not gold_drop >= 0:
            raise ValueError(f"RewardHackingMonitor gold_drop must be >= 0, got {gold_drop}")
        if action not in ("warn", "stop", "rollback"):
            raise ValueError(f"RewardHackingMonitor action must be 'warn', 'stop' or 'rollback', got {action!r}")
        unknown = sorted(set(thresholds or {}) - set(SIGNALS))
        if unknown:
            raise ValueError(f"RewardHackingMonitor thresholds names unknown signals {unknown}; known: {list(SIGNALS)}")
        bad = {k: v for k, v in (thresholds or {}).items() if not (isinstance(v, int | float) and v >= 0)}
        if bad:
            raise ValueError(f"RewardHackingMonitor thresholds must be numbers >= 0, got {bad}")
        self.image_stats, self.refinement_stats = image_stats, refinement_stats
        self.gold = WeightedSum(gold_rewards, gold_reward_args) if gold_rewards else None
        self.baseline_steps, self.window, self.gold_drop, self.action = baseline_steps, window, gold_drop, action
        self.thresholds = {name: float((thresholds or {}).get(name, s.threshold)) for name, s in SIGNALS.items()}
        self.history: dict[str, list[float]] = {}  # the baseline steps' values
        self.baselines: dict[str, float] = {}
        self.active: list[str] = []  # signals past their threshold now (an alarm fires on entering)
        self.alarms: list[Alarm] = []
        self.train_rewards: list[float] = []  # this interval's training reward means (since the last validation)
        self.validations: list[dict[str, float]] = []  # per validation: train reward mean and each gold mean
        self.saved_path: Path | None = None  # the stop checkpoint
        self.restored_from: list[str] = []  # the checkpoints rollbacks restored
        self._gold_scores: dict[str, list[torch.Tensor]] = {}

    # ------------------------------------------------------------------ measuring
    def measure(self, exp: Experience) -> dict[str, float]:
        """The signals of one rollout, by name."""
        values: dict[str, float] = {}
        if self.image_stats and exp.images is not None:
            values |= image_stats(exp.images, groups=list(exp.prompts))
        if self.refinement_stats:
            pairs: dict[int, tuple[str, str]] = {}
            for i, (prompt, refined) in enumerate(zip(exp.prompts, exp.refined, strict=True)):
                if refined != prompt:  # the unrefined samples keep the prompt: nothing of the refiner's to read
                    pairs.setdefault(int(exp.text_index[i]), (prompt, refined))
            if pairs:
                prompts, refined = zip(*pairs.values(), strict=True)
                values |= refinement_stats(list(prompts), list(refined))
            else:  # nothing refined here: NaN (no reading), so every rank reduces the same keys
                values |= dict.fromkeys(REFINEMENT_SIGNALS, math.nan)
        return values

    def observe(self, values: dict[str, float], step: int) -> list[Alarm]:
        """Fold one step's ``values`` into the baselines; the alarms this step raises."""
        raised = []
        for name, value in values.items():
            if name not in self.baselines:
                self.history.setdefault(name, []).append(value)
                if len(self.history[name]) >= self.baseline_steps:
                    self.baselines[name] = baseline(self.history[name])
                continue
            signal, base = SIGNALS[name], self.baselines[name]
            if crossed(value, base, self.thresholds[name], signal.direction, signal.relative):
                if name not in self.active:
                    self.active.append(name)
                    raised.append(Alarm(name, step, value, base))
            elif name in self.active:
                self.active.remove(name)
        self.alarms += raised
        return raised

    def check_gold(self, train: float, gold: dict[str, float], step: int) -> list[Alarm]:
        """Add one validation's training reward mean and gold means; the gold-rule alarms this raises."""
        self.validations.append({"train": train, **gold})
        raised = []
        history = [v["train"] for v in self.validations]
        for name in gold:
            series = [v.get(name, math.nan) for v in self.validations]
            key = f"gold/{name}"
            if gold_divergence(history, series, self.window, self.gold_drop):
                if key not in self.active:
                    self.active.append(key)
                    raised.append(Alarm(key, step, series[-1], series[-self.window - 1]))
            elif key in self.active:
                self.active.remove(key)
        self.alarms += raised
        return raised

    # ------------------------------------------------------------------ hooks
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, Experience):
            return
        step = trainer.global_step - 1  # the metrics.csv row of this rollout, as the module logs it
        values = _mean_over_ranks(trainer, pl_module, self.measure(batch))
        rewards = batch.rewards.detach().double()
        self.train_rewards.append(float(rewards[torch.isfinite(rewards)].mean()) if len(rewards) else math.nan)
        raised = self.observe(values, step)
        metrics = {f"hack/{k}": v for k, v in values.items()} | {"hack/alarms": float(len(self.alarms))}
        log_step(trainer, metrics, step, pl_module.device, pooled=metrics)
        self.act(trainer, pl_module, raised)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.gold is None or trainer.sanity_checking or not isinstance(outputs, dict) or "images" not in outputs:
            return
        _, parts = self.gold(list(outputs["prompts"]), list(outputs["refined"]), outputs["images"])
        for name, scores in parts.items():
            self._gold_scores.setdefault(name, []).append(scores.detach().double().cpu())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.gold is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        gold = {name: float(torch.cat(s).nanmean()) for name, s in self._gold_scores.items()}
        gold = _mean_over_ranks(trainer, pl_module, gold)
        self._gold_scores = {}
        train = [v for v in self.train_rewards if math.isfinite(v)]
        train_mean = sum(train) / len(train) if train else math.nan
        self.train_rewards = []
        step = trainer.global_step
        raised = self.check_gold(train_mean, gold, step)
        metrics = {f"hack/gold/{k}": v for k, v in gold.items()} | {"hack/alarms": float(len(self.alarms))}
        log_step(trainer, metrics, step, pl_module.device, pooled=metrics)
        self.act(trainer, pl_module, raised)

    # ------------------------------------------------------------------ acting
    def act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, raised: list[Alarm]) -> None:
        """Do ``action`` for the alarms just raised (nothing when there are none)."""
        if not raised:
            return
        what = "; ".join(alarm.describe() for alarm in raised)
        if self.action == "warn":
            rank_zero_warn(f"RewardHackingMonitor: reward hacking suspected: {what}")
        elif self.action == "stop":
            path = checkpoint_folder(trainer) / f"hack-stop-step{raised[0].step}.ckpt"
            trainer.save_checkpoint(path)
            self.saved_path = path
            trainer.should_stop = True
            if trainer.is_global_zero:
                _log(f"stopping: reward hacking suspected: {what}; saved {path} (resume with --ckpt_path={path})")
        else:
            restored = restore_trainable(trainer, pl_module, before_step=trainer.global_step)
            if restored is None:
                rank_zero_warn(
                    f"RewardHackingMonitor: reward hacking suspected: {what}; no checkpoint saved before the alarm "
                    "to roll back to, training goes on"
                )
                return
            self.restored_from.append(str(restored))
            self.active = []  # the restored weights start a fresh excursion
            if trainer.is_global_zero:
                _log(f"rolled back to {restored}: reward hacking suspected: {what}")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "baselines": self.baselines,
            "active": self.active,
            "alarms": [asdict(a) for a in self.alarms],
            "train_rewards": self.train_rewards,
            "validations": self.validations,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state_dict.get("history", {}).items()}
        self.baselines = dict(state_dict.get("baselines", {}))
        self.active = list(state_dict.get("active", []))
        self.alarms = [Alarm(**a) for a in state_dict.get("alarms", [])]
        self.train_rewards = list(state_dict.get("train_rewards", []))
        self.validations = [dict(v) for v in state_dict.get("validations", [])]


def _mean_over_ranks(trainer: pl.Trainer, pl_module: pl.LightningModule, values: dict[str, float]) -> dict[str, float]:
    """``values`` averaged over ranks, each over the ranks where it is not NaN (every rank then acts on the same
    numbers; NaN where no rank measured it); as they are on one process."""
    if trainer.world_size == 1 or not values:
        return values
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=pl_module.device)
    finite = torch.isfinite(local)
    both = torch.stack([torch.where(finite, local, torch.zeros_like(local)), finite.double()])
    total, count = trainer.strategy.reduce(both, reduce_op="sum").cpu()
    mean = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, math.nan)).tolist()
    return dict(zip(values, mean, strict=True))
