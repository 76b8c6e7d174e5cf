import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and OpenMP threads spin-wait badly when the
# cores are shared (multi-process tests run two ranks on two cores): one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list) -> None:
    """Start the long tests first: the multi-process and end-to-end runs (``integration``), then the other ``slow``
    ones, then the rest, each group in collection order. ``--dist worksteal`` then ends the suite on short tests
    instead of one worker finishing a minutes-long run (the README walk, a plan of a 20B DiT) while the other waits."""

    def rank(item: object) -> int:
        marks = {mark.name for mark in item.iter_markers()}  # type: ignore[attr-defined]
        return 0 if "integration" in marks else 1 if "slow" in marks else 2

    items.sort(key=rank)
