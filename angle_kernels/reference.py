"""The float64 transcriptions of the four ops, now `angle_kernels.float64_ops` ("reference" names angle-emb in the
docs); importable from here as before."""

from .float64_ops import *  # noqa: F401,F403
from .float64_ops import GRAD_TOL, HALF_RULE_FLOOR, VALUE_TOL, allowed_error, computing_in, rel_err  # noqa: F401
