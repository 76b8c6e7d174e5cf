"""Peak memory of one DiT update vs the SDE window: ``python scripts/dit_memory.py``.

Each configuration runs in a fresh process: it builds an SD3 transformer with LoRA, records a rollout over
the window (no grad), then measures the peak resident memory of the Flow-GRPO update above what the
process held before it. ``per-step`` is the trainer's update (a backward per denoising step); ``one graph``
keeps every step's graph until a single backward, which is what the trainer avoids. Prints a table.
Children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensor buffers go back to the OS: with glibc's
default heap, freed memory stays resident and the RSS peak measures fragmentation, not live tensors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys

BATCH = 8


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(window: int, per_step: bool) -> float:
    """Peak MiB above the pre-update resident set for one update over ``window`` SDE steps."""
    import torch

    from unirl_pl.algorithms import FlowGRPO
    from unirl_pl.algorithms.drivers import dit_loss
    from unirl_pl.experts import FlowTransformerExpert
    from unirl_pl.loops import DiffusionDenoise, RolloutConfig
    from unirl_pl.method import ExpertLoss

    torch.set_num_threads(1)
    expert = FlowTransformerExpert(sample_size=32, patch_size=2, num_layers=4, attention_head_dim=32,
                                   num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
                                   pooled_projection_dim=64)  # fmt: skip
    expert.build()

    class Generator:
        latent_shape = expert.latent_shape

        def velocity(self, x, sigma, cond):
            return expert.velocity(x, sigma, cond["hidden"], cond["pooled"])

    loop = DiffusionDenoise(Generator(), RolloutConfig(num_steps=window), FlowGRPO(sde_window=(0, window)))
    cond = {"hidden": torch.randn(BATCH, 24, 64), "pooled": torch.randn(BATCH, 64)}
    _, record = loop.sample(cond, list(range(BATCH)), [0] * BATCH, "rollout", seed=0)
    advantages = torch.randn(BATCH)
    settings = ExpertLoss(clip_eps=1e-4, beta=0.004)
    gc.collect()
    before = _rss_mib()
    if per_step:
        dit_loss(loop, record, advantages, settings, expert.adapter_disabled, backward=lambda t: t.backward())
    else:
        dit_loss(loop, record, advantages, settings, expert.adapter_disabled).loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--child", nargs=2, metavar=("WINDOW", "PER_STEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1] == "1")))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    for per_step in (True, False):
        for window in args.windows:
            cmd = [sys.executable, __file__, "--child", str(window), str(int(per_step))]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            results[(per_step, window)] = float(out.strip().splitlines()[-1])
    print(f"DiT update peak memory above the pre-update resident set (batch {BATCH}, float32, CPU)")
    print(f"{'mode':<12}" + "".join(f"{'window ' + str(w):>12}" for w in args.windows) + f"{'ratio':>10}")
    for per_step, name in ((True, "per-step"), (False, "one graph")):
        row = [results[(per_step, w)] for w in args.windows]
        ratio = row[-1] / row[0] if row[0] else float("nan")
        print(f"{name:<12}" + "".join(f"{v:>10.1f}Mi" for v in row) + f"{ratio:>9.2f}x")


if __name__ == "__main__":
    main()
