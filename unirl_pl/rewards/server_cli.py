"""``python -m unirl_pl serve-reward``: the reward server's command line (:class:`~unirl_pl.rewards.server.RewardServer`
serving one reward until interrupted). Setup mistakes exit with status 2 and one line, as argparse's own errors."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, NoReturn

from unirl_pl.rewards import server as _server
from unirl_pl.rewards.http import MAX_IMAGE_PIXELS
from unirl_pl.rewards.server import (
    MAX_BODY_BYTES,
    MAX_TOTAL_PIXELS,
    READ_TIMEOUT_S,
    START_TIMEOUT_S,
    RewardServer,
)


def main(argv: list[str] | None = None) -> None:
    """Command line: serve one reward until interrupted."""
    parser = argparse.ArgumentParser(description=_server.__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="registry name (e.g. brightness, ocr) or dotted path")
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to bind: 127.0.0.1, or 0.0.0.0 or :: for all (no auth!)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--reward-args", default="{}", help="constructor kwargs as JSON, e.g. '{\"channel\": 0}'")
    parser.add_argument("--max-batch", type=int, default=64, help="most samples per reward call across requests")
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="how long LitServe collects concurrent requests into one batch",
    )
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_BYTES / 2**20,
        help="largest request body in MiB; a larger Content-Length is refused unread (413)",
    )
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=READ_TIMEOUT_S,
        help="seconds the request line and headers may take to arrive in full (else the connection is closed), "
        "the same for the body (else 408); also the idle-connection timeout",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="most pixels (width x height) of one image or video frame, checked before decoding (else 413)",
    )
    parser.add_argument(
        "--max-request-pixels",
        type=int,
        default=MAX_TOTAL_PIXELS,
        help="most pixels of all the images and frames of one request (else 413)",
    )
    parser.add_argument(
        "--start-timeout-s",
        type=float,
        default=START_TIMEOUT_S,
        help="seconds to wait for the server to answer GET /health (building the reward included) before exiting",
    )
    args = parser.parse_args(argv)

    def fail(message: str) -> NoReturn:
        # One line and exit status 2, like an argparse error, and no traceback: these are setup mistakes.
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    try:
        reward_args = json.loads(args.reward_args)
    except json.JSONDecodeError as err:
        fail(f"--reward-args is not JSON: {err}")
    if not isinstance(reward_args, dict):
        fail(f"--reward-args must be a JSON object of constructor kwargs, got {args.reward_args!r}")
    try:
        server = RewardServer(
            args.reward,
            reward_args,
            args.host,
            args.port,
            max_batch_size=args.max_batch,
            batch_wait_s=args.batch_wait_ms / 1000,
            max_body_bytes=int(args.max_body_mb * 2**20),
            read_timeout_s=args.read_timeout_s,
            max_image_pixels=args.max_image_pixels,
            max_total_pixels=args.max_request_pixels,
            start_timeout_s=args.start_timeout_s,
        )
    except (ValueError, ImportError) as err:
        fail(str(err))
    try:
        server.start()
    except ValueError as err:
        server.close()
        fail(str(err))
    except OSError as err:
        fail(f"cannot listen on {args.host}:{args.port}: {err}")
    except RuntimeError as err:
        server.close()
        fail(str(err))
    print(f"serving reward {args.reward!r} at {server.url} (GET {server.url}health)", flush=True)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does

    signal.signal(signal.SIGTERM, stop)  # after start: LitServe's processes keep their own handlers
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
