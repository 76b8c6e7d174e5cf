"""What real runs meet: bad rewards, bad prompt files, preemption, stale temp files, changed recipes, corrupt assets."""

from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from tests.helpers import ROOT, TINY, read_metrics, run_cli
from unirl_pl.callbacks import PreemptionCheckpoint
from unirl_pl.checkpoint import (
    _HOST,
    AtomicCheckpointIO,
    check_identity,
    remove_stale_tmp,
    run_identity,
)
from unirl_pl.data import load_prompts
from unirl_pl.manifest import ASSETS, AssetIntegrityError, load_manifest, verify_assets, write_manifest
from unirl_pl.rewards import WeightedSum
from unirl_pl.rewards.builtin import resolve_reward

HERE = "tests.test_reliability"
PROMPTS, REFINED = ["a red circle", "a blue square"], ["a red circle", "a blue square, bright"]
IMAGES = torch.rand(2, 3, 8, 8)


# ------------------------------------------------------------------ rewards used by dotted path
def strings_reward(prompts, refined_prompts, images):
    return ["high"] * len(prompts)


def none_reward(prompts, refined_prompts, images):
    return [1.0] + [None] * (len(prompts) - 1)


def nan_second_reward(prompts, refined_prompts, images):
    return [0.5] + [math.nan] * (len(prompts) - 1)


def nan_for_blue_reward(prompts, refined_prompts, images):
    return [math.nan if "blue" in p else 1.0 for p in prompts]


def inf_tensor_reward(prompts, refined_prompts, images):
    return torch.tensor([math.inf] + [1.0] * (len(prompts) - 1))


def numpy_reward(prompts, refined_prompts, images):
    return np.arange(len(prompts), dtype=np.float64)


def bool_reward(prompts, refined_prompts, images):
    return ["red" in r for r in refined_prompts]


def matrix_reward(prompts, refined_prompts, images):
    return torch.zeros(len(prompts), 2)


NOT_CALLABLE = 3


class NoCall:
    pass


# ------------------------------------------------------------------ rewards
@pytest.mark.parametrize(
    ("reward", "error", "pattern"),
    [
        ("strings_reward", TypeError, r"reward '.*strings_reward' returned 'high' \(type str\) for sample 0"),
        ("none_reward", TypeError, r"reward '.*none_reward' returned None \(type NoneType\) for sample 1"),
        ("matrix_reward", ValueError, r"reward '.*matrix_reward' returned an array of shape \(2, 2\)"),
        ("nan_second_reward", ValueError, r"reward '.*nan_second_reward' returned nan for sample 1 \(prompt 'a blue"),
        ("inf_tensor_reward", ValueError, r"reward '.*inf_tensor_reward' returned inf for sample 0 \(prompt 'a red"),
    ],
)
def test_bad_reward_values_are_errors_naming_the_reward(reward, error, pattern):
    total = WeightedSum({f"{HERE}.{reward}": 1.0})
    with pytest.raises(error, match=pattern):
        total(PROMPTS, REFINED, IMAGES)


def test_nonfinite_drop_marks_the_sample_nan_and_counts_it():
    total_fn = WeightedSum({f"{HERE}.nan_second_reward": 1.0, "brightness": 0.5}, nonfinite="drop")
    total, parts = total_fn(PROMPTS, REFINED, IMAGES)
    assert torch.isfinite(total[0]) and torch.isnan(total[1])
    assert total[0].item() == pytest.approx(0.5 + 0.5 * parts["brightness"][0].item())
    assert torch.isnan(parts[f"{HERE}.nan_second_reward"][1]), "the raw term keeps its value for logging"
    assert total_fn.dropped == 1
    total_fn(PROMPTS, REFINED, IMAGES)
    assert total_fn.dropped == 2, "the count accumulates over calls"
    with pytest.raises(ValueError, match="nonfinite must be 'error' or 'drop'"):
        WeightedSum({"brightness": 1.0}, nonfinite="skip")
    with pytest.raises(ValueError, match="reward weights must be finite numbers"):
        WeightedSum({"brightness": math.nan})


def test_numeric_outputs_of_any_kind_are_accepted():
    total, parts = WeightedSum({f"{HERE}.numpy_reward": 1.0, f"{HERE}.bool_reward": 2.0})(PROMPTS, REFINED, IMAGES)
    assert parts[f"{HERE}.numpy_reward"].tolist() == [0.0, 1.0]
    assert parts[f"{HERE}.bool_reward"].tolist() == [1.0, 0.0]
    assert total.tolist() == [2.0, 1.0]


def test_video_frames_with_a_nan_name_the_video():
    videos = torch.rand(2, 3, 3, 8, 8)
    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt 'a blue square'"):
        WeightedSum({f"{HERE}.nan_for_blue_reward": 1.0})(PROMPTS, REFINED, videos)


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("no_such_pkg.reward", r"reward 'no_such_pkg.reward': cannot import module 'no_such_pkg'"),
        (f"{HERE}.missing", rf"reward '{HERE}.missing': module '{HERE}' has no attribute 'missing'"),
        (f"{HERE}.NOT_CALLABLE", rf"reward '{HERE}.NOT_CALLABLE' is not a function or class \(type int\)"),
        (f"{HERE}.NoCall", rf"reward '{HERE}.NoCall': its instances \(type NoCall\) are not callable"),
        ("brightnes", r"unknown reward 'brightnes'; built-in rewards are .*brightness"),
    ],
)
def test_resolve_reward_messages(name, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_reward(name)


# ------------------------------------------------------------------ prompts
def _write(path: Path, data: bytes | str) -> str:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def test_blank_jsonl_prompt_is_an_error_naming_file_and_line(tmp_path):
    path = _write(tmp_path / "p.jsonl", '{"prompt": "a red circle"}\n\n{"prompt": "   "}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:3: the 'prompt' field is empty"):
        load_prompts(path)
    path = _write(tmp_path / "q.jsonl", '{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"q\.jsonl:1: the 'prompt' field is empty"):
        load_prompts(path)


def test_all_blank_file_names_the_file(tmp_path):
    for name in ("blank.jsonl", "blank.txt"):
        path = _write(tmp_path / name, "\n   \n\t\n")
        with pytest.raises(ValueError, match=rf"prompt file '.*{name}' holds no prompts"):
            load_prompts(path)


def test_non_utf8_line_is_an_error_naming_file_and_line(tmp_path):
    path = _write(tmp_path / "latin1.txt", b"a red circle\n" + "a caf\xe9 sign\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt:2: not UTF-8 text \(byte 0xe9 at column 6\)"):
        load_prompts(path)


def test_txt_skips_blank_lines_and_bom(tmp_path):
    path = _write(tmp_path / "p.txt", "\ufeffa red circle\r\n\n  a blue square  \n")
    assert load_prompts(path) == ["a red circle", "a blue square"]
    path = _write(tmp_path / "p.jsonl", '\ufeff{"prompt": "a red circle"}\n')
    assert load_prompts(path) == ["a red circle"]


def test_inline_list_items_must_be_strings():
    with pytest.raises(ValueError, match=r"prompt list item 1 is 3 \(type int\), not a string"):
        load_prompts(["a red circle", 3])
    with pytest.raises(ValueError, match="the prompt list is empty"):
        load_prompts(["  ", ""])


# ------------------------------------------------------------------ stale temp files
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale_tmp_keeps_live_writers_and_other_files(tmp_path):
    dead = tmp_path / f".last.ckpt.{_HOST}.{_dead_pid()}.abc_123.tmp"
    mine = tmp_path / f".last.ckpt.{_HOST}.{os.getpid()}.def456.tmp"
    live = tmp_path / f".last.ckpt.{_HOST}.{os.getppid()}.ghi789.tmp"
    other_host = tmp_path / ".last.ckpt.elsewhere.12345.jkl012.tmp"
    old_style = tmp_path / ".epoch=0-step=2.ckpt.mno345.tmp"
    keep = [tmp_path / "last.ckpt", tmp_path / "notes.tmp", mine, live, other_host, old_style]
    for path in [dead, *keep]:
        path.write_bytes(b"x")
    (tmp_path / ".folder.tmp").mkdir()
    assert remove_stale_tmp(tmp_path) == [dead]
    assert all(p.exists() for p in keep) and (tmp_path / ".folder.tmp").is_dir()

    hour_ago = time.time() - 3600
    for path in (other_host, old_style):
        os.utime(path, (hour_ago, hour_ago))
    assert sorted(remove_stale_tmp(tmp_path)) == sorted([other_host, old_style]), (
        "old files are stale whoever wrote them"
    )
    assert remove_stale_tmp(tmp_path / "missing") == []


def test_atomic_io_sweeps_a_folder_on_its_first_save(tmp_path):
    dead = tmp_path / f".last.ckpt.{_HOST}.{_dead_pid()}.abc123.tmp"
    dead.write_bytes(b"half a checkpoint")
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert not dead.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    dead.write_bytes(b"x")
    io.save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    assert dead.exists(), "one sweep per folder and process"
    assert io.load_checkpoint(tmp_path / "last.ckpt", weights_only=True)["step"] == 2


class _Payload:
    """A pickled object that would run code when unpickled without weights_only."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoints_load_with_weights_only_by_default(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": _Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(path)  # what Lightning calls for --ckpt_path (weights_only=None)


# ------------------------------------------------------------------ run identity
def _module(**overrides):
    from unirl_pl.experts import FlowTransformerExpert, TinyCausalLMExpert
    from unirl_pl.generators import ComponentGenerator
    from unirl_pl.module import UniRLModule

    parts = {
        "llm": TinyCausalLMExpert(),
        "generator": ComponentGenerator(transformer=FlowTransformerExpert(lora_rank=4)),
    }
    return UniRLModule(rewards={"brightness": 1.0}, **{**parts, **overrides})


def test_run_identity_lists_what_a_resume_must_share():
    identity = run_identity(_module())
    assert identity["mode"] == "joint" and identity["trained"] == ["llm", "transformer"]
    assert identity["llm.lora_rank"] == 8 and identity["llm.lora_alpha"] == 16.0
    assert identity["llm.lora_targets"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj"])
    assert identity["llm.optimizer"] == "torch.optim.adamw.AdamW" and identity["llm.lr"] == 1e-3
    assert identity["transformer.lr"] == 3e-4 and identity["transformer.lora_rank"] == 4
    assert "data.seed" not in identity, "no datamodule attached"
    module = _module()
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(seed=7))
    assert run_identity(module)["data.seed"] == 7
    saved = torch.load(_roundtrip(identity), weights_only=True)
    check_identity(saved, run_identity(_module()))  # unchanged: no error


def _roundtrip(obj) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "id.pt"
    torch.save(obj, path)
    return path


def test_check_identity_lists_every_changed_key():
    from unirl_pl.experts import TinyCausalLMExpert

    saved = run_identity(_module())
    current = run_identity(
        _module(
            mode="prompt_only",
            llm=TinyCausalLMExpert(lora_rank=4),
            llm_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
    )
    with pytest.raises(ValueError) as info:
        check_identity(saved, current)
    message = str(info.value)
    for line in (
        "llm.lora_rank: checkpoint=8 now=4",
        "llm.lr: checkpoint=0.001 now=0.1",
        "llm.optimizer: checkpoint='torch.optim.adamw.AdamW' now='torch.optim.sgd.SGD'",
        "mode: checkpoint='joint' now='prompt_only'",
        "trained: checkpoint=['llm', 'transformer'] now=['llm']",
        "transformer.lr: checkpoint=0.0003 now='<absent>'",
    ):
        assert line in message, message
    assert "lora_alpha" not in message and "\n" not in message, "one line: the CLI prints it as its refusal"
    check_identity({**saved, "data.seed": 3}, saved)  # no datamodule now (export): the seed is not compared
    with pytest.raises(ValueError, match=r"Changed settings: data\.seed: checkpoint=3 now=4$"):
        check_identity({**saved, "data.seed": 3}, {**saved, "data.seed": 4})


def test_the_run_identity_holds_the_ema_and_a_resume_may_not_drop_or_change_it():
    from lightning.pytorch.trainer.states import TrainerFn

    from unirl_pl.callbacks import EMA
    from unirl_pl.errors import InputError
    from unirl_pl.identity import ema_identity, saved_ema_identity

    module = _module()
    fitting = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), callbacks=[EMA(decay=0.5)])
    module._trainer = fitting
    assert ema_identity(module) == {"ema": "on", "ema.components": ["llm", "transformer"], "ema.decay": 0.5}
    fitting.callbacks = []
    assert ema_identity(module) == {"ema": "off"}
    fitting.state.fn = TrainerFn.VALIDATING
    assert ema_identity(module) == {}, "validate and predict may score a checkpoint's raw weights"
    # A checkpoint written before the identity held the EMA: its EMA state says, else it had none.
    state = {"decay": 0.9, "components": ["transformer"], "ema": {"transformer.lora": torch.zeros(1)}}
    assert saved_ema_identity({"callbacks": {"EMA": state}})["ema.components"] == ["transformer"]
    assert saved_ema_identity({"callbacks": {}}) == {"ema": "off"}

    base = run_identity(_module())
    on = {**base, "ema": "on", "ema.components": ["llm", "transformer"], "ema.decay": 0.9}
    with pytest.raises(InputError) as dropped:
        check_identity(on, {**base, "ema": "off"}, "runs/last.ckpt")
    message = str(dropped.value)
    assert message.startswith("the checkpoint runs/last.ckpt was written by a differently configured run")
    assert "ema: checkpoint='on' now='off'" in message and "model.ema" in message and "\n" not in message
    with pytest.raises(InputError, match=r"ema\.components: checkpoint=\['llm', 'transformer'\] now=\['llm'\]"):
        check_identity(on, {**on, "ema.components": ["llm"]})
    with pytest.raises(InputError, match=r"ema\.decay: checkpoint=0\.9 now=0\.5"):
        check_identity(on, {**on, "ema.decay": 0.5})
    check_identity({**base, "ema": "off"}, on)  # an EMA may start on resume, from the restored weights
    check_identity(on, base)  # not fitting (validate, export): the EMA is not compared


def test_ema_components_the_model_cannot_average_are_refused_when_the_module_is_built():
    from unirl_pl.callbacks import EMA
    from unirl_pl.errors import ConfigError

    with pytest.raises(ValueError, match=r"model\.ema\.init_args\.components=\['vae'\]: this model has no expert"):
        _module(ema=EMA(components=["vae"]))
    with pytest.raises(ValueError, match=r"\['llm'\] is not trained in mode 'generator_only'"):
        _module(ema=EMA(components=["llm"]), mode="generator_only")
    assert _module(ema=EMA(components=["transformer"]), mode="generator_only").ema is not None
    # The same EMA as a trainer callback: refused at setup, before the models load, as a configuration error.
    with pytest.raises(ConfigError, match=r"the EMA callback's components=\['llm'\]"):
        EMA(components=["llm"]).setup(None, _module(mode="generator_only"), "fit")


# ------------------------------------------------------------------ asset manifest
def test_shipped_assets_match_their_manifest():
    manifest = load_manifest()
    on_disk = {
        p.relative_to(ASSETS).as_posix() for p in ASSETS.rglob("*") if p.is_file() and p.name != "MANIFEST.sha256"
    }
    assert set(manifest) == on_disk, "MANIFEST.sha256 lists exactly the shipped files"
    assert len(verify_assets(ASSETS)) == len(manifest)
    assert verify_assets(["unirl_pl/assets/shapes/refiner", ROOT / "recipes"]), "relative paths resolve; others skip"


def test_changed_extra_or_missing_asset_is_named(tmp_path):
    assets = tmp_path / "assets"
    shutil.copytree(ASSETS / "shapes" / "refiner", assets / "shapes" / "refiner")
    write_manifest(assets)
    folder = assets / "shapes" / "refiner"
    assert verify_assets(folder, assets=assets)

    config = folder / "config.json"
    config.write_text(config.read_text().replace("}", ' , "x": 1}', 1))
    with pytest.raises(AssetIntegrityError, match=r"shipped asset .*refiner/config\.json does not match its sha256"):
        verify_assets(folder, assets=assets)
    write_manifest(assets)

    (folder / "stray.bin").write_bytes(b"x")
    with pytest.raises(AssetIntegrityError, match=r"stray\.bin is not in .*MANIFEST\.sha256"):
        verify_assets(folder, assets=assets)
    (folder / "stray.bin").unlink()

    (folder / "tokenizer.json").unlink()
    with pytest.raises(AssetIntegrityError, match=r"is missing shapes/refiner/tokenizer\.json"):
        verify_assets(folder, assets=assets)
    assert verify_assets(tmp_path / "elsewhere", assets=assets) == []


# ------------------------------------------------------------------ preemption: the callback alone
class _Strategy:
    def reduce_boolean_decision(self, decision, all=True):
        return decision


def _fake_trainer(tmp_path, saved):
    return SimpleNamespace(
        is_global_zero=True,
        world_size=1,
        max_steps=100,
        global_step=3,
        callbacks=[],
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        strategy=_Strategy(),
        _accelerator_connector=SimpleNamespace(cluster_environment=None),
        save_checkpoint=lambda path: saved.append(Path(path)),
    )


def test_preemption_handler_saves_exits_and_restores_the_previous_handler(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    saved: list[Path] = []
    trainer = _fake_trainer(tmp_path, saved)
    callback = PreemptionCheckpoint()
    stale = tmp_path / "checkpoints" / f".last.ckpt.{_HOST}.{_dead_pid()}.abc123.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"x")
    callback.on_fit_start(trainer, None)
    assert not stale.exists(), "fit start sweeps the checkpoint folder"
    try:
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert saved == [], "no signal, no checkpoint"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert callback.received == signal.SIGUSR1
        with pytest.raises(SystemExit) as info:
            callback.on_train_batch_end(trainer, None, None, None, 0)
        assert info.value.code == 143
        assert saved == [tmp_path / "checkpoints" / "last.ckpt"]
    finally:
        callback.on_exception(trainer, None, SystemExit(143))
    assert {s: signal.getsignal(s) for s in before} == before


def test_preemption_on_the_last_step_lets_the_run_finish(tmp_path):
    saved: list[Path] = []
    trainer = _fake_trainer(tmp_path, saved)
    trainer.max_steps = trainer.global_step
    callback = PreemptionCheckpoint(dirpath=str(tmp_path / "pre"), signals=["SIGUSR1"])
    callback.on_fit_start(trainer, None)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        callback.on_train_batch_end(trainer, None, None, None, 0)
        assert saved == []
    finally:
        callback.on_fit_end(trainer, None)
    with pytest.raises(ValueError, match="signals must be signal names"):
        PreemptionCheckpoint(signals=["SIGNOPE"])
    with pytest.raises(ValueError, match="filename must be a file name ending in .ckpt"):
        PreemptionCheckpoint(filename="sub/last.pt")


# ------------------------------------------------------------------ preemption: a real run
class StepMarker(pl.Callback):
    """Test helper: at step ``at`` write ``path`` and wait (bounded) until a PreemptionCheckpoint got its signal.

    Waiting inside the step makes the preemption land deterministically at step ``at``.
    """

    def __init__(self, marker_file: str, at: int = 3, timeout_s: float = 120.0) -> None:
        self.path, self.at, self.timeout_s = Path(marker_file), at, timeout_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at:
            return
        self.path.write_text(str(os.getpid()))
        (watcher,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
        deadline = time.monotonic() + self.timeout_s
        while watcher.received is None and time.monotonic() < deadline:
            time.sleep(0.02)


FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)
COMMON = (
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
)


def _trainable(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.named_parameters() if v.requires_grad}


def _train_rows(rows):
    rows = [dict(r) for r in rows if "reward/mean" in r]
    for row in rows:
        row.pop("cache/text_encoder_hit_rate", None)  # derived data, cold after a resume
    return rows


@pytest.mark.integration
def test_sigterm_saves_exits_143_and_resumes_exactly(tmp_path):
    marker, n = tmp_path / "step3", 5
    args = [
        sys.executable,
        "-m",
        "unirl_pl",
        "fit",
        "--config",
        TINY,
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.logger.init_args.name=preempted",
        f"--trainer.default_root_dir={tmp_path}",
        *COMMON,
        "--trainer.max_steps=30",
        *FAST,
        f"--trainer.callbacks+={HERE}.StepMarker",
        f"--trainer.callbacks.marker_file={marker}",
        "--trainer.callbacks+=unirl_pl.callbacks.PreemptionCheckpoint",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the run never reached step 3 (rc={proc.poll()})"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log_dir = tmp_path / "preempted" / "version_0"
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    assert proc.returncode == 143, output[-3000:]
    assert f"saved {ckpt} at step 3" in output, output[-3000:]
    assert ckpt.is_file() and not list(ckpt.parent.glob(".*.tmp"))
    assert torch.load(ckpt, weights_only=True)["global_step"] == 3

    full = run_cli(tmp_path, f"--trainer.max_steps={n}", *FAST, name="full")
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    # The callback rides along in the resumed run: it must not change training, and must put the handlers back.
    watch = "--trainer.callbacks+=unirl_pl.callbacks.PreemptionCheckpoint"
    resumed = run_cli(tmp_path, f"--trainer.max_steps={n}", *FAST, watch, f"--ckpt_path={ckpt}", name="resumed")
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == handlers
    a, b = _trainable(full), _trainable(resumed)
    assert a.keys() == b.keys() and a
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(diffs.values()) == 0.0, max(diffs.items(), key=lambda kv: kv[1])
    full_rows = _train_rows(read_metrics(full))
    assert _train_rows(read_metrics(resumed)) == full_rows[3:]
    # The preempted run logged every step up to the one it saved at (that step's row is flushed before exit).
    preempted = _train_rows(
        read_metrics(SimpleNamespace(trainer=SimpleNamespace(logger=SimpleNamespace(log_dir=log_dir))))
    )
    assert preempted == full_rows[:3]
