"""ShapesWorld-Edit's experts: the instruction vocabulary, the in-context edit DiT and generator, and the edit
pretraining data and modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from unirl_pl.experts import FlowTransformerExpert, TextEncoderExpert
from unirl_pl.generators import ComponentGenerator, InContextEditGenerator
from unirl_pl.generators.in_context import SOURCE_KEY
from unirl_pl.pretrain import EditFlowPretrain, build_shapes_tokenizer
from unirl_pl.pretrain.common import build_text_encoder
from unirl_pl.pretrain.data import (
    EditDataModule,
    InstructionDataModule,
    draw_edits,
    edit_batch,
    heldout_edit_batches,
    instruction_batch,
    uncolored,
)
from unirl_pl.shapes import EDIT_KINDS, is_heldout_edit, make_edit_set, parse_instruction
from unirl_pl.shapes.edit_prompts import EDIT_WORDS


def _dit(**kwargs: object) -> FlowTransformerExpert:
    dit = FlowTransformerExpert(sample_size=8, patch_size=2, in_channels=3, **kwargs)
    dit.build()
    with torch.no_grad():  # a trained-looking adapter (B != 0), as in an RL run after its first steps
        for name, p in dit.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return dit


def _edit_generator() -> InContextEditGenerator:
    text = TextEncoderExpert(hidden_size=32, intermediate_size=64, projection_dim=32)
    generator = InContextEditGenerator(_dit(), text, vae=None)
    generator.build()
    return generator


def test_the_edit_vocabulary_reads_every_instruction_and_keeps_every_scene_id() -> None:
    scenes, edits = build_shapes_tokenizer(vocabulary="scenes"), build_shapes_tokenizer(vocabulary="edits")
    old = scenes.get_vocab()
    assert all(edits.get_vocab()[word] == i for word, i in old.items())  # appended: a scene word keeps its id
    assert {"make", "the", "into", "should"} <= set(EDIT_WORDS)
    for split, phrasing in (("train", None), ("heldout", None), ("heldout", "train")):
        for row in make_edit_set(60, 3, split, phrasing=phrasing):
            for text in (row["prompt"], row["instruction"]):
                assert edits.unk_token_id not in edits(text)["input_ids"], text
                # The scene tokenizer does not read instructions: the reason the edit experts have their own.
    assert any(scenes.unk_token_id in scenes(r["instruction"])["input_ids"] for r in make_edit_set(5, 0, "train"))
    with pytest.raises(ValueError, match="vocabulary must be one of"):
        build_shapes_tokenizer(vocabulary="scene")


def test_the_dit_reads_the_source_beside_the_target_and_returns_the_target_half() -> None:
    dit = _dit()
    g = torch.Generator().manual_seed(0)
    x, source = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g)
    hidden, pooled, sigma = torch.randn(2, 5, 32, generator=g), torch.randn(2, 32, generator=g), torch.rand(2)
    v = dit.velocity(x, sigma, hidden, pooled, source=source)
    assert v.shape == x.shape
    # The diffusers model on the diptych [target | source]: the kept half is the target's (left) one.
    (full,) = dit.model(
        hidden_states=torch.cat([x, source], dim=-1),
        encoder_hidden_states=hidden,
        pooled_projections=pooled,
        timestep=sigma * 1000,
        return_dict=False,
    )
    torch.testing.assert_close(v, full[..., :8])
    assert not torch.allclose(v, full[..., 8:], atol=1e-3)
    # The source is read: another source changes the target's velocity; none is text-to-image.
    assert not torch.allclose(v, dit.velocity(x, sigma, hidden, pooled, source=source.flip(0)), atol=1e-4)
    assert dit.velocity(x, sigma, hidden, pooled).shape == x.shape
    with pytest.raises(ValueError, match="must have the shape of the target"):
        dit.velocity(x, sigma, hidden, pooled, source=source[..., :4])


def test_the_edit_generator_encodes_sources_at_the_target_size_and_conditions_on_them() -> None:
    generator = _edit_generator()
    assert generator.takes_source_images and not generator.text_sees_source
    small = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(2))
    flat = torch.tensor([0.2, 0.5, 0.9])[:, None, None]
    cond = generator.encode_source([small, flat.expand(3, 16, 24)])
    torch.testing.assert_close(cond[SOURCE_KEY][0], small * 2 - 1)  # pixel space: [0, 1] -> [-1, 1]
    torch.testing.assert_close(cond[SOURCE_KEY][1], (flat * 2 - 1).expand(3, 8, 8))  # resized to the target's 8x8
    text = generator.encode(["make the red circle blue", "remove the red circle"])
    x, sigma = torch.randn(2, 3, 8, 8), torch.full((2,), 0.5)
    with_source = generator.velocity(x, sigma, text | cond)
    expected = generator.transformer.velocity(x, sigma, text["hidden"], text["pooled"], source=cond[SOURCE_KEY])
    torch.testing.assert_close(with_source, expected)
    torch.testing.assert_close(
        generator.velocity(x, sigma, text), ComponentGenerator.velocity(generator, x, sigma, text)
    )
    with pytest.raises(ValueError, match="source image 0 must be"):
        generator.encode_source([torch.rand(8, 8)])


def test_the_edit_generator_refuses_a_transformer_without_positions_for_the_source() -> None:
    text = TextEncoderExpert(hidden_size=32, intermediate_size=64, projection_dim=32)
    dit = FlowTransformerExpert(sample_size=8, patch_size=2, in_channels=3)
    dit.build()
    dit.model.register_to_config(pos_embed_max_size=6)  # 8 patches wide are needed
    generator = InContextEditGenerator(dit, text, vae=None)
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        generator.build()


def test_edit_batches_are_pure_functions_of_seed_and_step_with_canonical_instructions() -> None:
    a, b, c = edit_batch(0, 5, 16), edit_batch(0, 5, 16), edit_batch(0, 6, 16)
    torch.testing.assert_close(a["sources"], b["sources"])
    assert a["captions"] == b["captions"] and a["captions"] != c["captions"]
    assert a["sources"].shape == a["images"].shape == (16, 3, 32, 32)
    assert float(a["sources"].min()) == -1.0 and float(a["sources"].max()) == 1.0
    assert not torch.equal(a["sources"], a["images"])  # every edit changes its image
    for caption in a["captions"]:
        kind, canonical = parse_instruction(caption)
        assert kind in EDIT_KINDS and canonical == caption

    # The held-out fraction: 0 draws only train compositions, 1 only held-out ones, the default about a quarter.
    def heldout_share(fraction: float) -> float:
        edits = [e for step in range(8) for e in draw_edits(1, step, 32, fraction, 2)]
        assert {e.kind for e in edits} == set(EDIT_KINDS)
        return float(np.mean([is_heldout_edit(*e.composition) for e in edits]))

    assert heldout_share(0.0) == 0.0 and heldout_share(1.0) == 1.0
    assert 0.15 < heldout_share(0.25) < 0.35


def test_instruction_pairs_drop_colors_only_from_the_targets() -> None:
    clean, flawed = instruction_batch(0, 3, 64), instruction_batch(0, 3, 64, drop_colors=1.0)
    assert clean["prompts"] == flawed["prompts"]
    assert flawed["captions"] == [uncolored(c) for c in clean["captions"]]
    assert all(parse_instruction(c)[1] == c for c in clean["captions"])
    dropped = sum(a != b for a, b in zip(instruction_batch(0, 3, 64, 0.5)["captions"], clean["captions"], strict=True))
    assert 16 < dropped < 48


def test_held_out_validation_edits_are_held_out_compositions_in_train_words() -> None:
    (batch,) = heldout_edit_batches(10, 1000, 16)
    assert len(batch["rows"]) == len(batch["prompts"]) == batch["sources"].shape[0] == 10
    for row in batch["rows"]:
        assert is_heldout_edit(row["kind"], row["color"], row["value"])
    modules = (EditDataModule(val_prompts=10), InstructionDataModule(val_prompts=10))
    assert [len(m.val_dataloader()) for m in modules] == [1, 1]
    with pytest.raises(ValueError, match="heldout must be in"):
        EditDataModule(heldout=1.5)


def test_a_loaded_text_encoder_gains_the_instruction_words_with_its_scene_rows_kept(tmp_path) -> None:
    scenes = TextEncoderExpert(hidden_size=32, intermediate_size=64, projection_dim=32)
    build_text_encoder(scenes)
    scenes.model.save_pretrained(tmp_path)
    scenes.tokenizer.save_pretrained(tmp_path)
    loaded = TextEncoderExpert(pretrained_path=str(tmp_path))
    torch.manual_seed(0)
    build_text_encoder(loaded, vocabulary="edits")
    old, new = scenes.model.get_input_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert new.shape[0] == len(build_shapes_tokenizer(vocabulary="edits")) > old.shape[0]
    torch.testing.assert_close(new[: old.shape[0]], old)
    assert loaded.tokenizer.unk_token_id not in loaded.tokenizer("make the red circle blue")["input_ids"]
    hidden, _ = loaded.encode(["make the red circle blue", "remove the red circle"])
    assert torch.isfinite(hidden).all()


def test_edit_pretraining_trains_on_the_source_and_scores_held_out_edits() -> None:
    module = EditFlowPretrain(
        transformer=FlowTransformerExpert(sample_size=32, patch_size=8, in_channels=3, init_seed=0),
        text_encoder=TextEncoderExpert(hidden_size=32, intermediate_size=64, projection_dim=32),
        train_text_encoder=True,
        val_num_steps=2,
    )
    module.configure_model()
    batch = edit_batch(0, 0, 4)
    seen = []
    velocity = module.transformer.velocity

    def spy(*args, source=None, **kwargs):
        seen.append(source)
        return velocity(*args, source=source, **kwargs)

    module.transformer.velocity = spy
    module.log = lambda *a, **k: None
    loss = module.training_step(batch, 0)
    assert torch.isfinite(loss) and seen[0] is batch["sources"]
    loss.backward()
    assert module.transformer.model.pos_embed.proj.weight.grad.abs().sum() > 0
    logged = {}
    module.log = lambda key, value, **k: logged.setdefault(key, value)
    module.transformer.velocity = velocity
    module.validation_step(heldout_edit_batches(5, 1000, 5)[0], 0)
    assert {f"val/strict/{k}" for k in (*EDIT_KINDS, "overall")} == {k for k in logged if k.startswith("val/strict")}
    assert all(0.0 <= v <= 1.0 for v in logged.values())
    assert np.isclose(logged["val/soft/overall"], np.mean([logged[f"val/soft/{k}"] for k in EDIT_KINDS]))
