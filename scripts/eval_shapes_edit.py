"""Evaluate the shipped ShapesWorld-Edit experts on the held-out edits (strict and soft, per kind).

    python scripts/eval_shapes_edit.py                               # unirl_pl/assets/shapes_edit/edits_heldout.jsonl
    python scripts/eval_shapes_edit.py --prompts unirl_pl/assets/shapes_edit/edits_train.jsonl

The experts are built as an RL run builds them and served in the RL loops' ``serve`` profile (greedy refinement,
10-step ODE at shift 3, no guidance); every condition uses the same noise per row and is scored against the row's
edit. Conditions: the DiT given the canonical instruction, another row's instruction (chance: the list rolled by
one, so another kind), the user's instruction, and the refiner's greedy rewrite of it. Then the refiner alone:
greedy and sampled (temperature 1, 4 samples a row) rewrites, exact and exact but for color words. Prints
markdown tables.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from unirl_pl.experts import CausalLMExpert, FlowTransformerExpert, TextEncoderExpert  # noqa: E402
from unirl_pl.generators import InContextEditGenerator  # noqa: E402
from unirl_pl.loops import ARDecode, DiffusionDenoise, RolloutConfig  # noqa: E402
from unirl_pl.pretrain.data import uncolored  # noqa: E402
from unirl_pl.shapes import EDIT_KINDS, edit_breakdown, edit_of, read_jsonl, render_source  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "unirl_pl" / "assets" / "shapes_edit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=str(ASSETS))
    parser.add_argument("--prompts", default=str(ASSETS / "edits_heldout.jsonl"))
    parser.add_argument("--seed", type=int, default=0, help="sampling noise seed")
    args = parser.parse_args()
    root = Path(args.assets)
    generator = InContextEditGenerator(
        FlowTransformerExpert(pretrained_path=str(root), subfolder="transformer"),
        TextEncoderExpert(pretrained_path=str(root / "text_encoder")),
        vae=None,
    )
    generator.build()
    llm = CausalLMExpert(pretrained_path=str(root / "refiner"))
    llm.build()
    config = RolloutConfig(num_steps=10, max_new_tokens=16, shift=3.0, temperature=1.0)
    denoise, decode = DiffusionDenoise(generator, config), ARDecode(llm, config)

    rows = read_jsonl(args.prompts)
    edits = [edit_of(row) for row in rows]
    prompts, canonical = [r["prompt"] for r in rows], [e.instruction for e in edits]
    n, ids = len(rows), list(range(len(rows)))
    sources = [torch.from_numpy(render_source(e)).permute(2, 0, 1).float() / 255.0 for e in edits]
    source_cond = generator.encode_source(sources)
    greedy, _ = decode.sample(prompts, ids, [0] * n, "serve", seed=0)

    @torch.no_grad()
    def edit(texts: list[str]) -> np.ndarray:
        latents, _ = denoise.sample(generator.encode(texts) | source_cond, ids, [0] * n, "serve", seed=args.seed)
        return generator.decode(latents).permute(0, 2, 3, 1).numpy()

    conditions = {
        "canonical instruction": canonical,
        "chance (another row's instruction)": canonical[1:] + canonical[:1],
        "user instruction": prompts,
        "refiner (greedy), then DiT": greedy,
    }
    cols = ["overall", *EDIT_KINDS]
    print(f"| condition ({Path(args.prompts).name}, {n} rows) | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, texts in conditions.items():
        scores = edit_breakdown(edits, edit(texts))
        cells = [f"{scores[f'strict/{c}'][0]:.2f} / {scores[f'soft/{c}'][0]:.2f}" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")

    sampled, _ = decode.sample(prompts * 4, list(range(4 * n)), [0] * (4 * n), "rollout", seed=0)
    print("\n| refiner | rewrites | exact | exact but for color words |\n|---|---|---|---|")
    for name, texts, targets in (("greedy", greedy, canonical), ("sampled, T = 1", sampled, canonical * 4)):
        exact = np.mean([t == c for t, c in zip(texts, targets, strict=True)])
        colorless = np.mean([t == uncolored(c) for t, c in zip(texts, targets, strict=True)])
        print(f"| {name} | {len(texts)} | {exact:.2f} | {colorless:.2f} |")


if __name__ == "__main__":
    main()
