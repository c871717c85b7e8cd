"""The checks of the losses' tensors, now in `angle_kernels.inputs`; importable from here as before."""

from .inputs import (  # noqa: F401
    check_binary_labels,
    check_choice,
    check_columns,
    check_embedding_group,
    check_embeddings,
    check_finite,
    check_labels,
    check_same_device,
    check_same_shape,
    check_scalar,
    check_scale,
    input_checks,
    input_checks_enabled,
    promote_embeddings,
    set_input_checks,
)
