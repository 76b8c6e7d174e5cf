"""Each bad input of issue 24's "When something goes wrong" ends in one line naming the file (and line), exit 2.

The messages are built where the input is read; the CLI must print them, not the error they replaced
(``raise ... from None``), and must say an input error found while running (models are built) the same way.
"""

from __future__ import annotations

import functools
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import JOINT, TINY
from unirl_pl.cli import ConfigError, check_recipe_files, config_error_message, fsdp1_refusal, main
from unirl_pl.data import load_prompts
from unirl_pl.errors import InputError
from unirl_pl.experts import CausalLMExpert, TextEncoderExpert
from unirl_pl.generators import read_model_index
from unirl_pl.manifest import ASSETS, AssetIntegrityError, verify_assets, write_manifest
from unirl_pl.method.update import PolicyUpdate
from unirl_pl.metrics import nonfinite_report
from unirl_pl.rewards.builtin import resolve_reward

UNION = "Does not validate against any of the Union subtypes\nSubtypes: [...]\nErrors:\n  - "


def _as_the_cli_says_it(fn) -> str:
    """What the CLI prints for ``fn``'s error, raised inside a jsonargparse-style union wrapper (``from``)."""
    try:
        try:
            fn()
        except ValueError as inner:
            raise ValueError(UNION + str(inner)) from inner
    except ValueError as outer:
        return config_error_message(outer)
    raise AssertionError("no error")


# ---------------------------------------------------------------- the CLI keeps the message it was given
def test_the_message_does_not_follow_context_past_from_none():
    def build():
        try:
            b"\xff".decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("prompts.txt:2: not UTF-8 text") from None

    assert _as_the_cli_says_it(build) == "prompts.txt:2: not UTF-8 text"
    # An implicit context (no `from`) is still followed: that is where jsonargparse's own errors are.
    try:
        try:
            raise KeyError("the real one")
        except KeyError:
            raise ValueError(UNION)  # noqa: B904 - the implicit context is the point
    except ValueError as err:
        assert config_error_message(err) == "the real one"


def test_prompts_file_not_utf8(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a red circle\n\xff\xfe x\n")
    assert _as_the_cli_says_it(lambda: load_prompts(str(bad))) == (
        f"{bad}:2: not UTF-8 text (byte 0xff at column 1); save the prompt file as UTF-8"
    )


def test_jsonl_line_not_json_names_the_files_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue", oops}\n')
    assert _as_the_cli_says_it(lambda: load_prompts(str(bad))) == (
        f"{bad}:2: not valid JSON (Expecting property name enclosed in double quotes, column 22)"
    )


def test_pickle_saved_as_jsonl(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(pickle.dumps([{"prompt": "a red circle"}]))
    assert _as_the_cli_says_it(lambda: load_prompts(str(bad))) == (
        f"{bad}:1: not UTF-8 text (byte 0x80 at column 1); a binary file (a pickle?), not prompts"
    )


def test_reward_dotted_path_to_a_missing_module():
    message = _as_the_cli_says_it(lambda: resolve_reward("nosuchpkg.scores.score"))
    assert message == (
        "reward 'nosuchpkg.scores.score': cannot import module 'nosuchpkg.scores' (No module named 'nosuchpkg'); "
        "is it installed or on PYTHONPATH?"
    )


@pytest.mark.slow
def test_the_cli_prints_the_files_line_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue", oops}\n')
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", TINY, f"--data.prompts={bad}"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2
    assert lines == [f"error: {bad}:2: not valid JSON (Expecting property name enclosed in double quotes, column 22)"]


# ---------------------------------------------------------------- recipes and pipeline folders
@pytest.mark.parametrize(
    "content, said",
    [
        ("seed_everything: 0\n# caf\xe9\n".encode("latin-1"), "line 2: not UTF-8 text (byte 0xe9"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff", "line 1: not UTF-8 text (byte 0x89"),
    ],
    ids=["latin-1", "binary"],
)
def test_recipe_not_utf8(tmp_path, content, said):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        check_recipe_files(["fit", "--config", str(recipe)])
    message = str(err.value)
    assert message.startswith(f"{recipe}: {said}") and "\n" not in message, message


def test_model_index_not_json(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline",\n  oops\n}')
    with pytest.raises(InputError) as err:
        read_model_index(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'model_index.json'}:2: not valid JSON (Expecting property name enclosed in double quotes "
        "at column 3)"
    )
    (tmp_path / "model_index.json").write_bytes(b"\x00\x01\xff")
    with pytest.raises(InputError, match=r"model_index\.json: not UTF-8 JSON text \(byte 0xff at offset 2\)"):
        read_model_index(tmp_path)


# ---------------------------------------------------------------- a deleted shipped file: the manifest names it
def _assets_without(tmp_path: Path, monkeypatch, folder: str, module: str) -> Path:
    """A copy of a shipped asset folder whose manifest checks run against the copy, with tokenizer.json gone."""
    assets = tmp_path / "assets"
    shutil.copytree(ASSETS / "shapes" / folder, assets / "shapes" / folder)
    write_manifest(assets)
    (assets / "shapes" / folder / "tokenizer.json").unlink()
    monkeypatch.setattr(module, functools.partial(verify_assets, assets=assets))
    return assets / "shapes" / folder


@pytest.mark.parametrize(
    "expert, folder, module",
    [
        (TextEncoderExpert, "text_encoder", "unirl_pl.experts.text_encoder.verify_assets"),
        (CausalLMExpert, "refiner", "unirl_pl.experts.llm.verify_assets"),
    ],
    ids=["text_encoder", "refiner"],
)
def test_deleted_asset_is_named_by_the_manifest_before_the_tokenizer_loads(
    tmp_path, monkeypatch, expert, folder, module
):
    path = _assets_without(tmp_path, monkeypatch, folder, module)
    with pytest.raises(AssetIntegrityError, match=rf"is missing shapes/{folder}/tokenizer\.json"):
        expert(pretrained_path=str(path)).build()


@pytest.mark.slow
def test_an_input_error_while_running_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """The text encoder is built in configure_model, after parsing: its manifest error still ends in one line."""
    path = _assets_without(tmp_path, monkeypatch, "text_encoder", "unirl_pl.experts.text_encoder.verify_assets")
    with pytest.raises(SystemExit) as stop:
        main(
            [
                "fit",
                "--config",
                JOINT,
                f"--model.generator.init_args.text_encoder.init_args.pretrained_path={path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}",
            ]
        )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err
    assert len(lines) == 1 and "is missing shapes/text_encoder/tokenizer.json" in lines[0], err[-2000:]


# ---------------------------------------------------------------- the consecutive-skip stop
def test_nonfinite_report_names_the_gradient_norm():
    loss = torch.tensor(0.25, requires_grad=True) * 2  # still holds its graph when the step is skipped
    report = nonfinite_report(
        {"llm": loss, "transformer": torch.tensor(0.1)},
        {"llm": torch.tensor(1.0), "transformer": torch.tensor(float("nan"))},
    )
    assert report == "transformer/grad_norm=nan"
    report = nonfinite_report({"llm": torch.tensor(float("inf"))}, {"llm": torch.tensor(1.0)})
    assert report == "llm/loss=inf"
    report = nonfinite_report({"llm": torch.tensor(0.5)}, {"llm": torch.tensor(1.0)})
    assert report == "all finite on this rank (llm/loss=0.5, llm/grad_norm=1): another rank's were not"


def test_the_stop_message_lists_the_non_finite_norm():
    module = SimpleNamespace(skipped_steps=3, consecutive_skips=3, max_consecutive_skips=3)
    outputs = {"transformer": SimpleNamespace(loss=torch.tensor(0.2, requires_grad=True) * 1)}
    with pytest.raises(
        RuntimeError, match=r"4 consecutive steps had a non-finite loss or gradient norm \(transformer/grad_norm=inf\)"
    ):
        PolicyUpdate(module).skip({}, outputs, {"transformer": torch.tensor(float("inf"))})


@pytest.mark.parametrize(
    "strategy, refused",
    [
        ("fsdp", True),
        ("fsdp_cpu_offload", True),
        (SimpleNamespace(class_path="lightning.pytorch.strategies.FSDPStrategy"), True),
        (SimpleNamespace(class_path="lightning.pytorch.strategies.ModelParallelStrategy"), False),
        ("ddp", False),
        (None, False),
    ],
)
def test_fsdp1_is_refused_before_the_trainer_is_built(strategy, refused):
    message = fsdp1_refusal(strategy)
    assert (message is not None) == refused
    assert message is None or "ModelParallelStrategy" in message


def test_the_projects_message_around_a_library_error_is_shown_with_its_cause(monkeypatch, capsys):
    """The OCR reward wraps the missing package's ImportError in one that names the extra to install: the CLI
    prints that one, with the library's message after it, not the library's alone."""
    monkeypatch.setitem(__import__("sys").modules, "rapidocr_onnxruntime", None)  # the extra is not installed
    args = ["fit", "--config", TINY, "--model.rewards={ocr: 1.0}", "--model.reward_args={}", "--trainer.logger=false"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "install the extra with `pip install -e .[ocr]`" in err, err
    assert "(cause: import of rapidocr_onnxruntime halted" in err, err


# ---------------------------------------------------------------- a user's copy of the shipped assets
def _flipped_copy(tmp_path: Path, folder: str = "refiner", weights: str = "model.safetensors") -> Path:
    """A copy of a shipped asset folder outside unirl_pl/assets with one payload byte of its weights flipped."""
    copy = tmp_path / "my_assets" / folder
    shutil.copytree(ASSETS / "shapes" / folder, copy)
    data = bytearray((copy / weights).read_bytes())
    data[-5] ^= 0xFF  # the last tensor's bytes: the header (length + JSON) is intact
    (copy / weights).write_bytes(bytes(data))
    return copy


def test_a_copy_of_the_shipped_assets_with_a_flipped_payload_byte_is_refused(tmp_path):
    copy = _flipped_copy(tmp_path)
    with pytest.raises(AssetIntegrityError) as err:
        CausalLMExpert(pretrained_path=str(copy)).build()
    message = str(err.value)
    assert message.startswith(f"CausalLMExpert: {copy / 'model.safetensors'} is a copy of the shipped asset ")
    assert "shapes/refiner/model.safetensors" in message and "the copy is corrupt" in message and "\n" not in message
    # An intact copy loads; weights trained from the shipped ones carry their folder's own manifest, checked instead.
    intact = tmp_path / "intact"
    shutil.copytree(ASSETS / "shapes" / "refiner", intact)
    assert verify_assets(intact) == [intact / "model.safetensors"], "only the listed weights are hashed"
    write_manifest(copy)
    assert len(verify_assets(copy)) == 5, "the folder's own manifest lists every file"
    (copy / "config.json").write_text("{}")
    with pytest.raises(AssetIntegrityError, match=r"file .*config\.json does not match its sha256 in .*my_assets"):
        verify_assets(copy)


def test_a_copy_of_a_shipped_dit_that_shares_its_header_with_another_is_intact(tmp_path):
    # The edit DiT was trained from the scene DiT: same file name, size and tensor header, other payload. A copy
    # of either is intact, and a copy of the edit DiT with a flipped byte is still corrupt.
    weights = "diffusion_pytorch_model.safetensors"
    scene, edit = (ASSETS / name / "transformer" / weights for name in ("shapes", "shapes_edit"))
    assert scene.stat().st_size == edit.stat().st_size and scene.read_bytes() != edit.read_bytes()
    copy = tmp_path / "edit_dit"
    shutil.copytree(edit.parent, copy)
    assert verify_assets(copy) == [copy / weights]
    data = bytearray((copy / weights).read_bytes())
    data[-5] ^= 0xFF
    (copy / weights).write_bytes(bytes(data))
    with pytest.raises(AssetIntegrityError, match="the copy is corrupt"):
        verify_assets(copy)


@pytest.mark.slow
def test_a_recipe_pointing_at_a_corrupt_copy_stops_at_setup_in_one_line(tmp_path, capsys):
    copy = _flipped_copy(tmp_path, "transformer", "diffusion_pytorch_model.safetensors")
    args = [
        "fit",
        "--config",
        JOINT,
        f"--model.generator.init_args.transformer.init_args.pretrained_path={copy.parent}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.max_steps=1",
    ]
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: FlowTransformerExpert: ") and "is a copy of" in lines[0]
    assert not list(tmp_path.rglob("*.ckpt")), "stopped before training"
