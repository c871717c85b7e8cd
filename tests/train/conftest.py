import pytest

# torch's thread count (one, unless a test is marked all_threads) and the Hub offline: the root conftest.py


@pytest.fixture
def no_curves(monkeypatch):
    """The test's train() runs draw no curves.png (train_helpers.without_curves); a module of many short runs opts in
    with `pytestmark = pytest.mark.usefixtures("no_curves")`."""
    from train_helpers import without_curves

    without_curves(monkeypatch)
