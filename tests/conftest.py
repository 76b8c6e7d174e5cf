import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models gain nothing from intra-op threads, and OpenMP threads spin-wait badly when the
# cores are shared (multi-process tests run two ranks on two cores): one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Run the long tests first (``slow`` and ``integration``: subprocesses, fits, real-size plans), each tier
    in file order. xdist's work stealing balances the queues only while tests wait: a two-minute test collected
    last (``test_walk.py``) starts when the other worker has nothing left to take, and one core idles for its
    length. Long tests first leave the short ones to fill both cores at the end."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("integration")))
