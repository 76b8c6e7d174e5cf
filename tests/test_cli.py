"""The CLI end to end on the default recipe, and bad input refused before any model is built."""

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, TINY, read_metrics, run_cli, series
from unirl_pl.cli import main
from unirl_pl.experts import FlowTransformerExpert
from unirl_pl.sampling import flow_sigmas

REQUIRED = [
    "reward/mean",
    "llm/pg_loss",
    "llm/kl",
    "transformer/pg_loss",
    "transformer/kl",
    "transformer/ratio_mean",
    "transformer/grad_norm",
    "c2/llm_max_abs_diff",
    "c2/transformer_max_abs_diff",
    "version/llm",
    "version/transformer",
    "version/text_encoder",
    "cache/text_encoder_hit_rate",
    "advantage/zero_std_frac",
]


@pytest.mark.slow
def test_fit_joint_writes_metrics_and_gates_hold(tmp_path):
    cli = run_cli(tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=3")
    rows = read_metrics(cli)
    keys = set().union(*rows)
    missing = [k for k in REQUIRED if k not in keys]
    assert not missing, f"metrics.csv lacks {missing}"
    assert len(series(rows, "reward/mean")) == 3, "one row per RL step (max_steps counts RL steps)"
    assert max(series(rows, "c2/llm_max_abs_diff")) <= 1e-5
    assert max(series(rows, "c2/transformer_max_abs_diff")) <= 1e-5
    assert all(abs(r - 1) <= 1e-5 for r in series(rows, "transformer/ratio_mean"))
    assert series(rows, "version/llm") == [1.0, 2.0, 3.0]
    assert series(rows, "version/text_encoder") == [0.0, 0.0, 0.0]
    assert series(rows, "val/reward_mean"), "validation ran on the serve path"
    # Every fit records the schedule it samples with; the project's own generator samples linearly.
    schedule = json.loads((Path(cli.trainer.log_dir) / "schedule.json").read_text())
    cfg = cli.model.rollout_config
    assert schedule["sigmas"] == flow_sigmas(cfg.num_steps, 1.0).tolist()
    assert schedule["sde_steps"] == list(range(*cli.model.generator_algorithm.sde_window))
    assert schedule["source"].startswith("linear")


@pytest.mark.slow
def test_each_optimizer_has_its_own_learning_rate(tmp_path):
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=1",
        "--model.llm_optimizer.init_args.lr=0.003",
        "--model.transformer_optimizer.init_args.lr=0.0007",
        "--trainer.limit_val_batches=0",
    )
    llm_opt, dit_opt = cli.model.optimizers()
    assert llm_opt.param_groups[0]["lr"] == pytest.approx(0.003)
    assert dit_opt.param_groups[0]["lr"] == pytest.approx(0.0007)
    llm_params = {id(p) for p in cli.model.llm.parameters()}
    assert all(id(p) in llm_params for p in llm_opt.param_groups[0]["params"])


@pytest.mark.slow
def test_predict_writes_pngs(tmp_path):
    out = tmp_path / "pngs"
    main(
        [
            "predict",
            "--config",
            TINY,
            "--trainer.enable_progress_bar=false",
            f"--trainer.callbacks=[{{class_path: unirl_pl.callbacks.ImageWriter, init_args: {{output_dir: {out}}}}}]",
            "--data.predict_prompts=[a red circle, two blue squares]",
            "--trainer.logger=false",
        ]
    )
    assert sorted(p.name for p in out.glob("*.png")) == ["0_0000_00.png", "0_0000_01.png", "grid_0_0000.png"]
    from PIL import Image

    assert Image.open(out / "grid_0_0000.png").size == (2 * 128, 128 + 48)
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 2


def test_print_config_round_trips(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", TINY, "--print_config"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "samples_per_prompt: 4" in text and "TinyCausalLMExpert" in text


@pytest.mark.parametrize("recipe", ["sd35.yaml", "flux.yaml", "wan22_t2v.yaml", "joint.yaml"])
def test_print_config_of_a_pretrained_refiner_shows_only_what_applies(capsys, recipe):
    # The tiny test-bed model's arguments belong to TinyCausalLMExpert: a recipe that loads a checkpoint
    # must not print a hidden_size it ignores next to its pretrained_path.
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(ROOT / "recipes" / recipe), "--print_config"])
    assert exc.value.code == 0
    llm = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["llm"]
    assert llm["class_path"] == "unirl_pl.experts.CausalLMExpert"
    assert "pretrained_path" in llm["init_args"]
    tiny_only = {"hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"}
    assert not tiny_only & set(llm["init_args"]), sorted(llm["init_args"])


@pytest.fixture
def no_build(monkeypatch):
    """Any model build fails loudly: bad input must be refused before it."""

    def boom(self):
        raise AssertionError("a model was built before the config was validated")

    monkeypatch.setattr(FlowTransformerExpert, "build", boom)


def _expect_error(capsys, args, *needles):
    with pytest.raises((SystemExit, ValueError)) as exc:
        main(["fit", "--config", TINY, *args])
    text = str(exc.value) + capsys.readouterr().err
    for needle in needles:
        assert needle in text, text[-2000:]


def test_unknown_key_is_named(no_build, capsys):
    _expect_error(capsys, ["--data.prompts_per_stepp=3"], "prompts_per_stepp")


def test_unknown_key_in_a_recipe_file_is_named(no_build, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TINY).read_text().replace("num_skip_refinement: 1", "num_skip_refinment: 1"))
    with pytest.raises((SystemExit, ValueError)) as exc:
        main(["fit", "--config", str(bad)])
    assert "num_skip_refinment" in str(exc.value) + capsys.readouterr().err


@pytest.mark.slow
def test_samples_per_prompt_below_two(no_build, capsys):
    _expect_error(
        capsys, ["--data.samples_per_prompt=1", "--data.num_skip_refinement=0"], "samples_per_prompt must be >= 2"
    )


@pytest.mark.slow
def test_num_skip_refinement_not_below_samples(no_build, capsys):
    _expect_error(capsys, ["--data.num_skip_refinement=4"], "num_skip_refinement must be in")


@pytest.mark.slow
def test_empty_prompt_file(no_build, capsys, tmp_path):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n  \n")
    _expect_error(capsys, [f"--data.prompts={empty}"], "holds no prompts")


def test_fsdp1_is_refused_with_a_pointer_to_fsdp2(no_build, capsys):
    _expect_error(capsys, ["--trainer.strategy=fsdp"], "ModelParallelStrategy")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    mode: [joint\n")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(bad)])
    assert stop.value.code == 2
    assert f"{bad}: line 4, column 1: not valid YAML" in capsys.readouterr().err
