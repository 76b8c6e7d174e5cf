"""Full fine-tuning (``finetune: full``) of either expert: which weights train, the frozen copy that is the KL
reference, checkpoints and resume, the whole-model export, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.helpers import TINY, read_metrics, run_cli
from unirl_pl.experts import FlowTransformerExpert, TinyCausalLMExpert
from unirl_pl.experts.finetune import REFERENCE_ATTR, check_finetune, reference_of

TINY_RECIPE = Path(TINY)
FULL = (
    "--model.llm.init_args.finetune=full",
    "--model.generator.init_args.transformer.init_args.finetune=full",
)
FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)


def _lm(finetune: str = "full") -> TinyCausalLMExpert:
    lm = TinyCausalLMExpert(
        hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1, finetune=finetune
    )
    lm.build()
    return lm


def test_finetune_setting_is_checked():
    with pytest.raises(ValueError, match=r"TinyCausalLMExpert\.finetune must be 'lora' or 'full', got 'qlora'"):
        TinyCausalLMExpert(finetune="qlora")
    assert check_finetune("full", "x") == "full"


def test_full_lm_trains_every_weight_against_a_frozen_copy():
    lm = _lm()
    params = dict(lm.model.named_parameters())
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params.values())
    assert not any("lora_" in name for name in params), "full fine-tuning attaches no adapter"
    reference = reference_of(lm)
    assert reference is not None and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    # The reference is a copy, not the same tensors: moving the policy must leave it where it was.
    ids = torch.tensor([[3, 4, 5, 6]])
    mask = torch.ones_like(ids)
    before = lm(ids, mask).logits.detach()
    with torch.no_grad():
        for p in lm.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = lm(ids, mask).logits.detach()
    assert (after - before).abs().max() > 1e-3
    with lm.adapter_disabled():
        assert lm.model is reference
        ref = lm(ids, mask).logits.detach()
        with lm.adapter_disabled():  # nested: still the reference inside
            assert lm.model is reference
        assert lm.model is reference
    assert torch.equal(ref, before), "the reference is the initial weights"
    assert lm.model is not reference, "the policy is back after the context"
    lm.train()
    assert lm.model.training and not reference.training, "the frozen copy stays in eval mode"


def test_reference_is_restored_after_an_error():
    lm = _lm()
    policy = lm.model
    with pytest.raises(RuntimeError, match="boom"), lm.adapter_disabled():
        raise RuntimeError("boom")
    assert lm.model is policy


def test_lora_expert_has_no_copy_and_full_expert_refuses_adapter_io(tmp_path):
    assert reference_of(_lm("lora")) is None
    lm = _lm()
    with pytest.raises(ValueError, match=r"save_adapter needs a LoRA adapter, but finetune is 'full'"):
        lm.save_adapter(str(tmp_path))
    with pytest.raises(ValueError, match=r"load_adapter needs a LoRA adapter"):
        lm.load_adapter(str(tmp_path))


def test_full_dit_keeps_initial_weights_as_reference():
    dit = FlowTransformerExpert(sample_size=8, num_layers=1, finetune="full")
    dit.build()
    assert all(p.requires_grad for p in dit.model.parameters())
    x = torch.randn(2, 4, 8, 8)
    hidden, pooled = torch.randn(2, 5, 32), torch.randn(2, 32)
    sigma = torch.tensor([0.5, 0.7])
    base = dit.velocity(x, sigma, hidden, pooled).detach()
    with torch.no_grad():
        next(dit.model.parameters()).add_(1.0)
    with dit.adapter_disabled():
        assert torch.equal(dit.velocity(x, sigma, hidden, pooled), base)
    assert not torch.equal(dit.velocity(x, sigma, hidden, pooled).detach(), base)


def _trainable(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.named_parameters() if v.requires_grad}


def _references(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.named_parameters() if f".{REFERENCE_ATTR}." in k}


@pytest.mark.slow
def test_full_fit_moves_every_weight_and_resumes_bit_exact(tmp_path, capsys):
    """Both experts fully trained: every trained tensor moves, the frozen copies do not, the KL is 0 at the
    first step and above 0 after it; a checkpoint holds no copy, and a resume equals the straight run."""
    from unirl_pl.cli import main

    initial = main(["--config", TINY, "--trainer.logger=false", *FULL], run=False)
    initial.model.configure_model()
    start, start_refs = _trainable(initial), _references(initial)
    assert start_refs, "each fully trained expert registers its frozen copy"

    ckpts = tmp_path / "ckpts"
    callback = (
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
    )
    straight = run_cli(tmp_path, "--trainer.max_steps=4", *FAST, *FULL, *callback, name="full")
    end, end_refs = _trainable(straight), _references(straight)
    assert end.keys() == start.keys()
    # The last SD3 block is ``context_pre_only``: its text queries attend, but their outputs are dropped, so
    # ``add_q_proj`` there has no gradient path (an architecture fact, true of SD3.5 too).
    dead = {f"generator.transformer.model.transformer_blocks.1.attn.add_q_proj.{p}" for p in ("weight", "bias")}
    unmoved = [k for k in start if torch.equal(start[k], end[k]) and k not in dead]
    assert not unmoved, f"trained tensors that did not move: {unmoved[:5]}"
    assert all(torch.equal(start_refs[k], end_refs[k]) for k in start_refs), "the frozen copy moved"

    rows = [r for r in read_metrics(straight) if "llm/kl" in r]
    assert rows[0]["llm/kl"] == 0.0 and rows[0]["transformer/kl"] == 0.0
    assert rows[-1]["llm/kl"] > 0.0 and rows[-1]["transformer/kl"] > 0.0

    ckpt = ckpts / "epoch=0-step=2.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert not any(REFERENCE_ATTR in k for k in saved["state_dict"]), "the copy is rebuilt, not saved"
    assert any(k.endswith("q_proj.weight") for k in saved["state_dict"]), "the full weights are saved"
    assert saved["unirl_run_identity"]["llm.finetune"] == "full"

    resumed = run_cli(tmp_path, "--trainer.max_steps=4", *FAST, *FULL, f"--ckpt_path={ckpt}", name="resumed")
    again = _trainable(resumed)
    diffs = {k: (end[k] - again[k]).abs().max().item() for k in end}
    assert max(diffs.values()) == 0.0, max(diffs.items(), key=lambda kv: kv[1])
    assert all(torch.equal(end_refs[k], v) for k, v in _references(resumed).items())

    # The same checkpoint under LoRA is another run: refused in one line before it trains.
    with pytest.raises(SystemExit) as refusal:
        run_cli(tmp_path, "--trainer.max_steps=4", *FAST, FULL[1], f"--ckpt_path={ckpt}", name="lora")
    assert refusal.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: the checkpoint") and "llm.finetune: checkpoint='full' now='lora'" in line


@pytest.mark.slow
def test_export_of_a_full_fine_tune_loads_with_the_auto_classes(tmp_path):
    """``export`` writes the refiner as a transformers folder and the component generator's transformer as a
    diffusers model folder; both load with no base checkpoint and reproduce the trained model's outputs."""
    from diffusers import SD3Transformer2DModel

    from unirl_pl.export import main as export

    ckpts = tmp_path / "ckpts"
    fit = run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        *FAST,
        *FULL,
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpts}",
        "--trainer.callbacks.every_n_train_steps=2",
        name="fit",
    )
    (ckpt,) = ckpts.glob("*.ckpt")
    written = export(["--config", str(_full_recipe(tmp_path)), "--ckpt", str(ckpt), "--out", str(tmp_path / "out")])
    assert {p.name for p in written.values()} == {"refiner", "generator"}

    lm = fit.model.llm
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        trained = lm(ids, mask).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "refiner")(
            input_ids=ids, attention_mask=mask
        ).logits
    assert (trained - loaded).abs().max().item() <= 1e-5
    assert not (tmp_path / "out" / "refiner" / "adapter_config.json").exists()

    dit = fit.model.generator.expert
    model = SD3Transformer2DModel.from_pretrained(tmp_path / "out" / "generator")
    x = torch.randn(2, *dit.latent_shape)
    sigma = torch.tensor([0.4, 0.9])
    hidden, pooled = torch.randn(2, 6, 32), torch.randn(2, 32)
    with torch.no_grad():
        ours = dit.velocity(x, sigma, hidden, pooled)
        with dit.adapter_disabled():
            base = dit.velocity(x, sigma, hidden, pooled)
        theirs = model(
            hidden_states=x, encoder_hidden_states=hidden, pooled_projections=pooled, timestep=sigma * 1000
        ).sample
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - base).abs().max().item() > 1e-6, "the exported model is the trained one, not the base"


def _full_recipe(tmp_path: Path) -> Path:
    """The tiny recipe with both experts fully fine-tuned, as one file (``export`` reads one recipe)."""
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    experts = recipe["model"]["init_args"]
    experts["llm"]["init_args"]["finetune"] = "full"
    experts["generator"]["init_args"]["transformer"]["init_args"]["finetune"] = "full"
    path = tmp_path / "tiny_full.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_full_family_generator_exports_a_pipeline_folder(tmp_path):
    """A family's full fine-tune is written as a whole pipeline folder: ``DiffusionPipeline.from_pretrained``
    loads it with no base checkpoint, its transformer is the trained one, the other components the base's."""
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

    from tests.pipelines import make_sd3_pipeline
    from unirl_pl.generators import SD3Generator

    source = make_sd3_pipeline(tmp_path / "sd3", with_t5=False)
    generator = SD3Generator(str(source), dtype="float32", height=32, width=32, finetune="full")
    generator.build()
    assert all(p.requires_grad for p in generator.model.parameters())
    assert not any(p.requires_grad for p in generator.text_encoder.parameters())
    with torch.no_grad():
        for p in generator.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    generator.save_model(str(tmp_path / "out"))
    with pytest.raises(ValueError, match="save_adapter needs a LoRA adapter"):
        generator.save_adapter(str(tmp_path / "lora"))

    # The fixture has no T5 (as SD3.5 run without it): the pipeline is told so, as for the source folder.
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "out", text_encoder_3=None, tokenizer_3=None)
    assert isinstance(pipe, StableDiffusion3Pipeline)
    cond = generator.encode(["a red circle", "a blue square"])
    x = torch.randn(2, *generator.latent_shape)
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = generator.velocity(x, sigma, cond)
        theirs = generator.velocity_of(pipe.transformer, x, sigma, cond)
        with generator.adapter_disabled():
            base = generator.velocity(x, sigma, cond)
    assert (ours - theirs).abs().max().item() <= 1e-6
    assert (ours - base).abs().max().item() > 1e-4, "the folder holds the trained transformer, not the base"
    assert (tmp_path / "out" / "vae" / "config.json").is_file() and (tmp_path / "out" / "model_index.json").is_file()


def test_fsdp2_computes_a_low_precision_full_fine_tune_in_its_dtype():
    """Under FSDP2 a bf16 full fine-tune keeps float32 master weights and computes in bf16, reducing gradients in
    float32 (DeepSpeed's bf16); a LoRA expert and a float32 full fine-tune compute in their parameters' dtype."""
    from unirl_pl.distributed import mixed_precision

    bf16_full = TinyCausalLMExpert(dtype="bfloat16", finetune="full")
    policy = mixed_precision(bf16_full)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    for expert in (TinyCausalLMExpert(dtype="bfloat16"), TinyCausalLMExpert(finetune="full")):
        assert mixed_precision(expert).param_dtype is None and mixed_precision(expert).reduce_dtype is None
