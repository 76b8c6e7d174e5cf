"""``python -m unirl_pl plan``: the memory plan is torch's tracker on fake tensors, checked against real ones.

The plan's trace of a step on fake tensors must equal the same code on real CPU tensors (tiny pipeline,
tracker peaks per phase within 10%); the DiT update's own peak must not grow with the number of samples
when it runs in micro-batches (the project's update path: a record from ``DiffusionDenoise.sample``
trained by ``drivers.dit_loss``); the shipped configs must build the published models' sizes; and the CLI
prints its table, writes JSON and refuses a bad recipe in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel
from transformers import (
    CLIPTextModel,
    CLIPTextModelWithProjection,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
    T5EncoderModel,
    UMT5EncoderModel,
)

from tests.chat_lm import make_qwen2_chat_lm
from tests.pipelines import make_sd3_pipeline
from unirl_pl.algorithms import FlowGRPO
from unirl_pl.algorithms.drivers import dit_loss
from unirl_pl.card import Role
from unirl_pl.cli import main
from unirl_pl.errors import ConfigError
from unirl_pl.generators import SD3Generator
from unirl_pl.loops import DiffusionDenoise, RolloutConfig
from unirl_pl.method import ExpertLoss
from unirl_pl.plan.models import SHIPPED, meta_model, resolve_folder
from unirl_pl.plan.planner import build_experts, plan_step, steady_state
from unirl_pl.plan.recipe import RecipeError, parsed_recipe, step_recipe
from unirl_pl.plan.search import candidates_up_to, largest_fitting
from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker, usage_from_snapshot

ROOT = Path(__file__).resolve().parents[1]
SD35 = str(ROOT / "recipes" / "sd35.yaml")
# The family recipe scaled to the tiny folders, as its CPU header says (float32: the tiny models' dtype).
TINY = {
    "model.generator.init_args.height": "32",
    "model.generator.init_args.width": "32",
    "model.generator.init_args.max_sequence_length": "16",
    "model.generator.init_args.dtype": "float32",
    "model.llm.init_args.dtype": "float32",
    "data.prompts_per_step": "2",
    "data.samples_per_prompt": "2",
    "model.rollout.num_steps": "4",
    "model.generator_algorithm.init_args.sde_window": "[0,2]",
    "model.rollout.max_new_tokens": "12",
    "model.rollout.micro_batch_size": "2",
    # The CPU header's stand-in for PickScore, whose real-size ViT-H/14 would not fit these tiny budgets.
    "model.rewards": "{jpeg_incompressibility: 1.0}",
    "model.reward_args": "null",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("plan")
    return make_sd3_pipeline(root / "sd3"), make_qwen2_chat_lm(root / "qwen")


def _overrides(settings: dict[str, str]) -> list[str]:
    return [f"--{key}={value}" for key, value in settings.items()]


def _tiny_recipe(**extra: str):
    return step_recipe(parsed_recipe(["--config", SD35, *_overrides({**TINY, **extra})]))


def _plan_tiny(recipe, folders: tuple[Path, str], real: bool = False, every_block: bool = False, search: bool = True):
    """``plan_step`` of ``recipe`` on the tiny pipeline and refiner with an unlimited budget."""
    pipeline, lm = folders
    return plan_step(
        recipe, budget=1 << 40, title="tiny", pipeline_path=str(pipeline), llm_path=lm, prompt_tokens=24,
        log=lambda _: None, real=real, every_block=every_block, search=search,
    )  # fmt: skip


# ------------------------------------------------------------------ fake vs real


@pytest.mark.slow
def test_fake_trace_matches_the_same_step_on_real_tensors(folders):
    """Every phase's tracked peak on fake tensors is within 10% of the same code on the real tiny models
    (weights loaded by their own ``build()``), also without the experience both sides build alike."""
    recipe = _tiny_recipe()
    plans = {real: _plan_tiny(recipe, folders, real=real) for real in (False, True)}
    fake, real = (plans[k].recipe_candidate.phases for k in (False, True))
    assert (
        set(fake) == set(real) == {"lm_decode", "text_encode", "dit_rollout", "vae_decode", "dit_update", "lm_update"}
    )
    for phase in fake:
        f, r = fake[phase], real[phase]
        assert abs(f.total - r.total) <= 0.10 * r.total, (phase, f, r)
        own_f, own_r = f.total - f.experience, r.total - r.experience
        assert abs(own_f - own_r) <= 0.10 * own_r, (phase, own_f, own_r)
        assert f.weights == r.weights and f.experience == r.experience, phase
    # The update's activations are real work, not a constant: at least the weights' order of magnitude.
    assert real["dit_update"].activations > real["dit_rollout"].activations > 0
    assert plans[False].held_lm_graph > 0 and abs(plans[False].held_lm_graph - plans[True].held_lm_graph) <= (
        0.10 * plans[True].held_lm_graph
    )


@pytest.mark.slow
def test_full_fine_tune_plan_counts_the_frozen_copies_and_the_whole_optimizer_state(folders):
    """``finetune: full`` on both experts: the fake trace equals the real step within 10% per phase, the trained
    state holds every weight in float32 at least three times over (the weights and Adam's two moments; at most
    four with every gradient live), and the frozen copies of both experts sit with the weights in place of the
    frozen bases LoRA trains on."""
    full = {"model.generator.init_args.finetune": "full", "model.llm.init_args.finetune": "full"}
    recipe = _tiny_recipe(**full)
    fake, real = (_plan_tiny(recipe, folders, real=r).recipe_candidate.phases for r in (False, True))
    for phase in fake:
        assert abs(fake[phase].total - real[phase].total) <= 0.10 * real[phase].total, (phase, fake[phase], real[phase])
    lora = _plan_tiny(_tiny_recipe(), folders).recipe_candidate.phases["dit_update"]
    pipeline, lm = folders
    weights = sum(p.numel() for p in SD3Transformer2DModel.from_pretrained(pipeline / "transformer").parameters())
    weights += sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(lm).parameters())
    trained = fake["dit_update"].trainable
    assert 3 * 4 * weights <= trained <= 4 * 4 * weights, (trained, weights)
    assert trained > 2 * lora.trainable  # the tiny models are barely wider than the recipe's LoRA rank
    # The copies take the frozen bases' place in ``weights``: without them the policy's move to the trained
    # state would leave ``weights`` 4 * weights bytes below LoRA's.
    assert fake["dit_update"].weights >= lora.weights


@pytest.mark.slow
def test_refiner_loss_in_micro_batches_leaves_only_its_gradients_through_the_dit_update(folders):
    """With ``rollout.lm_micro_batch_size`` the refiner's loss is backpropagated before the DiT's update: what
    it holds there shrinks from its whole graph to its LoRA gradients, and the DiT update's peak with it."""
    pipeline, lm = folders
    # As JSON: fit's parser refuses --model.rollout.lm_micro_batch_size=null (plan now reads what fit reads).
    settings = {size: {"model.rollout": f'{{"lm_micro_batch_size": {size}}}'} for size in ("null", "1")}
    plans = {size: _plan_tiny(_tiny_recipe(**setting), folders) for size, setting in settings.items()}
    whole, chunked = plans["null"], plans["1"]
    assert chunked.lm_micro_batch == 1 and whole.lm_micro_batch is None
    assert 0 < chunked.held_lm_graph < whole.held_lm_graph / 4
    peak = {k: p.recipe_candidate.phases["dit_update"].total for k, p in plans.items()}
    assert peak["1"] < peak["null"]


# ------------------------------------------------------------------ the update's memory is flat in K


def _update_peak(generator: SD3Generator, samples: int, micro_batch: int | None) -> int:
    """Bytes the DiT update adds at its peak over what is resident before it, for one prompt's ``samples``."""
    loop = DiffusionDenoise(
        generator, RolloutConfig(num_steps=4, micro_batch_size=micro_batch), FlowGRPO(sde_window=(0, 2))
    )
    cond = generator.encode(["a red cat on the left"] * samples)
    _, record = loop.sample(cond, [0] * samples, list(range(samples)), "rollout", seed=0)
    for param in generator.parameters():
        param.grad = None
    trainable = sum(p.numel() * p.element_size() for p in generator.parameters() if p.requires_grad)
    tracker = PlanMemTracker(trainable)
    # The record is resident before the update (tracked from the start, so slicing it adds nothing).
    tracker.track_external(generator, record.prev, record.sample, record.old_logp, *record.cond.values())
    with tracker:
        before = tracker.current().total
        settings = ExpertLoss(clip_eps=1e-4, beta=0.004)
        dit_loss(
            loop, record, torch.zeros(samples), settings, generator.adapter_disabled, backward=torch.Tensor.backward
        )
    return tracker.peak().total - before


@pytest.mark.slow
def test_dit_update_peak_is_flat_in_samples_per_prompt(folders):
    """With micro_batch_size set, 8 samples per prompt peak within 15% of 2 (the update runs one micro-batch
    and one step at a time); all rows at once, the peak grows with the samples, so the check can fail."""
    pipeline, _ = folders
    generator = SD3Generator(str(pipeline), height=32, width=32, max_sequence_length=16, dtype="float32")
    generator.build()
    two, eight = _update_peak(generator, 2, 2), _update_peak(generator, 8, 2)
    assert eight <= 1.15 * two, (two, eight)
    whole_two, whole_eight = _update_peak(generator, 2, None), _update_peak(generator, 8, None)
    assert whole_eight > 2.5 * whole_two, (whole_two, whole_eight)


# ------------------------------------------------------------------ pieces


def test_tracker_files_lora_state_apart_from_frozen_weights():
    """Frozen parameters (no gradient hook possible) are weights; trainable ones, their gradients and the
    optimizer's state are the trainable part; a root module may run twice in one trace."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    trainable = sum(p.numel() * 4 for p in model[1].parameters())
    optimizer = torch.optim.AdamW(model[1].parameters())
    tracker = PlanMemTracker(trainable)
    tracker.track_external(model, optimizer)
    with tracker:
        model(torch.ones(4, 8)).sum().backward()
        model(torch.ones(4, 8)).sum().backward()  # a second root call: guidance, the KL's reference
        optimizer.step()
    after = tracker.current()
    assert after.weights == sum(p.numel() * 4 for p in model[0].parameters())
    assert after.trainable == 4 * trainable + 2 * 4  # weights, gradients, two AdamW moments; a step per tensor
    assert tracker.peak().activations > 0


def test_usage_from_snapshot_moves_lora_bytes_out_of_weights():
    from torch.distributed._tools.mem_tracker import _MemRefType as Ref

    snapshot = {"cpu": {Ref.PARAM: 100, Ref.BUFFER: 10, Ref.GRAD: 5, Ref.OPT: 10, Ref.ACT: 7, Ref.TEMP: 3, Ref.OTH: 1}}
    usage = usage_from_snapshot(snapshot, trainable_param_bytes=5)
    assert (usage.weights, usage.trainable, usage.activations, usage.temporaries, usage.experience) == (
        105,
        20,
        7,
        3,
        1,
    )
    assert usage.total == 136


def test_all_rows_real_answers_value_questions_with_every_row_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), AllRowsReal():
        mask = torch.zeros(3, 5, dtype=torch.bool)
        values = torch.empty(3, 5)
        assert bool(mask.any())
        assert values[mask].shape == (15,)
        assert mask.nonzero().shape == (15, 2)


def test_all_rows_real_carries_the_values_of_tensors_made_from_python_data():
    """While carrying, a literal's and a small factory's values flow through operators, so the questions Qwen2.5-VL's
    image-grid arithmetic asks get the true answer (the patch count, a window's boolean index, the split sizes);
    a tensor without values (an activation, an ``empty``) still gets the all-rows answer, one written in place from
    it loses its values, and outside the scope nothing is carried."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), AllRowsReal() as rows:
        with rows.carrying_values():
            grid = torch.tensor([[1, 28, 28]])
            assert (grid.prod(-1) // 4).tolist() == [196]
            seqlens = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0)
            assert seqlens.tolist() == [784]
            index = torch.arange(10)
            assert index[index % 3 == 0].shape == (4,) and not bool((index > 9).any())
            activations = torch.empty(4, 5)
            assert activations[activations > 0].shape == (20,) and bool((activations > 0).all())
            index.copy_(activations[0].long().repeat(2))
            assert index[index > 5].shape == (10,)  # written from a tensor without values: all rows again
        assert torch.tensor([0, 0]).nonzero().shape == (2, 1)  # not carried


def test_largest_fitting_finds_the_boundary_by_traces():
    values = candidates_up_to(64, [3])
    assert values == [1, 2, 3, 4, 8, 16, 32, 64]
    traced: list[int] = []

    def peak(m: int) -> int:
        traced.append(m)
        return 10 + 3 * m if m < 16 else 10 + 5 * m  # not a straight line past 8

    assert largest_fitting(values, peak, budget=60) == 8  # the line says 16; 16 -> 90 does not fit, 8 -> 34 does
    assert largest_fitting(values, peak, budget=12) is None
    assert largest_fitting(values, peak, budget=10_000) == 64
    assert largest_fitting([4], peak, budget=100) == 4


def test_recipe_reading_merges_overlays_and_rejects_unknown_keys(tmp_path):
    overlaid = ["--config", SD35, "--config", str(ROOT / "recipes" / "fsdp.yaml")]
    recipe = step_recipe(parsed_recipe(overlaid), devices=8)
    assert recipe.fsdp and recipe.devices == 8 and recipe.generator_class is SD3Generator
    # init_args skipped, as on fit's command line (it is fit's parser).
    assert step_recipe(parsed_recipe([*overlaid, "--model.rollout.micro_batch_size=2"])).rollout.micro_batch_size == 2
    # Neither an unknown key nor a prefix of a known one (argparse would take it for micro_batch_size).
    for unknown in ("--model.rollout.micro_batch=4", "--model.rollout.micro_batchx=4"):
        with pytest.raises(ConfigError, match="model: unrecognized arguments: --rollout.micro_batch"):
            parsed_recipe([*overlaid, unknown])
    # The algorithms are the recipe's (what PolicyLosses calls), Flow-GRPO and token GRPO by default.
    assert (
        type(recipe.generator_algorithm).__name__ == "FlowGRPO" and type(recipe.llm_algorithm).__name__ == "TokenGRPO"
    )
    dapo = parsed_recipe(["--config", SD35, "--config", str(ROOT / "recipes" / "algorithms" / "dapo.yaml")])
    assert type(step_recipe(dapo).llm_algorithm).__name__ == "DAPO"
    # A family generator and a pretrained refiner (or none) only: the test bed's are no real-size models.
    with pytest.raises(RecipeError, match="plan needs a family generator"):
        step_recipe(parsed_recipe(["--config", str(ROOT / "recipes" / "tiny.yaml")]))


# ------------------------------------------------------------------ shipped configs


@pytest.mark.parametrize(
    "folder, cls, billions",
    [
        # Published sizes: the model cards (Qwen2.5: 1.54B, 7.61B), FINDINGS.md (SD3.5-M's transformer built
        # by diffusers, 2.24B), BFL/diffusers (FLUX.1 transformer 11.90B), T5-XXL's encoder 4.76B and UMT5-XXL's
        # 5.68B, OpenCLIP bigG text 0.695B and CLIP-L text 0.124B (with projection), Wan2.1's 1.42B and 14.29B,
        # Qwen2.5-VL-3B-Instruct 3,754,622,976 with its vision tower (the checkpoint's two bf16 safetensors shards
        # hold 7,509,245,952 bytes; the model card calls it 3B).
        ("stable-diffusion-3.5-medium/transformer", SD3Transformer2DModel, 2.24),
        ("stable-diffusion-3.5-medium/text_encoder", CLIPTextModelWithProjection, 0.124),
        ("stable-diffusion-3.5-medium/text_encoder_2", CLIPTextModelWithProjection, 0.695),
        ("stable-diffusion-3.5-medium/text_encoder_3", T5EncoderModel, 4.76),
        ("FLUX.1-dev/transformer", FluxTransformer2DModel, 11.90),
        ("FLUX.1-dev/text_encoder", CLIPTextModel, 0.123),
        ("Wan2.1-T2V-1.3B-Diffusers/transformer", WanTransformer3DModel, 1.42),
        ("Wan2.1-T2V-14B-Diffusers/transformer", WanTransformer3DModel, 14.29),
        ("Wan2.2-T2V-A14B-Diffusers/transformer_2", WanTransformer3DModel, 14.29),
        ("Wan2.1-T2V-1.3B-Diffusers/text_encoder", UMT5EncoderModel, 5.68),
        ("Wan2.1-T2V-1.3B-Diffusers/vae", AutoencoderKLWan, 0.127),
        ("Qwen2.5-1.5B-Instruct", Qwen2ForCausalLM, 1.54),
        ("Qwen2.5-7B-Instruct", Qwen2ForCausalLM, 7.61),
        ("Qwen2.5-VL-3B-Instruct", Qwen2_5_VLForConditionalGeneration, 3.755),
    ],
)
def test_shipped_configs_build_the_published_sizes(folder, cls, billions):
    model = meta_model(cls, SHIPPED / folder, torch.bfloat16)
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert abs(count / 1e9 - billions) <= 0.01 * billions, count


# PromptRL's recipes as a user plans them (no folder: the shipped configs); the published sizes of the trained
# models: FLUX.2 [klein] base 4B's transformer 3.88B, FLUX.1-dev's 11.90B; Qwen2.5-VL-3B-Instruct 3.755B of which
# its vision tower (frozen under full fine-tuning) 0.669B.
PROMPTRL = {"promptrl_klein": ("FLUX.2-klein-base-4B", 3.88e9), "promptrl_flux": ("FLUX.1-dev", 11.90e9)}
QWEN25_VL_3B, QWEN25_VL_3B_VISION = 3_754_622_976, 668_684_288


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PROMPTRL))
def test_promptrl_recipes_build_both_experts_fully_fine_tuned(name):
    """``plan --config recipes/promptrl_*.yaml`` builds the shipped FLUX and Qwen2.5-VL-3B configs with every weight
    of the DiT and of the refiner's language model trainable in float32 (the vision tower frozen), a frozen copy
    of each as the KL reference, and in steady state (weights, gradients, AdamW's two moments) 16 bytes per
    trained weight: 4 bytes x 3-4 x the parameters of both experts, where LoRA would hold a few hundred MiB."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from unirl_pl.experts import VLMRefinerExpert
    from unirl_pl.experts.finetune import reference_of
    from unirl_pl.plan.tracker import PlanMemTracker

    folder, dit_params = PROMPTRL[name]
    recipe = step_recipe(parsed_recipe(["--config", str(ROOT / "recipes" / f"{name}.yaml")]))
    assert recipe.llm_class is VLMRefinerExpert and recipe.devices == 6 and recipe.fsdp
    mode = FakeTensorMode()
    experts = build_experts(recipe, None, None, mode)
    assert (experts.pipeline_folder, experts.llm_folder) == (SHIPPED / folder, SHIPPED / "Qwen2.5-VL-3B-Instruct")
    dit, llm = experts.generator.model, experts.llm
    assert isinstance(llm.model, Qwen2_5_VLForConditionalGeneration)
    unique = lambda module: {id(p): p for p in module.parameters()}.values()  # noqa: E731 - tied embeddings once
    trained = [p for m in (dit, llm) for p in unique(m) if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trained)
    assert abs(sum(p.numel() for p in unique(dit) if p.requires_grad) - dit_params) <= 0.01 * dit_params
    assert sum(p.numel() for p in unique(llm.model) if p.requires_grad) == QWEN25_VL_3B - QWEN25_VL_3B_VISION
    assert sum(p.numel() for p in unique(llm.model) if not p.requires_grad) == QWEN25_VL_3B_VISION
    for owner, policy in ((experts.generator, dit), (llm, llm.model)):
        reference = reference_of(owner)
        assert reference is not None and not any(p.requires_grad for p in reference.parameters())
        assert sum(p.numel() for p in unique(reference)) == sum(p.numel() for p in unique(policy))
    count = sum(p.numel() for p in trained)
    with mode:
        optimizers = steady_state(experts, recipe, [Role.GENERATOR, Role.REFINER])
        tracker = PlanMemTracker(sum(p.numel() * p.element_size() for p in trained))
        tracker.track_external(*experts.modules(), *(o.optimizer for o in optimizers))
        held = tracker.current().trainable
    # Weights, gradients and AdamW's two moments in float32, and AdamW's float32 step counter per tensor.
    assert 3 * 4 * count <= held <= 4 * 4 * count + 4 * len(trained), (held, count)


# ------------------------------------------------------------------ the command


@pytest.mark.slow
def test_plan_command_prints_the_table_and_writes_json(folders, tmp_path, capsys):
    pipeline, lm = folders
    out = tmp_path / "plan.json"
    overrides = [f"--{k}={v}" for k, v in TINY.items() if k != "data.samples_per_prompt"]
    args = ["plan", "--config", str(ROOT / "recipes" / "sd35.yaml"), "--pipeline-path", str(pipeline)]
    args += ["--llm-path", lm, "--gpu-memory-gb", "4.1", "--prompt-tokens", "24", "--json", str(out), "--quiet"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, *overrides, "--data.samples_per_prompt=2"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    for phase in ("lm_decode", "text_encode", "dit_rollout", "vae_decode", "dit_update", "lm_update"):
        assert phase in printed
    assert "recipe setting (micro_batch_size 2, gradient checkpointing off): fits" in printed
    plan = json.loads(out.read_text())
    assert plan["recipe"]["fits"] and plan["recipe"]["micro_batch_size"] == 2
    assert plan["largest_micro_batch_size"]["without_checkpointing"] == 4  # every image in one micro-batch
    assert plan["needs_gradient_checkpointing"] is False
    # The budget is 0.1 GiB (4.1 - the 4 GiB reserve): the tiny step's peak sits under it.
    assert 0 < plan["recipe"]["phases"]["dit_update"]["total"] <= plan["budget_bytes"]


def test_plan_command_refuses_a_missing_recipe_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", "no/such/recipe.yaml"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "error: --config no/such/recipe.yaml: no such file"


@pytest.mark.parametrize(
    "override, message",
    [
        ("--data.init_args.prompts_per_step=-4", "error: data: prompts_per_step must be >= 1, got -4"),
        ("--data.prompts_per_step=0", "error: data: prompts_per_step must be >= 1, got 0"),
        ("--data.val_batch_size=0", "error: data: val_batch_size must be >= 1, got 0"),
        # The type is the parser's to check, as fit's (tests/test_plan_config.py compares the two commands).
        ("--data.prompts_per_step=two", "error: data.prompts_per_step: Expected a <class 'int'>. Got value: two"),
    ],
)
def test_plan_refuses_a_count_fit_refuses_in_one_line(override, message, capsys):
    # Was an IndexError traceback from the refiner's decode trace; now the data module's own check, before tracing.
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", str(ROOT / "recipes" / "sd35.yaml"), override, "--no-search", "--quiet"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == message and captured.out == ""
    assert "Traceback" not in captured.err


def test_a_missing_model_folder_is_an_error_not_the_shipped_default():
    """A folder given on the command line or in the recipe must exist (or name a shipped config); the recipe's hub
    id maps to the shipped config of that name, and only a recipe without one falls back to the family's default."""
    assert resolve_folder(None, "Qwen/Qwen2.5-7B-Instruct", None, "LM") == SHIPPED / "Qwen2.5-7B-Instruct"
    assert resolve_folder(None, None, "FLUX.1-dev", "pipeline") == SHIPPED / "FLUX.1-dev"
    assert resolve_folder(None, "/models/FLUX.1-dev", "SD", "pipeline") == SHIPPED / "FLUX.1-dev", "another machine's"
    assert resolve_folder("Wan2.2-T2V-A14B-Diffusers", None, "FLUX.1-dev", "p") == SHIPPED / "Wan2.2-T2V-A14B-Diffusers"
    with pytest.raises(FileNotFoundError, match="--pipeline-path='/no/such/folder' is not a local folder.*FLUX.1-dev"):
        resolve_folder("/no/such/folder", None, "FLUX.1-dev", "pipeline")
    with pytest.raises(FileNotFoundError, match=r"model\.pipeline_path='/elsewhere/model' is not a local folder"):
        resolve_folder(None, "/elsewhere/model", "FLUX.1-dev", "pipeline")


def test_plan_refuses_a_recipe_pipeline_path_that_is_missing_in_one_line(capsys):
    """Was planned from the family's shipped config without a word; the fallback is for a recipe without a path."""
    missing = "/no/such/stable-diffusion"
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--config", SD35, f"--model.pipeline_path={missing}", "--no-search", "--quiet"])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == "" and "Traceback" not in captured.err
    first = captured.err.splitlines()[0]
    assert first.startswith(f"error: no pipeline config: model.pipeline_path='{missing}' is not a local folder"), first


@pytest.mark.integration
def test_fsdp_plan_shards_the_trained_experts(folders):
    """Over 2 fake ranks the trained experts' weights are halved on each rank; frozen parts stay whole."""
    pipeline, lm = folders
    overlaid = ["--config", SD35, "--config", str(ROOT / "recipes" / "fsdp.yaml"), *_overrides(TINY)]
    weights = {}
    for devices in (1, 2):
        config = parsed_recipe([*overlaid, f"--data.prompts_per_step={2 * devices}"])  # the same per-rank step
        plan = plan_step(
            step_recipe(config, devices=devices),
            budget=1 << 40,
            title="fsdp",
            pipeline_path=str(pipeline),
            llm_path=lm,
            prompt_tokens=24,
            log=lambda _: None,
        )
        assert plan.fsdp == (devices > 1)
        weights[devices] = plan.recipe_candidate.phases["text_encode"].weights
    generator = SD3Generator(str(pipeline), height=32, width=32, max_sequence_length=16, dtype="float32")
    generator.build()
    dit = sum(p.numel() * 4 for p in generator.model.parameters() if not p.requires_grad)
    assert weights[1] - weights[2] >= 0.4 * dit
