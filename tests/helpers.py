"""Shared test helpers: run the CLI in-process on the default recipe and read its metrics."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from unirl_pl.algorithms import DAPO, GSPO, TokenGRPO
from unirl_pl.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.yaml")
JOINT = str(ROOT / "recipes" / "joint.yaml")
# The refiner algorithms by aggregation: token mean, mean over refinements, clip-higher, sequence ratio (GSPO's
# clip widened so a chunk's ratios are not all clipped).
REFINER_ALGORITHMS = {
    "token_grpo": TokenGRPO(),
    "sequence_mean": TokenGRPO(aggregation="sequence_mean"),
    "dapo": DAPO(),
    "gspo": GSPO(clip_eps_low=0.05, clip_eps_high=0.05),
}


def run_cli(tmp_path: Path, *overrides: str, subcommand: str = "fit", config: str = TINY, name: str = "run"):
    """Run ``python -m unirl_pl <subcommand> --config <config> ...`` in this process; return the CLI object.

    The tiny recipe is the default: the trainer's own tests need speed, not a pretrained task.
    """
    args = [
        subcommand,
        "--config",
        config,
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--trainer.logger.init_args.name={name}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks=[unirl_pl.callbacks.LogProbIdentityCheck, unirl_pl.callbacks.WeightVersionLedger]",
        "--trainer.enable_model_summary=false",
        *overrides,
    ]
    return main(args)


def printed_config(*args: str) -> dict[str, Any]:
    """What ``python -m unirl_pl fit ARGS --print_config`` prints, read back (a fresh dict each call). Each ARGS is
    parsed once per test process: several test files read the same recipes' configurations, at about a second of
    jsonargparse a parse."""
    return yaml.safe_load(_printed(args))


@functools.cache
def _printed(args: tuple[str, ...]) -> str:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(["fit", *args, "--print_config"])
    except SystemExit as stop:
        assert stop.code in (0, None), out.getvalue()[-2000:]
    else:
        raise AssertionError(f"--print_config did not exit: {args}")
    return out.getvalue()


def read_metrics(cli) -> list[dict[str, float]]:
    """The rows of the run's ``metrics.csv`` with empty cells dropped and values as floats."""
    path = Path(cli.trainer.logger.log_dir) / "metrics.csv"
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if v != ""})
    return rows


def series(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def subprocess_env() -> dict[str, str]:
    """The environment of a CLI subprocess: offline, one thread, this checkout importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_cli_subprocess(*args: str, cwd: Path = ROOT, timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m unirl_pl <args>`` in a fresh process (Lightning re-executes it per rank); asserts exit 0."""
    cmd = [sys.executable, "-m", "unirl_pl", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def built_generator(folder: Path, family: type, tokens: int, size: dict[str, int], **overrides: object) -> Any:
    """A family generator loaded from a tiny pipeline ``folder`` (float32, LoRA r 4 / alpha 8, ``tokens`` text
    tokens, ``size``), checked to be of class ``family``, and built; ``overrides`` replace any of those."""
    from unirl_pl.generators import load_generator

    kwargs = {"dtype": "float32", "lora_rank": 4, "lora_alpha": 8.0, "max_sequence_length": tokens, **size}
    generator = load_generator(folder, **{**kwargs, **overrides})
    assert isinstance(generator, family), type(generator)
    generator.build()
    return generator


class QuietHandler(BaseHTTPRequestHandler):
    """A loopback test server's request handler: logs nothing; :meth:`answer` sends a status and a body."""

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_loopback(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A threading HTTP server on a free loopback port, serving ``handler`` from a daemon thread (and daemon
    handler threads) until :func:`close_servers`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def close_servers(servers: Iterable[ThreadingHTTPServer]) -> None:
    """Shut down and close each of :func:`serve_loopback`'s servers."""
    for server in servers:
        server.shutdown()
        server.server_close()


def assert_joint_steps_green(cli: Any, steps: int = 2) -> list[dict[str, float]]:
    """The metrics rows of a finished joint fit, checked: C2 of both experts (the recomputed log-probs are the
    behaviour ones) within 1e-5 at each of ``steps`` steps, and interleave parity ran and is within its callback's
    own tolerance."""
    from unirl_pl.callbacks import InterleaveParityCheck

    rows = read_metrics(cli)
    for expert in ("llm", "transformer"):
        c2 = series(rows, f"c2/{expert}_max_abs_diff")
        assert len(c2) == steps and max(c2) <= 1e-5, (expert, c2)
    (parity_check,) = [c for c in cli.trainer.callbacks if isinstance(c, InterleaveParityCheck)]
    parity = series(rows, "parity/max_abs_diff")
    assert parity and max(parity) <= parity_check.tolerance, (parity, parity_check.tolerance)
    return rows


def source_images(n: int, size: tuple[int, int], seed: int = 0) -> list[Any]:
    """``n`` source images (3, *size) as a file gives them: 8-bit values over 255, from a private generator."""
    import torch

    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, *size), generator=rng).float() / 255 for _ in range(n)]


def source_picture(image: Any) -> Any:
    """The 8-bit ``PIL`` picture a (3, h, w) source tensor of :func:`source_images` was read from."""
    import PIL.Image

    return PIL.Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())


def fit_with_callbacks(tmp_path: Path, callbacks: list[Any], *overrides: str, ckpt_path: str | None = None):
    """Fit the tiny recipe in this process with ``callbacks`` first in the trainer's line (no others, no progress
    bar or model summary, logs under ``tmp_path``), resuming from ``ckpt_path`` when given; the CLI object."""
    cli = main(
        [
            "--config",
            TINY,
            "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--trainer.default_root_dir={tmp_path}",
            *overrides,
        ],
        run=False,
    )
    cli.trainer.callbacks[:0] = callbacks
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli
