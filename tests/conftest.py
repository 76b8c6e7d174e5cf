import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and OpenMP threads spin-wait badly when the
# cores are shared (multi-process tests run two ranks on two cores): one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list) -> None:
    """Longest first: subprocess runs that are also slow, then slow, then integration, then the rest.

    With ``--dist load`` the first quarter of the tests is dealt out one at a time, round robin, so the
    long tests start at once on every worker instead of one of them ending the suite alone; the order within
    each class keeps the files' order (their module fixtures)."""

    def weight(item) -> int:
        slow, integration = item.get_closest_marker("slow"), item.get_closest_marker("integration")
        return 0 if slow and integration else 1 if slow else 2 if integration else 3

    items.sort(key=weight)
