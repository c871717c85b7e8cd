"""The pure-PyTorch backend: exact, O(N) extra memory (never an N x N matrix), runs on any device.

One module per op, named after it (`contract.OPS`): pair_scores.py, ranking_loss.py, similarity_xent.py;
`dispatch` finds them by name. Inputs arrive validated by `angle_kernels.dispatch`."""


def is_available() -> tuple[bool, str]:
    return True, ""
