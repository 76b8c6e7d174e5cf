"""C2 in bf16: how far the training recompute drifts from rollout's log-probs, per family and for the LM.

``python scripts/bf16_c2.py [--families sd35 flux wan_t2v tiny] [--dtype bfloat16] [--lora-b 0.01] [--json OUT]``

For every family it builds the family recipe on a tiny pipeline folder (``tests/pipelines.py``) with the
instruct refiner of ``tests/chat_lm.py`` (``tiny``: ``recipes/tiny.yaml``'s own experts), base weights in
``--dtype`` (LoRA, optimizer, sampler and log-prob math stay float32), rolls out one step's experience
(``--prompts`` x ``--samples`` images in one micro-batch) without and with classifier-free guidance, and
re-scores its records the way the trainer does:

- ``same``: the DiT in rollout's own micro-batches (what the trainer does), the LM teacher-forced over
  the whole batch (rollout decoded it with a KV cache);
- ``chunk1`` / ``chunk2``: the DiT re-scored one / two samples per forward, the LM one row at a time:
  what a GPU user whose training micro-batch differs from rollout's would get.

For each it prints mean and max ``|logp_recompute - logp_behavior|``, the fraction of bitwise-equal terms,
the mismatch KL (k1 ``mean(behavior - recompute)`` and k3 ``mean(r - 1 - log r)``, ``r = exp(recompute -
behavior)``), the fraction of ratios outside the expert's PPO clip range (what the uncorrected first update
would clip before any weight moved) and the fraction above the TIS cap 2. One thread, CPU, a few minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.chat_lm import make_qwen2_chat_lm  # noqa: E402
from tests.pipelines import make_flux_pipeline, make_sd3_pipeline, make_wan_pipeline  # noqa: E402
from unirl_pl.card import Loop  # noqa: E402
from unirl_pl.cli import main  # noqa: E402
from unirl_pl.data import PromptBatch  # noqa: E402
from unirl_pl.loops.config import chunk_bounds  # noqa: E402
from unirl_pl.records import DiTRecord, LMRecord  # noqa: E402

BUILDERS = {"sd35": make_sd3_pipeline, "flux": make_flux_pipeline, "wan_t2v": make_wan_pipeline}
SIZES = {
    "sd35": ["--model.generator.init_args.height=32", "--model.generator.init_args.width=32"],
    "flux": ["--model.generator.init_args.height=32", "--model.generator.init_args.width=32"],
    "wan_t2v": [
        "--model.generator.init_args.height=16",
        "--model.generator.init_args.width=16",
        "--model.generator.init_args.num_frames=5",
    ],
}
# As the recipes' CPU blocks: the JPEG reward (sd35's stand-in for its 4 GB PickScore; the others' own).
CPU_REWARDS = ["--model.rewards={jpeg_incompressibility: 1.0}", "--model.reward_args=null"]
PROMPTS = ["a red circle on the left", "two blue squares", "a green dog", "a big cat photo"]
TIS_CAP = 2.0


def overrides(family: str, folder: Path, refiner: str, dtype: str, args: argparse.Namespace, cfg: float) -> list[str]:
    """The recipe's CPU override block with base weights in ``dtype`` and guidance ``cfg``."""
    common = [
        "--trainer.logger=false",
        "--trainer.callbacks=[]",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--data.prompts_per_step={args.prompts}",
        f"--data.samples_per_prompt={args.samples}",
        "--data.num_skip_refinement=0",
        "--model.rollout.num_steps=4",
        "--model.generator_algorithm.init_args.sde_window=[0,2]",
        "--model.rollout.max_new_tokens=12",
        f"--model.rollout.guidance_scale={cfg}",
    ]
    if family == "tiny":
        return [
            *common,
            f"--model.llm.init_args.dtype={dtype}",
            f"--model.generator.init_args.transformer.init_args.dtype={dtype}",
        ]
    return [
        *common,
        f"--model.pipeline_path={folder}",
        f"--model.llm.init_args.pretrained_path={refiner}",
        f"--model.generator.init_args.dtype={dtype}",
        f"--model.llm.init_args.dtype={dtype}",
        "--model.generator.init_args.max_sequence_length=16",
        *SIZES[family],
        *CPU_REWARDS,
    ]


def compare(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, clip_eps: float) -> dict[str, float]:
    """Mismatch statistics of recomputed vs behavior log-probs over the real terms of ``mask``."""
    new, old = new[mask].double(), old[mask].double()
    d = new - old
    r = torch.exp(d)
    return {
        "n": int(d.numel()),
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "frac_bitwise": float((new == old).double().mean()),
        "kl_k1": float((-d).mean()),
        "kl_k3": float((r - 1 - d).mean()),
        "frac_outside_clip": float(((r > 1 + clip_eps) | (r < 1 - clip_eps)).double().mean()),
        "frac_above_tis_cap": float((r > TIS_CAP).double().mean()),
    }


def dit_rescored(loop, record: DiTRecord, chunk: int | None) -> torch.Tensor:
    """The record's log-probs re-scored with grad enabled (as training does) in chunks of ``chunk``."""
    n = record.old_logp.shape[0]
    rec = record if chunk is None else replace(record, chunks=chunk_bounds(n, chunk))
    with torch.enable_grad():
        out = torch.empty_like(rec.old_logp)
        for step, (a, b) in rec.steps():
            out[a:b, step] = loop.step_logprob(rec, step, (a, b))[0].detach()
    return out


def lm_rows(record: LMRecord, a: int, b: int) -> LMRecord:
    """Rows ``[a, b)`` of an LM record (a smaller recompute batch of the same samples)."""
    return replace(
        record,
        input_ids=record.input_ids[a:b],
        attention_mask=record.attention_mask[a:b],
        gen_mask=record.gen_mask[a:b],
        old_logp=record.old_logp[a:b],
        rows=record.rows[a:b],
        fell_back=record.fell_back[a:b],
    )


def lm_rescored(loop, record: LMRecord, chunk: int | None) -> torch.Tensor:
    n = record.input_ids.shape[0]
    with torch.enable_grad():
        parts = [loop.score(lm_rows(record, a, b)).detach() for a, b in chunk_bounds(n, chunk)]
    return torch.cat(parts)


def perturb_adapters(model, std: float) -> None:
    """Give every LoRA B matrix seeded N(0, std) entries: a trained adapter instead of the B = 0 start, whose
    branch contributes exactly zero and so hides its own rounding."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=gen) * std)


def measure(family: str, folder: Path, refiner: str, dtype: str, args: argparse.Namespace, cfg: float) -> dict:
    """Roll out one experience and compare its records with the recomputes of every chunking."""
    config = str(ROOT / "recipes" / f"{family}.yaml")
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when the process has arguments of its own
    try:
        cli = main(["--config", config, *overrides(family, folder, refiner, dtype, args, cfg)], run=False)
    finally:
        sys.argv = argv
    model, dm = cli.model, cli.datamodule
    model.configure_model()
    if args.lora_b:
        perturb_adapters(model, args.lora_b)
    prompts = (PROMPTS * args.prompts)[: args.prompts]
    batch = PromptBatch(prompts, list(range(args.prompts)), seed=dm.seed, layout=dm.layout)
    exp = model.source.collect(batch, model.device)
    out: dict[str, dict] = {}
    dit = exp.records.get(Loop.DENOISE)
    assert isinstance(dit, DiTRecord), "the generator trains in this mode, so rollout records its SDE steps"
    eps = model.loss_settings("transformer").clip_eps
    ones = torch.ones_like(dit.old_logp, dtype=torch.bool)
    for name, chunk in (("same", None), ("chunk1", 1), ("chunk2", 2)):
        out[f"transformer/{name}"] = compare(dit_rescored(model.diffusion_denoise, dit, chunk), dit.old_logp, ones, eps)
    lm = exp.lm
    if lm is not None:
        eps = model.loss_settings("llm").clip_eps
        for name, chunk in (("same", None), ("chunk1", 1)):
            out[f"llm/{name}"] = compare(lm_rescored(model.ar_decode, lm, chunk), lm.old_logp, lm.gen_mask, eps)
    return out


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["sd35", "flux", "wan_t2v", "tiny"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--guidance", nargs="+", type=float, default=[1.0, 4.5])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--lora-b", type=float, default=0.0, help="std of random LoRA B entries (0: as initialized)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        refiner = make_qwen2_chat_lm(Path(tmp) / "qwen")
        for family in args.families:
            folder = Path(tmp) / family
            if family in BUILDERS:
                BUILDERS[family](folder)
            for cfg in args.guidance:
                key = f"{family} cfg={cfg:g}"
                results[key] = measure(family, folder, refiner, args.dtype, args, cfg)
                for what, s in results[key].items():
                    print(
                        f"{key:18s} {what:20s} n={s['n']:4d} mean|d|={s['mean_abs']:.2e} max|d|={s['max_abs']:.2e} "
                        f"bitwise={s['frac_bitwise']:.0%} k1={s['kl_k1']:+.1e} k3={s['kl_k3']:.1e} "
                        f"out_clip={s['frac_outside_clip']:.0%} >cap={s['frac_above_tis_cap']:.0%}",
                        flush=True,
                    )
    if args.json is not None:
        meta = {"dtype": args.dtype, "lora_b": args.lora_b, "prompts": args.prompts, "samples": args.samples}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_())
