"""Export trained adapters in their libraries' own formats: ``python -m unirl_pl.export``.

``<out>/llm`` holds the LM adapter in peft format (``PeftModel.from_pretrained(base, <out>/llm)``)
and ``<out>/transformer`` the DiT adapter in diffusers' LoRA format
(``pipeline.load_lora_weights(<out>/transformer)`` or
``transformer.load_lora_adapter(<out>/transformer, use_safetensors=True)``). A Wan2.2 A14B generator's
component ``transformer`` is both experts: the high-noise adapter is ``<out>/transformer`` as above and the
low-noise one ``<out>/transformer/transformer_2``
(``pipeline.load_lora_weights(<out>/transformer/transformer_2, load_into_transformer_2=True)``). From the command line
the module is rebuilt from the run's recipe (or the ``config.yaml`` Lightning saved next to the
logs) and its trained weights come from a checkpoint::

    python -m unirl_pl.export --config recipes/joint.yaml --ckpt runs/.../last.ckpt --out adapters/

When the checkpoint holds an EMA of the adapters (the ``unirl_pl.callbacks.EMA`` callback's state), the EMA
weights are written, as Flow-GRPO saves its LoRA; ``--raw`` writes the training weights instead. The command
prints which it wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from unirl_pl.adapters import ADAPTER_DIRS, export_adapters
from unirl_pl.errors import ConfigError
from unirl_pl.recipes import load_recipe

# The adapter writer is shared with the AdapterExport callback (unirl_pl.adapters); kept importable from here.
__all__ = ["ADAPTER_DIRS", "export_adapters", "load_checkpoint_into", "main"]


def load_checkpoint_into(module: Any, ckpt_path: str | Path) -> dict[str, Any]:
    """Build ``module``'s experts and load a Lightning checkpoint's weights and versions into it."""
    module.configure_model()
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    module.on_load_checkpoint(checkpoint)  # restores versions and refills trimmed base weights
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    return checkpoint


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """Command-line entry: rebuild the module from ``--config``, load ``--ckpt``, export to ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m unirl_pl export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's recipe YAML (or the config.yaml it saved)")
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by fit")
    parser.add_argument("--out", required=True, help="output folder; gets llm/ and transformer/")
    parser.add_argument(
        "--raw", action="store_true", help="write the training weights even when the checkpoint holds their EMA"
    )
    args = parser.parse_args(argv)
    if not Path(args.ckpt).is_file():
        parser.error(f"checkpoint {args.ckpt!r} does not exist")
    # Lightning loads here, with the CLI, not when the module is imported: ``--help`` stays quick. The CLI does
    # not import this module (tests/test_import_graph.py keeps it so).
    from unirl_pl.callbacks.ema import STATE_KEY, apply_checkpoint_ema
    from unirl_pl.cli import main as cli_main

    try:
        config = load_recipe(args.config)
    except ConfigError as err:
        parser.error(str(err))
    # The recipe as written, then parsed by the CLI from that mapping: only model and data matter here, and a
    # config saved by ``fit`` also holds fit-only keys (ckpt_path) and its trainer (a GPU one, on a CPU machine).
    kept = {k: config[k] for k in ("seed_everything", "model", "data") if k in config}
    cli = cli_main({**kept, "trainer": {"logger": False}}, run=False)
    checkpoint = load_checkpoint_into(cli.model, args.ckpt)
    ema = None if args.raw else apply_checkpoint_ema(cli.model, checkpoint)
    if ema is not None:
        experts = ", ".join(ema["components"])
        print(f"weights: EMA of {experts} (decay {ema['decay']}, every {ema['every_n_steps']} steps)")
    elif STATE_KEY in checkpoint.get("callbacks", {}):
        print("weights: raw training weights (--raw; the checkpoint also holds their EMA)")
    else:
        print("weights: raw training weights (the checkpoint holds no EMA)")
    written = export_adapters(cli.model, args.out)
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


if __name__ == "__main__":
    main()
