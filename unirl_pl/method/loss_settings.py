"""Per-expert policy-loss settings (``model.llm_loss``, ``model.transformer_loss``): what the module's
configuration gives each trained expert's algorithm; the losses themselves are :mod:`unirl_pl.algorithms`'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ExpertLoss:
    """Per-expert policy-loss settings.

    Args:
        clip_eps: PPO ratio clip range ``[1-eps, 1+eps]`` (GRPO uses ~0.2, Flow-GRPO ~1e-4).
        beta: Weight of the KL to the adapter-disabled reference policy (0 skips the reference forward).
        grad_clip: Clip this expert's gradient norm to this value (None: no clipping, norm still logged).
        rollout_correction: ``off`` anchors the PPO ratio at the behavior log-prob rollout recorded (on-policy
            by construction: the C2 gate proves the two agree). ``tis`` corrects a numerics mismatch between
            rollout and training (bf16 kernels, KV-cache decode, other batch shapes) instead: the ratio is
            anchored at the log-prob the trainer recomputes before any update, and each term's policy loss is
            weighted by the truncated importance weight ``min(exp(recomputed - behavior), tis_cap)`` (per
            token for the LM, per SDE step for the DiT), as verl's decoupled rollout correction
            (``rollout_is: token``) and TRL's ``vllm_importance_sampling_correction`` do. The C2 gate then
            measures and logs (``rollout_corr/*``) and stops only on a mismatch far beyond numerics.
        tis_cap: Upper truncation of the importance weight (verl's ``rollout_is_threshold`` and TRL's
            ``vllm_importance_sampling_cap``, both 2.0 by default); >= 1 so agreeing terms keep weight 1.
        mini_batches: Optimizer steps per PPO epoch over one rollout: the expert's records split into this many
            mini-batches, prompt groups kept whole (:mod:`unirl_pl.method.minibatch`). The first is on-policy
            (the C2 gate proves it on the whole rollout, before any update); the later ones are stale by design,
            which is what the clip range acts on. 1: the whole rollout in one step. More mini-batches than this
            rank's prompt groups (``group`` split) or samples (``sample`` split) is refused when the fit starts.
        mini_batch_split: How the records split into ``mini_batches``. ``group``: a prompt's group stays whole in
            one mini-batch (verl's actor: DAPO, GSPO, GRPO-Guard). ``sample``: samples are shuffled and dealt, a
            group spread over the updates (Flow-GRPO's SD3 trainer, MixGRPO).
        drop_zero_advantage: Train only the rows whose advantage is not zero, as Flow-GRPO's trainers do (``mask
            = advantages.abs().sum(dim=1) != 0`` in ``scripts/train_sd3.py``): a group whose rewards are all equal
            then adds neither policy gradient nor KL, and the loss is a mean over the rows that carry signal.
            Dropped rows are re-admitted at random until the count is a multiple of ``mini_batches`` (Flow-GRPO's
            rule, which keeps every rank's step count equal). With more than one mini-batch it needs the
            ``sample`` split (a whole dropped group would empty a ``group`` mini-batch).
        kl_form: The generator's KL of the SDE-step means to the reference (the refiner's is the k3 of its token
            log-probs, and refuses anything but the default). ``flow_grpo``: ``mean((mean - mean_ref)^2) / (2
            std^2)`` with ``std`` the step's noise scale before its ``sqrt(-dt)``, as Flow-GRPO's SD3 trainer
            (the project's numbers so far). ``promptrl``: ``mean((mean - mean_ref)^2) / (2 (std sqrt(-dt))^2)``,
            the KL per latent element of the two Gaussians the step draws from, as PromptRL's trainer
            (G-U-N/UniRL ``geneval_grpo_trainer.py``) and Flow-GRPO's Wan trainer (``train_wan2_1.py``, the Wan
            recipes; tests/test_wan_kl.py): the Flow-GRPO SD3 form divided by ``-dt``, so the same ``beta``
            weighs the KL ``1 / -dt`` times more and the steps unequally (the main recipe's first 4 of 10 steps at
            shift 3: 28x, 24x, 21x, 18x).
            Only for the Gaussian SDE step: CPS's ``std`` is already its step's full scale (the two forms agree
            there, so it is refused) and DiffusionNFT has no SDE step.
    """

    clip_eps: float = 0.2
    beta: float = 0.01
    grad_clip: float | None = 1.0
    rollout_correction: Literal["off", "tis"] = "off"
    tis_cap: float = 2.0
    mini_batches: int = 1
    mini_batch_split: Literal["group", "sample"] = "group"
    drop_zero_advantage: bool = False
    kl_form: Literal["flow_grpo", "promptrl"] = "flow_grpo"

    @property
    def splits_rollout(self) -> bool:
        """Whether the first update sees only some of the rollout's rows (several mini-batches, or dropped rows)."""
        return self.mini_batches > 1 or self.drop_zero_advantage

    def __post_init__(self) -> None:
        if self.kl_form not in ("flow_grpo", "promptrl"):
            raise ValueError(f"kl_form must be 'flow_grpo' or 'promptrl', got {self.kl_form!r}")
        if self.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {self.mini_batches}")
        if self.mini_batch_split not in ("group", "sample"):
            raise ValueError(f"mini_batch_split must be 'group' or 'sample', got {self.mini_batch_split!r}")
        if self.drop_zero_advantage and self.mini_batches > 1 and self.mini_batch_split == "group":
            raise ValueError(
                "drop_zero_advantage with mini_batches > 1 needs mini_batch_split: sample (a dropped group would "
                "leave a group-whole mini-batch empty)"
            )
        if self.rollout_correction not in ("off", "tis"):
            raise ValueError(f"rollout_correction must be 'off' or 'tis', got {self.rollout_correction!r}")
        if not self.tis_cap >= 1.0:
            raise ValueError(f"tis_cap must be >= 1 (agreeing log-probs have weight 1), got {self.tis_cap}")
        if self.clip_eps <= 0:
            raise ValueError(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0 turns the KL term off), got {self.beta}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or null, got {self.grad_clip}")
