"""``unirl_pl.callbacks.EMA``: Flow-GRPO's EMA arithmetic, the validation swap, exact resume and export."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from tests.helpers import ROOT, run_cli, subprocess_env
from unirl_pl.callbacks import EMA
from unirl_pl.export import main as export_main

# ---------------------------------------------------------------------------------------------- fast: fakes


class _Expert(torch.nn.Module):
    """A frozen base weight and a trainable "LoRA" weight, in float64 so the hand values compare tightly."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Parameter(torch.full((3,), 5.0, dtype=torch.float64), requires_grad=False)
        self.lora = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))


class _Module:
    def __init__(self, trained: tuple[str, ...] = ("llm", "transformer")) -> None:
        self._experts = {"llm": _Expert(), "transformer": _Expert()}
        self.trained = list(trained)

    def experts(self) -> dict[str, _Expert]:
        return self._experts


def _trainer(step: int = 0, fn: TrainerFn = TrainerFn.FITTING) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, training=True, state=SimpleNamespace(fn=fn))


def _set(module: _Module, value: float) -> None:
    with torch.no_grad():
        for expert in module.experts().values():
            expert.lora.fill_(value)


def _train(ema: EMA, module: _Module, weights: dict[int, float]) -> SimpleNamespace:
    """Step 0's weights, then each step's weights with its ``on_train_batch_end``; returns the fake trainer."""
    trainer = _trainer(0)
    _set(module, weights[0])
    ema.on_train_start(trainer, module)
    for step in range(1, max(weights) + 1):
        _set(module, weights.get(step, weights[step - 1]))
        trainer.global_step = step
        ema.on_train_batch_end(trainer, module, None, None, step - 1)
    return trainer


def _ema_value(ema: EMA, key: str = "transformer.lora") -> float:
    assert ema.ema is not None
    value = ema.ema[key]
    assert bool((value == value[0]).all())
    return float(value[0])


def test_the_reference_schedule():
    """Flow-GRPO's EMAModuleWrapper(decay=0.9, update_step_interval=8): updates after steps 7, 15, ...; its
    decay ramps as min((1 + k) / (10 + k), 0.9) and reaches the cap at step 87."""
    ema = EMA(decay=0.9, every_n_steps=8)
    assert [s for s in range(40) if ema.decay_at(s) is not None] == [7, 15, 23, 31, 39]
    assert ema.decay_at(7) == 8 / 17 and ema.decay_at(79) == 80 / 89 and ema.decay_at(87) == 0.9
    assert EMA(decay=0.9, every_n_steps=8, warmup=False).decay_at(7) == 0.9
    assert EMA(every_n_steps=8, start_step=10).decay_at(17) == 8 / 17, "the ramp and the interval count from start_step"


def test_ema_matches_a_hand_computation():
    """decay 0.25, every 2 steps: updates after steps 1, 3, 5 with decays 2/11 (ramp), then 0.25 (cap)."""
    module = _Module()
    ema = EMA(decay=0.25, every_n_steps=2)
    _train(ema, module, {0: 0.0, 1: 1.1, 2: 7.0, 3: 2.0, 4: -3.0, 5: 4.0, 6: 9.0})
    # e0 = 0 (the initial weights); step 1: d = 2/11 -> e = 0 + 9/11 * (1.1 - 0) = 0.9
    # step 3: d = min(4/13, 0.25) = 0.25 -> e = 0.9 + 0.75 * (2 - 0.9) = 1.725
    # step 5: d = 0.25 -> e = 1.725 + 0.75 * (4 - 1.725) = 3.43125; steps 2, 4, 6 do not update.
    assert _ema_value(ema) == pytest.approx(3.43125, abs=1e-12)
    assert _ema_value(ema, "llm.lora") == pytest.approx(3.43125, abs=1e-12)
    assert set(ema.ema) == {"llm.lora", "transformer.lora"}, "only trainable parameters are averaged"
    assert ema.last_step == 6


def test_start_step_follows_the_weights_until_it_starts():
    module = _Module()
    ema = EMA(decay=0.5, every_n_steps=1, start_step=3, warmup=False)
    _train(ema, module, {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0})
    assert _ema_value(ema) == 3.0, "the EMA starts as the weights at start_step"
    trainer = _trainer(4)
    _set(module, 5.0)
    ema.on_train_batch_end(trainer, module, None, None, 3)
    assert _ema_value(ema) == 4.0, "then 3 + (1 - 0.5) * (5 - 3)"


def test_only_the_named_components_are_averaged():
    module = _Module()
    ema = EMA(components=["llm"])
    _train(ema, module, {0: 0.0, 1: 1.0})
    assert set(ema.ema) == {"llm.lora"}
    with pytest.raises(ValueError, match="no expert"):
        EMA(components=["vae"]).on_train_start(_trainer(), module)


def test_validation_and_predict_swap_the_ema_in_and_restore_the_weights_exactly():
    module = _Module()
    ema = EMA(decay=0.5, every_n_steps=1, warmup=False)
    trainer = _train(ema, module, {0: 0.0, 1: 0.1, 2: 0.7})
    params = ema.trainable(module)
    weights = {k: p.detach().clone() for k, p in params.items()}
    assert all(not torch.equal(p, ema.ema[k]) for k, p in params.items()), "else the swap would prove nothing"
    bases = [e.base.detach().clone() for e in module.experts().values()]
    for start, end in [
        (ema.on_validation_start, ema.on_validation_epoch_end),
        (ema.on_validation_start, ema.on_validation_end),
        (ema.on_predict_start, ema.on_predict_epoch_end),
        (ema.on_predict_start, ema.on_predict_end),
    ]:
        start(trainer, module)
        assert all(torch.equal(p, ema.ema[k]) for k, p in params.items()), "scoring sees the EMA"
        with pytest.raises(RuntimeError, match="swapped"):
            ema.on_save_checkpoint(trainer, module, {})
        end(trainer, module)
        assert all(torch.equal(p, weights[k]) for k, p in params.items()), "the training weights, bit for bit"
    ema.on_validation_start(trainer, module)
    ema.on_exception(trainer, module, RuntimeError("boom"))
    assert all(torch.equal(p, weights[k]) for k, p in params.items()), "an exception restores them too"
    assert all(torch.equal(e.base, b) for e, b in zip(module.experts().values(), bases, strict=True))


def test_state_round_trip_and_a_checkpoint_written_before_the_update():
    module = _Module()
    ema = EMA(decay=0.5, every_n_steps=1, warmup=False)
    trainer = _train(ema, module, {0: 0.0, 1: 1.0})
    # A callback listed before EMA writes a checkpoint in step 2's on_train_batch_end: the update is due.
    _set(module, 3.0)
    trainer.global_step = 2
    state = ema.state_dict()
    assert float(state["ema"]["transformer.lora"][0]) == 1.75 and state["last_step"] == 2
    ema.on_train_batch_end(trainer, module, None, None, 1)
    assert _ema_value(ema) == 1.75, "0.5 + 0.5 * (3 - 0.5), and the step is not applied twice"

    # Restored before the tensors exist (Lightning restores callbacks before on_train_start) or after.
    for early in (True, False):
        other = EMA(decay=0.5, every_n_steps=1, warmup=False)
        if early:
            other.load_state_dict(state)
        other.on_train_start(trainer, module)
        if not early:
            other.load_state_dict(state)
        assert _ema_value(other) == 1.75 and other.last_step == 2
    wrong = EMA(components=["llm"])
    wrong.on_train_start(trainer, module)
    with pytest.raises(ValueError, match="other parameters"):
        wrong.load_state_dict(state)


# ---------------------------------------------------------------------------------------- DTensor (FSDP2)


@pytest.mark.slow
def test_dtensor_parameters(tmp_path):
    """Sharded (DTensor) parameters: the EMA stays a DTensor, swaps exactly and saves whole tensors."""
    script = textwrap.dedent(
        """
        import os, torch, torch.distributed as dist
        from types import SimpleNamespace
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
        from lightning.pytorch.trainer.states import TrainerFn
        from unirl_pl.callbacks import EMA

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))

        class Expert(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lora = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))

        module = SimpleNamespace(trained=["transformer"], experts=lambda: {"transformer": expert})
        expert = Expert()
        trainer = SimpleNamespace(global_step=0, training=True, state=SimpleNamespace(fn=TrainerFn.FITTING))
        ema = EMA(decay=0.5, every_n_steps=1, warmup=False)
        ema.on_train_start(trainer, module)
        with torch.no_grad():
            expert.lora.fill_(2.0)
        trainer.global_step = 1
        ema.on_train_batch_end(trainer, module, None, None, 0)
        assert isinstance(ema.ema["transformer.lora"], DTensor)
        assert torch.equal(ema.ema["transformer.lora"].full_tensor(), torch.ones(4, 2))
        ema.on_validation_start(trainer, module)
        assert torch.equal(expert.lora.full_tensor(), torch.ones(4, 2))
        ema.on_validation_epoch_end(trainer, module)
        assert torch.equal(expert.lora.full_tensor(), torch.full((4, 2), 2.0))
        state = ema.state_dict()
        assert type(state["ema"]["transformer.lora"]) is torch.Tensor
        other = EMA(decay=0.5, every_n_steps=1, warmup=False)
        other.on_train_start(trainer, module)
        other.load_state_dict(state)
        assert isinstance(other.ema["transformer.lora"], DTensor)
        assert torch.equal(other.ema["transformer.lora"].full_tensor(), torch.ones(4, 2))

        # fully_shard with reshard_after_forward=False: a no-grad forward keeps its gathered weights, which the
        # next forward would reuse; the swap must make validation's forwards see the EMA, and training's after it
        # the training weights again.
        from torch.distributed.fsdp import fully_shard
        import torch.nn.functional as F

        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        fully_shard(linear, mesh=mesh, reshard_after_forward=False)
        module = SimpleNamespace(trained=["transformer"], experts=lambda: {"transformer": linear})
        trainer.global_step = 0
        ema = EMA(decay=0.5, every_n_steps=1, warmup=False)
        ema.on_train_start(trainer, module)
        with torch.no_grad():
            for param in linear.parameters():
                param.add_(1.0)
        trainer.global_step = 1
        ema.on_train_batch_end(trainer, module, None, None, 0)
        x = torch.randn(3, 4)
        with torch.no_grad():
            trained = linear(x)  # leaves the training weights gathered
            ema.on_validation_start(trainer, module)
            scored = linear(x)
            want = F.linear(x, ema.ema["transformer.weight"].full_tensor(), ema.ema["transformer.bias"].full_tensor())
            assert torch.allclose(scored, want) and not torch.allclose(scored, trained), "validation sees the EMA"
            ema.on_validation_epoch_end(trainer, module)
            assert torch.equal(linear(x), trained), "and training the training weights after it"
        dist.destroy_process_group()
        print("OK")
        """
    )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = subprocess_env() | {"PORT": str(port)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------ slow: real fits

N = 2
FAST = ("--model.rollout.num_steps=4", "--model.generator_algorithm.init_args.sde_window=[0,2]")


class EMAProbe(pl.Callback):
    """Listed after EMA: what the experts hold while validation scores, and after it."""

    def __init__(self) -> None:
        self.during: list[tuple[int, bool, bool]] = []  # (step, params == EMA, params == training weights)
        self.after: list[tuple[int, bool, bool]] = []  # (step, params == training weights, versions unchanged)
        self.weights: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}

    @staticmethod
    def _ema(trainer: pl.Trainer) -> EMA:
        return next(c for c in trainer.callbacks if isinstance(c, EMA))

    def _params(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return self._ema(trainer).trainable(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.weights:  # the sanity check, before any step: the weights are the EMA
            self.weights = {k: p.detach().clone() for k, p in self._params(trainer, pl_module).items()}
            self.versions = pl_module.ledger.as_dict()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.weights = {k: p.detach().clone() for k, p in self._params(trainer, pl_module).items()}
        self.versions = pl_module.ledger.as_dict()

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        ema, params = self._ema(trainer), self._params(trainer, pl_module)
        is_ema = all(torch.equal(p, ema.ema[k]) for k, p in params.items())
        is_weights = all(torch.equal(p, self.weights[k]) for k, p in params.items())
        self.during.append((trainer.global_step, is_ema, is_weights))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = self._params(trainer, pl_module)
        restored = all(torch.equal(p, self.weights[k]) for k, p in params.items())
        self.after.append((trainer.global_step, restored, pl_module.ledger.as_dict() == self.versions))


def _fit(tmp_path: Path, name: str, *extra: str):
    ckpts = tmp_path / "ckpts" / name
    return run_cli(
        tmp_path,
        f"--trainer.max_steps={2 * N}",
        *FAST,
        f"--trainer.val_check_interval={N}",
        "--trainer.limit_val_batches=1",
        "--trainer.callbacks+=unirl_pl.callbacks.EMA",
        "--trainer.callbacks.decay=0.9",
        "--trainer.callbacks.every_n_steps=1",
        "--trainer.callbacks+=tests.test_ema.EMAProbe",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        f"--trainer.callbacks.every_n_train_steps={N}",
        "--trainer.callbacks.save_top_k=-1",
        *extra,
        name=name,
    )


def _callback(cli, cls: type) -> object:
    # By name: the CLI imports this file as ``tests.test_ema``, pytest may have imported it as ``test_ema``.
    return next(c for c in cli.trainer.callbacks if type(c).__name__ == cls.__name__)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    cli = _fit(root, "full")
    return SimpleNamespace(cli=cli, root=root, ckpts=root / "ckpts" / "full")


@pytest.mark.slow
def test_validation_scores_the_ema_and_restores_the_training_weights(full):
    probe = _callback(full.cli, EMAProbe)
    # The sanity check (step 0: the EMA is the initial weights), then after steps 2 and 4.
    assert [step for step, _, _ in probe.during] == [0, N, 2 * N]
    assert all(is_ema for _, is_ema, _ in probe.during), "validation runs on the EMA weights"
    assert not any(is_weights for step, _, is_weights in probe.during if step > 0), "which differ from the weights"
    assert [step for step, _, _ in probe.after] == [0, N, 2 * N]
    assert all(restored and versions for _, restored, versions in probe.after), "restored exactly, same versions"


@pytest.mark.slow
def test_a_resumed_run_ends_with_the_same_ema_bit_for_bit(full, tmp_path):
    ckpt = full.ckpts / f"epoch=0-step={N}.ckpt"
    state = torch.load(ckpt, weights_only=True)
    assert state["callbacks"]["EMA"]["last_step"] == N
    resumed = _fit(tmp_path, "resumed", f"--ckpt_path={ckpt}")
    want, got = _callback(full.cli, EMA), _callback(resumed, EMA)
    assert want.ema.keys() == got.ema.keys() and want.last_step == got.last_step == 2 * N
    diffs = {k: (want.ema[k] - got.ema[k]).abs().max().item() for k in want.ema}
    assert max(diffs.values()) == 0.0, f"resume changed the EMA: {max(diffs.items(), key=lambda kv: kv[1])}"
    weights = want.trainable(full.cli.model)
    assert all(torch.equal(p, weights[k]) for k, p in got.trainable(resumed.model).items()), "and the same weights"

    # The comparison can fail: a resume whose checkpoint lost the EMA starts it afresh and ends elsewhere.
    del state["callbacks"]["EMA"]
    torch.save(state, tmp_path / "no_ema.ckpt")
    fresh = _callback(_fit(tmp_path, "fresh", f"--ckpt_path={tmp_path / 'no_ema.ckpt'}"), EMA)
    assert max((want.ema[k] - fresh.ema[k]).abs().max().item() for k in want.ema) > 0


@pytest.mark.slow
def test_export_writes_the_ema_weights_unless_raw(full, tmp_path, capsys):
    ckpt = full.ckpts / f"epoch=0-step={2 * N}.ckpt"
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["EMA"]["ema"]
    config = next((full.root / "full").rglob("config.yaml"))
    module = full.cli.model
    params = EMA().trainable(module)
    weights = {k: p.detach().clone() for k, p in params.items()}
    assert any(not torch.equal(saved[k], weights[k]) for k in params), "else EMA and raw would look alike"
    try:
        for flag, want, says in [((), saved, "weights: EMA of llm, transformer"), (("--raw",), weights, "--raw")]:
            out = tmp_path / f"out{len(flag)}"
            written = export_main(["--config", str(config), "--ckpt", str(ckpt), "--out", str(out), *flag])
            assert says in capsys.readouterr().out
            for name, path in written.items():
                module.experts()[name].load_adapter(str(path))
            assert all(torch.equal(p, want[k]) for k, p in params.items()), f"export {flag} wrote other weights"
    finally:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(weights[k])


@pytest.mark.slow
def test_validate_from_a_checkpoint_scores_its_ema(full, tmp_path):
    ckpt = full.ckpts / f"epoch=0-step={2 * N}.ckpt"
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["EMA"]["ema"]
    cli = run_cli(
        tmp_path,
        *FAST,
        "--trainer.limit_val_batches=1",
        "--trainer.callbacks+=unirl_pl.callbacks.EMA",
        "--trainer.callbacks.every_n_steps=1",
        "--trainer.callbacks+=tests.test_ema.EMAProbe",
        f"--ckpt_path={ckpt}",
        subcommand="validate",
    )
    ema, probe = _callback(cli, EMA), _callback(cli, EMAProbe)
    assert all(torch.equal(ema.ema[k], saved[k]) for k in saved), "the checkpoint's EMA was loaded"
    assert probe.during and all(is_ema for _, is_ema, _ in probe.during), "and validation scored it"
    trained = EMA().trainable(full.cli.model)
    assert all(torch.equal(p, trained[k]) for k, p in ema.trainable(cli.model).items()), "then the weights are back"


def test_the_module_hands_its_ema_to_the_trainer_and_an_overlay_switches_it_on():
    from tests.helpers import JOINT, ROOT
    from unirl_pl.callbacks import EMA
    from unirl_pl.cli import main

    quiet = ["--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
    plain = main(["--config", JOINT, *quiet], run=False).model
    assert plain.ema is None and plain.configure_callbacks() == []
    overlay = str(ROOT / "recipes" / "overlays" / "two_updates_ema.yaml")
    model = main(["--config", JOINT, "--config", overlay, *quiet], run=False).model
    (ema,) = model.configure_callbacks()
    assert isinstance(ema, EMA) and ema is model.ema and (ema.decay, ema.every_n_steps) == (0.9, 1)
    assert model.losses["llm"].mini_batches == 2 and model.losses["transformer"].mini_batches == 2
    assert model.losses["transformer"].clip_eps == 1e-4, "the overlay changes only what it names"
