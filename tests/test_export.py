"""Exported adapters load with peft / diffusers' own loaders into fresh models and reproduce the trained outputs."""

from __future__ import annotations

import pytest
import torch
from diffusers import SD3Transformer2DModel
from peft import PeftModel

from tests.helpers import run_cli
from unirl_pl.experts._common import seeded_cpu_init
from unirl_pl.export import main as export_main

FAST = (
    "--trainer.limit_val_batches=0",
    "--model.rollout.num_steps=4",
    "--model.generator_algorithm.init_args.sde_window=[0,2]",
)


def _assert_roundtrip(module, out) -> None:
    llm, dit = module.llm, module.generator.transformer
    # LM: a freshly built base (adapter stripped) + PeftModel.from_pretrained reproduces the trained logits.
    fresh = type(llm)(hidden_size=llm.hidden_size, num_layers=llm.num_layers, lora_rank=llm.lora_rank)
    fresh.build()
    base = fresh.model.unload()
    peft_model = PeftModel.from_pretrained(base, str(out / "llm")).eval()
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = llm(ids, mask).logits
        got = peft_model(input_ids=ids, attention_mask=mask).logits
        with llm.adapter_disabled():
            ref = llm(ids, mask).logits
    assert (want - ref).abs().max() > 1e-4, "training moved the LM adapter (otherwise the test proves nothing)"
    assert (want - got).abs().max() <= 1e-6

    # DiT: a bare diffusers model + load_lora_adapter reproduces the trained velocity.
    with seeded_cpu_init(dit.init_seed):
        bare = SD3Transformer2DModel(**dit.tiny_config())
    bare.load_lora_adapter(str(out / "transformer"), use_safetensors=True)
    c, h, w = dit.latent_shape
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, c, h, w, generator=gen)
    hidden = torch.randn(2, 5, dit.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, dit.pooled_projection_dim, generator=gen)
    with torch.no_grad():
        want_v = dit.velocity(x, 0.5, hidden, pooled)
        (got_v,) = bare(
            hidden_states=x,
            encoder_hidden_states=hidden,
            pooled_projections=pooled,
            timestep=torch.full((2,), 500.0),
            return_dict=False,
        )
        with dit.adapter_disabled():
            ref_v = dit.velocity(x, 0.5, hidden, pooled)
    assert (want_v - ref_v).abs().max() > 1e-6, "training moved the DiT adapter"
    assert (want_v - got_v).abs().max() <= 1e-6


@pytest.mark.slow
def test_adapter_export_callback_and_command_round_trip(tmp_path):
    out = tmp_path / "adapters"
    cli = run_cli(
        tmp_path,
        "--trainer.max_steps=2",
        *FAST,
        "--trainer.callbacks+=unirl_pl.callbacks.AdapterExport",
        f"--trainer.callbacks.output_dir={out}",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpts'}",
        "--trainer.callbacks.every_n_train_steps=2",
    )
    assert (out / "llm" / "adapter_config.json").is_file()
    assert (out / "transformer" / "pytorch_lora_weights.safetensors").is_file()
    _assert_roundtrip(cli.model, out)

    # The command rebuilds the module from the recipe and exports from the checkpoint: same adapters.
    (ckpt,) = (tmp_path / "ckpts").glob("*.ckpt")
    config = next(tmp_path.rglob("config.yaml"))
    out2 = tmp_path / "from_ckpt"
    written = export_main(["--config", str(config), "--ckpt", str(ckpt), "--out", str(out2)])
    assert set(written) == {"llm", "transformer"}
    _assert_roundtrip(cli.model, out2)
