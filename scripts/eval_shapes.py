"""Evaluate the shipped ShapesWorld experts on held-out prompts (strict and soft, per category).

    python scripts/eval_shapes.py                          # 120 composition-split prompts, 10 ODE steps
    python scripts/eval_shapes.py --split vocabulary       # the unseen-words split
    python scripts/eval_shapes.py --split train --n 60     # train-split phrasing and compositions

Prints one markdown table (rows: conditions; columns: overall and per-category scores).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from unirl_pl.pretrain.evaluate import DEFAULT_ASSETS, SHIPPED_SHIFT, evaluate, load_experts  # noqa: E402
from unirl_pl.shapes.scenes import CATEGORIES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=str(DEFAULT_ASSETS))
    parser.add_argument("--n", type=int, default=120, help="prompts (categories balanced)")
    parser.add_argument("--prompt-seed", type=int, default=1000)
    parser.add_argument("--split", default="composition", choices=["composition", "vocabulary", "train"])
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--shift", type=float, default=SHIPPED_SHIFT, help="schedule shift (shipped DiT: 3)")
    parser.add_argument("--seed", type=int, default=0, help="sampling noise seed")
    parser.add_argument("--json", default=None, help="also write the scores here")
    args = parser.parse_args()
    experts = load_experts(args.assets, args.num_steps, args.guidance_scale, shift=args.shift)
    scores = evaluate(experts, args.n, args.prompt_seed, args.split, args.seed)
    cols = ["overall", *CATEGORIES]
    print(f"| condition ({args.split}, n={args.n}) | " + " | ".join(f"strict/soft {c}" for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, s in scores.items():
        print(f"| {name} | " + " | ".join(f"{s[f'strict/{c}']:.2f} / {s[f'soft/{c}']:.2f}" for c in cols) + " |")
    if "refined" in scores:
        exact = scores["refined"]["exact_match"]
        print(f"\nthe refiner rewrites {exact:.0%} of these prompts to their canonical caption exactly")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(scores, f, indent=2)


if __name__ == "__main__":
    main()
