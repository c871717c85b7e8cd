import pytest
import torch

from angle_train.models import POOLING_STRATEGIES, pool


def _right_and_left(seed=0):
    """The same 3 texts (lengths 4, 2, 5, hidden 6) padded on the right and on the left."""
    g = torch.Generator().manual_seed(seed)
    lengths, width, dim = [4, 2, 5], 5, 6
    tokens = [torch.randn(n, dim, generator=g, dtype=torch.float64) for n in lengths]
    right = torch.full((3, width, dim), 99.0, dtype=torch.float64)  # padding positions hold junk
    left = right.clone()
    mask_r = torch.zeros(3, width, dtype=torch.long)
    mask_l = torch.zeros(3, width, dtype=torch.long)
    for i, t in enumerate(tokens):
        right[i, :len(t)] = t
        mask_r[i, :len(t)] = 1
        left[i, width - len(t):] = t
        mask_l[i, width - len(t):] = 1
    return tokens, (right, mask_r), (left, mask_l)


def _expected(t: torch.Tensor, strategy: str) -> torch.Tensor:
    return {"cls": t[0], "last": t[-1], "avg": t.mean(0), "max": t.amax(0), "cls_avg": (t[0] + t.mean(0)) / 2}[strategy]


@pytest.mark.parametrize("strategy", POOLING_STRATEGIES)
def test_pooling_matches_definition_for_both_padding_sides(strategy):
    tokens, right, left = _right_and_left()
    expected = torch.stack([_expected(t, strategy) for t in tokens])
    torch.testing.assert_close(pool(*right, strategy), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(pool(*left, strategy), expected, rtol=0, atol=1e-12)


def test_pooling_rejects_bad_input():
    hidden, mask = torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="pooling must be one of"):
        pool(hidden, mask, "mean_sqrt")
    with pytest.raises(ValueError, match="attention_mask"):
        pool(hidden, mask[:, :2], "avg")
    mask[1] = 0
    with pytest.raises(ValueError, match="without any real token"):
        pool(hidden, mask, "avg")
