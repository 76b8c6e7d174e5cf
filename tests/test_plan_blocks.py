"""The plan's stand-ins for repeated blocks (``unirl_pl.plan.blocks``): the same bytes as tracing every block.

Each test traces the same forward twice on fake tensors under the plan's tracker, once with the stand-ins and once
without, and compares the peak and what stays held. The cases are the ones the stand-ins must get right:

- a decode's KV cache, which grows at every layer, so the last layer (a stand-in) rises from the highest start and
  holds the phase's peak: dropping the stand-in's raise of the peak is caught;
- outputs that share one storage or view an input (the stand-in must not allocate them apart);
- calls that must be traced: autograd on, a hook below the block, a call of another kind (shapes);
- a stand-in that leaves other bytes held than its template stops the plan with an error naming the block;
- the whole plan of a tiny recipe with 4-block models, phase by phase, against ``every_block``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from unirl_pl.plan.blocks import BlockStandIns, repeated_blocks
from unirl_pl.plan.models import to_fake
from unirl_pl.plan.tracker import AllRowsReal, PlanMemTracker

LAYERS = 4


def fake_lm(mode: FakeTensorMode) -> Qwen2ForCausalLM:
    """A 4-layer Qwen2 whose MLP (1024 wide) outweighs its logits (vocab 64): a layer's rise sets the peak."""
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).eval()
    to_fake([model], mode)
    return model


def trace(run, roots, stand_ins: bool, check: bool = False):
    """Run ``run()`` under a fresh tracker (with stand-ins or not); returns (peak, held after, stand-ins object)."""
    tracker = PlanMemTracker()
    tracker.track_external(*roots)
    with tracker:
        before = tracker.current().total
        if stand_ins:
            with BlockStandIns(roots, tracker, check=check) as blocks:
                kept = run()
        else:
            blocks = None
            kept = run()
        held = tracker.current().total - before
        del kept
    return tracker.peak(), held, blocks


def decode(model: Qwen2ForCausalLM, rows: int = 6, prompt: int = 40, steps: int = 3):
    """A prefill and ``steps`` one-token forwards with a KV cache, no grad; returns the cache (held)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.ones(rows, prompt, dtype=torch.long), past_key_values=cache, use_cache=True)
        for _ in range(steps):
            model(input_ids=torch.ones(rows, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    return cache


def test_a_decode_with_stand_ins_peaks_and_holds_what_tracing_every_layer_does():
    mode = FakeTensorMode()
    model = fake_lm(mode)
    with mode:
        full_peak, full_held, _ = trace(lambda: decode(model), [model], stand_ins=False)
        peak, held, blocks = trace(lambda: decode(model), [model], stand_ins=True)
    assert peak == full_peak and held == full_held > 0
    # One template per kind of call (the prefill; each one-token step, whose cache is longer), the rest stood in.
    assert blocks.stood_in == 4 * (LAYERS - 1)
    assert len(blocks.templates) == 4


def test_the_last_layer_stand_in_holds_the_peak_so_dropping_its_raise_is_caught(monkeypatch):
    """The cache grows layer by layer: the last layer rises from the most held bytes, and that is the phase's peak.
    A stand-in that allocated its outputs and cache entries but did not raise the peak would report less."""
    mode = FakeTensorMode()
    model = fake_lm(mode)
    with mode:
        full_peak, _, _ = trace(lambda: decode(model, steps=0), [model], stand_ins=False)
        monkeypatch.setattr(PlanMemTracker, "raise_peak", lambda self, snapshot: None)
        peak, _, _ = trace(lambda: decode(model, steps=0), [model], stand_ins=True)
    assert peak.total < full_peak.total


def test_check_mode_finds_every_layer_rises_as_its_template():
    mode = FakeTensorMode()
    model = fake_lm(mode)
    with mode:
        _, _, blocks = trace(lambda: decode(model), [model], stand_ins=True, check=True)
    assert blocks.stood_in == 0 and blocks.mismatches == []


def test_a_stand_in_that_leaves_other_bytes_held_is_an_error_naming_the_block(monkeypatch):
    real = BlockStandIns._template

    def without_cache_entries(self, *args):
        template = real(self, *args)
        if template is not None:
            template.updates = []  # the stand-ins would not add their KV-cache entries
        return template

    monkeypatch.setattr(BlockStandIns, "_template", without_cache_entries)
    mode = FakeTensorMode()
    model = fake_lm(mode)
    with mode, pytest.raises(RuntimeError, match="Qwen2DecoderLayer.*--trace-every-block"):
        trace(lambda: decode(model, steps=0), [model], stand_ins=True)


class SplitBlock(nn.Module):
    """Returns two views of one new storage and its input itself (an output that is an input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 8 * width)
        self.down = nn.Linear(8 * width, 2 * width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        both = self.down(torch.relu(self.up(x))) * scale
        width = x.shape[-1]
        return both[..., :width], both[..., width:], x


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SplitBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        kept = []
        for block in self.blocks:
            a, b, same = block(x)
            assert same is x
            kept.append(b)  # one view held across blocks: its whole storage stays
            x = a
        return kept


def fake_stack(mode: FakeTensorMode) -> Stack:
    with torch.device("meta"):
        model = Stack()
    to_fake([model], mode)
    return model


def test_outputs_sharing_a_storage_or_viewing_an_input_are_stood_in_as_such():
    mode = FakeTensorMode()
    model = fake_stack(mode)
    with mode:
        x = torch.ones(3, 7, 16)

        def run():
            with torch.no_grad():
                return model(x)

        full_peak, full_held, _ = trace(run, [model], stand_ins=False)
        peak, held, blocks = trace(run, [model], stand_ins=True)
        # The first block's input is contiguous, the others' a strided view: two templates, three stand-ins.
        assert (peak, held) == (full_peak, full_held) and blocks.stood_in == 3
        # The stood-in outputs: the kept view is a view of a (3, 7, 32) storage, as the traced block's.
        tracker = PlanMemTracker()
        with tracker, BlockStandIns([model], tracker):
            with torch.no_grad():
                a, b, same = model.blocks[0](x)
                a2, b2, same2 = model.blocks[1](x)
        assert same is x and same2 is x
        assert StorageWeakRef(a2.untyped_storage()) == StorageWeakRef(b2.untyped_storage())
        assert (a2.shape, a2.stride(), b2.storage_offset()) == (a.shape, a.stride(), b.storage_offset())
        assert b2.untyped_storage().nbytes() == b.untyped_storage().nbytes() == 3 * 7 * 32 * 4


def test_calls_with_autograd_hooks_below_or_other_shapes_are_traced():
    mode = FakeTensorMode()
    model = fake_stack(mode)
    with mode:
        x = torch.ones(2, 5, 16)
        # Autograd on: every block traced.
        _, _, blocks = trace(lambda: model(x.requires_grad_()), [model], stand_ins=True)
        assert blocks.stood_in == 0
        with torch.no_grad():
            # Another kind of call (other shapes, another argument value) is a template of its own.
            tracker = PlanMemTracker()
            with tracker, BlockStandIns([model], tracker) as blocks:
                for block, size, scale in zip(model.blocks, (5, 5, 6, 6, 6), (1.0, 1.0, 1.0, 2.0, 2.0), strict=True):
                    block(torch.ones(2, size, 16), scale=scale)
            assert blocks.stood_in == 2 and len(blocks.templates) == 3
    # A hook below a block (an FSDP unit inside it would have one) keeps the block out.
    handle = model.blocks[2].up.register_forward_hook(lambda *args: None)
    found = repeated_blocks([model])
    handle.remove()
    assert model.blocks[2] not in found and model.blocks[1] in found
    # A list shorter than the stack minimum is not a stack.
    assert not repeated_blocks([nn.ModuleList([SplitBlock(4), SplitBlock(4)])])


def test_stand_ins_restore_the_blocks_forward():
    model = Stack()
    tracker = PlanMemTracker()
    with tracker, BlockStandIns([model], tracker):
        assert "forward" in model.blocks[0].__dict__
    assert all("forward" not in block.__dict__ for block in model.blocks)


# ------------------------------------------------------------------ text encoders: capturing hooks, carried values


def test_a_text_encoder_read_for_its_hidden_states_stands_in_and_one_asked_for_attentions_runs():
    """transformers 5 hooks a model's layers and their attention modules on its first forward asked for an output
    (a text encoder's ``output_hidden_states``). The hooks below a layer record only what a forward asks for, so the
    layers stay a stack: read for their hidden states they stand in (the same bytes and hidden states as traced),
    asked for their attentions they run (each attention map is recorded)."""
    from unirl_pl.plan.stacks import inner_hooks

    mode = FakeTensorMode()
    model = fake_lm(mode)
    model.config._attn_implementation = "eager"  # attention maps are returned (sdpa returns none)
    with mode:
        tokens = torch.ones(3, 24, dtype=torch.long)
        with torch.no_grad():
            model(input_ids=tokens, output_hidden_states=True)  # installs the capturing hooks
        layers = model.model.layers
        assert inner_hooks(layers[0]) == (False, frozenset({"attentions"}))
        assert all(layer in repeated_blocks([model]) for layer in layers)

        def hidden():
            with torch.no_grad():
                return model(input_ids=tokens, output_hidden_states=True).hidden_states

        full_peak, full_held, _ = trace(hidden, [model], stand_ins=False)
        peak, held, blocks = trace(hidden, [model], stand_ins=True)
        assert (peak, held) == (full_peak, full_held) and blocks.stood_in == LAYERS - 1
        tracker = PlanMemTracker()
        with tracker, BlockStandIns([model], tracker) as blocks, torch.no_grad():
            out = model(input_ids=tokens, output_hidden_states=True, output_attentions=True)
        assert blocks.stood_in == 0
        assert len(out.attentions) == LAYERS and all(a.shape == (3, 4, 24, 24) for a in out.attentions)
        assert len(out.hidden_states) == LAYERS + 1


class Tail(nn.Module):
    """Returns its inner ``out`` module's output itself: a capturing hook on ``out`` records the block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x))


def test_a_block_whose_inner_hook_records_its_output_runs_while_a_forward_asks_for_it(monkeypatch):
    """A transformers capturing hook below the block whose record is the block's own output leaves nothing else held,
    so only the forward's request tells that skipping the block would skip the record: each block runs and records
    (four records); with no request the copies stand in; where the request cannot be read, every block runs."""
    from transformers.utils.output_capturing import _active_collector, install_output_capuring_hook

    mode = FakeTensorMode()
    with torch.device("meta"):
        model = nn.Module()
        model.blocks = nn.ModuleList(Tail() for _ in range(4))
    to_fake([model], mode)
    for block in model.blocks:
        install_output_capuring_hook(block.out, "hidden_states", 0, capture_initial_hidden_state=False)
    with mode, torch.no_grad():
        for asked, stood_in in ((True, 0), (False, 3)):
            collected = {"hidden_states": []} if asked else {}
            token = _active_collector.set(collected)
            tracker = PlanMemTracker()
            with tracker, BlockStandIns([model], tracker) as blocks:
                x = torch.empty(8, 16)
                for block in model.blocks:
                    x = block(x)
            _active_collector.reset(token)
            assert blocks.stood_in == stood_in
            assert len(collected.get("hidden_states", [])) == (4 if asked else 0)
        monkeypatch.setattr("unirl_pl.plan.blocks.requested_outputs", lambda: None)
        tracker = PlanMemTracker()
        with tracker, BlockStandIns([model], tracker) as blocks:
            x = torch.empty(8, 16)
            for block in model.blocks:
                x = block(x)
        assert blocks.stood_in == 0


class Windowed(nn.Module):
    """Attends within the windows that ``bounds`` (carried values) marks, as Qwen2.5-VL's vision attention splits its
    patches at ``cu_seqlens``: its bytes follow the values, not the shapes. With ``passes`` it also returns the
    bounds as a new tensor (their values carried with it)."""

    def __init__(self, passes: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.passes = passes

    def forward(self, x: torch.Tensor, bounds: torch.Tensor) -> Any:
        sizes = (bounds[1:] - bounds[:-1]).tolist()
        h = self.proj(x)
        out = torch.cat([(part @ part.T).softmax(-1) @ part for part in h.split(sizes)])
        return (out, bounds + 0) if self.passes else out


def windowed_stack(mode: FakeTensorMode, passes: bool = False) -> nn.Module:
    with torch.device("meta"):
        model = nn.Module()
        model.blocks = nn.ModuleList(Windowed(passes) for _ in range(4))
    to_fake([model], mode)
    return model


def test_a_block_whose_bytes_follow_carried_values_is_a_kind_per_value():
    """Two blocks called with windows (32, 32), two with (4, 60): the same shapes, other bytes. With the values of
    the bounds carried, each is its own kind of call, and the stand-ins peak where tracing every block does."""
    mode = FakeTensorMode()
    model = windowed_stack(mode)
    with mode, AllRowsReal() as rows, rows.carrying_values():

        def run():
            x = torch.empty(64, 16)  # no values (``ones`` would carry them: the first call a kind of its own)
            with torch.no_grad():
                for i, block in enumerate(model.blocks):
                    x = block(x, torch.tensor([0, 32, 64] if i < 2 else [0, 4, 64]))
            return x

        full_peak, full_held, _ = trace(run, [model], stand_ins=False)
        peak, held, blocks = trace(run, [model], stand_ins=True)
    assert (peak, held) == (full_peak, full_held) and blocks.stood_in == 2 and len(blocks.templates) == 2


def test_a_block_that_returns_carried_values_is_traced_so_they_stay_carried():
    """A stand-in's outputs are new tensors with no values: a block that returns a tensor with carried values is
    traced at every call, and the last block's bounds still read as their values."""
    mode = FakeTensorMode()
    model = windowed_stack(mode, passes=True)
    with mode, AllRowsReal() as rows, rows.carrying_values():
        tracker = PlanMemTracker()
        with tracker, BlockStandIns([model], tracker) as blocks, torch.no_grad():
            x, bounds = torch.ones(64, 16), torch.tensor([0, 4, 64])
            for block in model.blocks:
                x, bounds = block(x, bounds)
            assert bounds.tolist() == [0, 4, 64]
    assert blocks.stood_in == 0


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "fsdp2-2-ranks-unsharded-after-forward"])
def test_tiny_plan_with_stand_ins_equals_tracing_every_block(tmp_path, sharded, monkeypatch):
    """A plan of the sd35 recipe on a 4-block SD3 transformer and a 4-layer refiner (fake: only the configs are read)
    gives every phase the same bytes with the stand-ins as with ``every_block``, and says how many stood in; also
    under FSDP2 over 2 fake ranks keeping the all-gathered blocks after forward (FSDP's hooks run around each
    stand-in; the first forward files a block's all-gathered parameters as parameters). The plan traced every block
    also makes every view through the fake mode (``unirl_pl.plan.fake_views`` off), so its views' bytes are checked
    too: the fast plan made thousands of them its own way."""
    from tests.chat_lm import make_qwen2_chat_lm
    from tests.pipelines import make_sd3_pipeline
    from tests.test_plan import ROOT, SD35, TINY, _overrides, _plan_tiny
    from unirl_pl.plan import fake_views, tracker
    from unirl_pl.plan.recipe import parsed_recipe, step_recipe

    pipeline = make_sd3_pipeline(tmp_path / "sd3")
    lm = Path(make_qwen2_chat_lm(tmp_path / "qwen"))
    depths = ((pipeline / "transformer" / "config.json", "num_layers"), (lm / "config.json", "num_hidden_layers"))
    for path, key in depths:
        config = json.loads(path.read_text())
        config[key] = LAYERS
        if "layer_types" in config:
            config["layer_types"] = [config["layer_types"][0]] * LAYERS
        path.write_text(json.dumps(config))
    args = ["--config", SD35, *_overrides(TINY)]
    if sharded:
        args += ["--config", str(ROOT / "recipes" / "fsdp.yaml"), "--data.prompts_per_step=4"]
        args += ["--model.reshard_after_forward=false"]
    recipe = step_recipe(parsed_recipe(args), devices=2 if sharded else 1)
    views = [0]

    def counted(*call):
        view = fake_views.fake_view(*call)
        views[0] += view is not None  # counted, not kept: a view kept here would hold its storage
        return view

    monkeypatch.setattr(tracker, "fake_view", counted)
    fast = _plan_tiny(recipe, (pipeline, str(lm)), search=False)
    monkeypatch.setattr(tracker, "fake_view", lambda *call: None)
    full = _plan_tiny(recipe, (pipeline, str(lm)), every_block=True, search=False)
    assert views[0] > 1000, views
    assert fast.fsdp == sharded
    assert fast.stood_in > 0 and full.stood_in == 0
    assert any("stood in" in note for note in fast.notes) and not any("stood in" in note for note in full.notes)
    for mine, theirs in zip(fast.candidates, full.candidates, strict=True):
        assert mine.phases == theirs.phases
    assert fast.held_lm_graph == full.held_lm_graph


# ------------------------------------------------------------------ with autograd: forward and backward


class Residual(nn.Module):
    """``x + down(relu(up(x) * t))``: saves its input and the shared ``t`` for backward, and gives ``t`` a gradient."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 8 * width)
        self.down = nn.Linear(8 * width, width)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x) * t))


class ResidualStack(nn.Module):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Residual() for _ in range(6))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            # As diffusers and transformers checkpoint a block: around its call, non-reentrant.
            if self.checkpointing:
                x = torch.utils.checkpoint.checkpoint(block, x, t, use_reentrant=False)
            else:
                x = block(x, t)
        return x.square().sum()


def train(checkpointing: bool, frozen_down: bool, stand_ins: bool, rows: tuple[int, int] = (4, 9)):
    """One training forward and backward of a fake 6-block residual stack on ``rows`` (batch, tokens) under the tracker;
    returns (peak, held after, stand-ins object, model)."""
    mode = FakeTensorMode()
    with torch.device("meta"):
        model = ResidualStack(checkpointing)
    for name, param in model.named_parameters():
        param.requires_grad_(not (frozen_down and "down" in name))  # as LoRA leaves base weights frozen
    to_fake([model], mode)
    with mode:
        x = torch.ones(*rows, 16, requires_grad=True)
        t = torch.ones(*rows, 128, requires_grad=True)

        def run():
            model(x * 1, t * 1).backward()

        peak, held, blocks = trace(run, [model], stand_ins)
    return peak, held, blocks, model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["saved", "checkpointed"])
@pytest.mark.parametrize("frozen_down", [False, True], ids=["all-trained", "part-frozen"])
def test_a_training_step_with_stand_ins_peaks_and_holds_what_tracing_every_block_does(checkpointing, frozen_down):
    full_peak, full_held, _, _ = train(checkpointing, frozen_down, stand_ins=False)
    peak, held, blocks, model = train(checkpointing, frozen_down, stand_ins=True)
    assert (peak, held) == (full_peak, full_held)
    # Blocks 0 (the last to backpropagate), 1 (the template) and 5 (the first to backpropagate) are traced; blocks 2-4
    # stand in, and their trained parameters get gradients.
    assert blocks.stood_in == 3
    for block in model.blocks[2:5]:
        for param in block.parameters():
            assert (param.grad is not None) == param.requires_grad
            assert param.grad is None or param.grad.shape == param.shape


def test_the_first_block_is_no_template_for_its_copies():
    """Every block saves ``t``; block 0's backward, the stack's last, frees it, and no copy's does. With block 0 as the
    template the copies' backward rise frees ``t`` too: at 2 x 3 rows with the down projections frozen, the plan's peak
    then falls in another block's backward than tracing every block finds (measured: the same total, one block's
    gradients fewer and as many bytes of temporaries more). Block 1 is the template: blocks 2-4 stand in."""
    full_peak, full_held, _, _ = train(False, True, stand_ins=False, rows=(2, 3))
    peak, held, blocks, _ = train(False, True, stand_ins=True, rows=(2, 3))
    assert blocks.stood_in == 3
    assert (peak, held) == (full_peak, full_held)


@pytest.mark.parametrize("drop", ["saved activations", "kept inputs", "backward rise"])
def test_dropping_any_part_of_a_training_stand_in_is_caught(drop, monkeypatch):
    """Each part a stand-in reproduces matters here: the activations its block saves (the stand-in's held check stops
    the plan), the inputs it keeps for backward (saved, so alive after the caller drops them) and the rise of its
    backward (the part-frozen stack's peak is in the last block's backward, which waits for the traced block 1's
    backward to learn it when that block stands in): without either, the peak is lower than tracing every block."""
    from unirl_pl.plan import blocks as module
    from unirl_pl.plan import standin_autograd

    full_peak, _, _, _ = train(False, True, stand_ins=False)
    if drop == "saved activations":
        real = standin_autograd.StandInCall.__init__

        def no_saved(self, make, saved, *rest):
            real(self, make, 0, *rest)

        monkeypatch.setattr(standin_autograd.StandInCall, "__init__", no_saved)
        with pytest.raises(RuntimeError, match="stand-in for a call of Residual left"):
            train(False, True, stand_ins=True)
        return
    if drop == "kept inputs":
        real_trace = module.BlockStandIns._trace

        def keep_nothing(self, *args):
            out = real_trace(self, *args)
            for template in self.templates.values():
                if template is not None:
                    template.kept = []
            return out

        monkeypatch.setattr(module.BlockStandIns, "_trace", keep_nothing)
    else:
        # Block 5 stands in too (its incoming gradient is like a copy's here), so the peak, in its backward, is a
        # stand-in's: without its backward rise, the peak is lower.
        real_blocks = module.repeated_blocks
        monkeypatch.setattr(
            module, "repeated_blocks", lambda roots: {b: (*v[:2], False) for b, v in real_blocks(roots).items()}
        )
        assert train(False, True, stand_ins=True)[0] == full_peak
        monkeypatch.setattr(standin_autograd.BackwardWindow, "_check", lambda self, *args, **kwargs: None)
    peak, _, blocks, _ = train(False, True, stand_ins=True)
    assert blocks.stood_in == (4 if drop == "backward rise" else 3)
    assert peak.total < full_peak.total


def test_a_backward_that_stops_before_the_traced_block_is_an_error():
    """Blocks 2-4 stand in; a backward restricted to block 3's parameters never reaches block 1 (the traced copy),
    so the stand-ins' backward rise is unknown: an error, not a plan without it."""
    mode = FakeTensorMode()
    with torch.device("meta"):
        model = ResidualStack(False)
    to_fake([model], mode)
    with mode:
        x = torch.ones(4, 9, 16, requires_grad=True)
        t = torch.ones(4, 9, 128, requires_grad=True)

        def run():
            torch.autograd.backward(model(x * 1, t * 1), inputs=list(model.blocks[3].parameters()))

        with pytest.raises(RuntimeError, match="traced copy's never did.*--trace-every-block"):
            trace(run, [model], stand_ins=True)


class CachingBlock(nn.Module):
    """Writes into the list it is given, as the Wan VAE's causal convolutions keep their last frames."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, cache: list) -> torch.Tensor:
        cache.append(x[:, -1:].clone())
        return self.lin(x)


def test_a_block_that_writes_into_its_arguments_is_traced_every_time():
    mode = FakeTensorMode()
    with torch.device("meta"):
        blocks = nn.ModuleList(CachingBlock() for _ in range(4))
    to_fake([blocks], mode)
    with mode:
        x = torch.ones(2, 5, 16)

        def run():
            cache = []
            with torch.no_grad():
                h = x
                for block in blocks:
                    h = block(h, cache)
            assert len(cache) == 4
            return cache

        full = trace(run, [blocks], stand_ins=False)
        mine = trace(run, [blocks], stand_ins=True)
    assert mine[:2] == full[:2] and mine[2].stood_in == 0
