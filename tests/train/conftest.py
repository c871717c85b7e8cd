import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread (and a loaded CI machine punishes oversubscription); the quality
    test opts out with @pytest.mark.all_threads."""
    if request.node.get_closest_marker("all_threads"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    config.addinivalue_line("markers", "all_threads: run the test with every CPU thread (default: one)")
