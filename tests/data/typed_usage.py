"""A user's script against angle_kernels' public API, written the way the README uses it.

tests/test_public_typing.py type-checks this file with mypy (strict flags, see there) and runs its torch-only
part (`python typed_usage.py`). It calls every public loss, constructs and calls every public module, uses the
switches of angle_kernels.__all__, constructs every loss of angle_kernels.integrations.sentence_transformers and
uses angle_kernels.integrations.angle_emb. `_misuses` (never run) holds calls that a type checker must reject:
each carries a `type: ignore[...]` and mypy runs with --warn-unused-ignores, so an annotation that stops catching
the misuse (a parameter left unannotated, or typed Any) fails the check.
"""

from __future__ import annotations

import torch

import angle_kernels as ak


def functional_losses() -> list[torch.Tensor]:
    """Every loss of angle_kernels.functional, with the keyword arguments' types the README shows."""
    pairs, dim = 8, 64
    y_pred = torch.randn(2 * pairs, dim, requires_grad=True)  # zigzag: pair k on rows 2k and 2k+1
    y_true = torch.rand(pairs).repeat_interleave(2)
    binary = torch.randint(0, 2, (pairs,)).repeat_interleave(2)
    group_ids = torch.arange(2 * pairs)
    queries, positives, hard_negatives = torch.randn(3, 16, dim).unbind(0)
    h1, h2 = torch.randn(2, 16, dim).unbind(0)
    anchor, weak, strong = torch.randn(3, 16, dim).unbind(0)
    hidden = torch.randn(4, 2 * pairs, dim)  # 4 layers' embeddings of the same zigzag rows
    espresso: list[list[float]] = [[1 / (1 + i), 0.0] for i in range(3)] + [[1.0, 1.0]]
    return [
        ak.cosine_loss(y_true, y_pred, tau=20.0),
        ak.cosine_loss(y_true, y_pred, dims=(64, 32, 16), dim_weights=(1.0, 0.5, 0.25), backend="torch"),
        ak.cosine_loss(y_true, hidden, dims=[16, 64], layer_weights=espresso),
        ak.cosine_loss(y_true, hidden, layer_weights=torch.tensor([0.25, 0.25, 0.5, 1.0])),
        ak.angle_loss(y_true, y_pred, tau=20.0, pooling_strategy="mean", dims=[32, 64]),
        ak.angle_loss(y_true, hidden, layer_weights=[0.1, 0.1, 0.1, 1.0]),
        ak.in_batch_negative_loss(binary, y_pred, tau=20.0, group_ids=group_ids),
        ak.in_batch_negative_loss(binary, y_pred, negative_weights=0.0, dims=(64, 32), dim_weights=[1, 0.5]),
        ak.contrastive_with_negative_loss(queries, positives),
        ak.contrastive_with_negative_loss(queries, positives, hard_negatives, tau=20.0, dims=(32,)),
        ak.arccon_loss(h1, h2, margin_degrees=10.0, tau=0.05, dims=(64, 32)),
        0.1 * ak.triplet_loss(anchor, weak, strong, margin=0.0, dims=[32, 64], dim_weights=[0.5, 1.0]),
        ak.multiple_negatives_ranking_loss(queries, positives, (hard_negatives,)),
        ak.multiple_negatives_ranking_loss(
            queries, positives, directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")),
        ak.multiple_negatives_ranking_loss(
            queries, positives, directions=["query_to_doc", "doc_to_query"], partition_mode="per_direction"),
        ak.multiple_negatives_ranking_loss(
            queries, positives, [hard_negatives], hardness_mode="in_batch_negatives", hardness_strength=9.0),
        ak.multiple_negatives_ranking_loss(
            queries, positives, (hard_negatives,), false_negative_margin=0.05, false_negative_strategy="relative"),
        ak.multiple_negatives_ranking_loss(queries, positives, scale=1.0, similarity="dot"),
        ak.multiple_negatives_ranking_loss(queries, positives, dims=(64, 32, 16), gather_across_devices=False),
        ak.gist_loss(queries, positives, queries.detach(), positives.detach()),
        ak.gist_loss(queries, positives, queries.detach(), positives.detach(), (hard_negatives,),
                     (hard_negatives.detach(),), temperature=0.01, margin_strategy="relative", margin=0.1,
                     contrast_anchors=True, contrast_positives=False),
    ]


def modules() -> list[torch.Tensor]:
    """AngleLoss (formats A, B, C; Matryoshka; layer-wise) and ArcCSELoss, constructed and called."""
    loss_fn = ak.AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, dataset_format="A")
    outputs = torch.randn(32, 384, requires_grad=True)  # 16 pairs, zigzag
    labels = torch.rand(16).repeat_interleave(2)[:, None]
    format_a: torch.Tensor = loss_fn(labels, outputs)
    format_a.backward()
    triplets = torch.randn(3 * 8, 384, requires_grad=True)  # format C: query, positive, negative rows
    format_c = ak.AngleLoss(dataset_format="C")(None, triplets)
    format_b = ak.AngleLoss(dataset_format="B", ibn_partition="gte", backend="torch")(None, outputs)
    filtered = ak.AngleLoss(dataset_format="A", cosine_w=0.0, ibn_w=1.0, angle_w=0.02, false_negative_margin=0.1,
                            false_negative_strategy="absolute", angle_pooling_strategy="sum")
    binary = (labels > 0.5).float()
    hidden = torch.randn(4, 32, 384)  # 4 layers' pooled embeddings of 16 zigzag pairs
    y_true = torch.rand(16).repeat_interleave(2)
    layered = ak.AngleLoss(dataset_format="A", dims=(128, 384), dim_weights=None)(
        (y_true > 0.5).float(), hidden, layer_weights=[[0.1, 0.0]] * 3 + [[1.0, 1.0]])
    h1, h2 = torch.randn(2, 32, 256).unbind(0)
    anchor, weak, strong = torch.randn(3, 32, 256).unbind(0)
    arccse = ak.ArcCSELoss(margin_degrees=10.0, tau=0.05, triplet_weight=0.1, triplet_margin=0.0)
    matryoshka_arccse = ak.ArcCSELoss(dims=[64, 256], dim_weights=(0.5, 1.0))
    return [
        format_a,
        format_c,
        format_b,
        filtered(binary, outputs),
        layered,
        arccse(h1, h2),
        arccse(h1, h2, anchor, weak, strong),
        matryoshka_arccse(h1, h2, anchor=anchor, weak=weak, strong=strong),
        matryoshka_arccse(torch.stack((h1, h1)), torch.stack((h2, h2)), layer_weights=(0.5, 1.0)),
    ]


def switches() -> list[object]:
    """The rest of angle_kernels.__all__: input checks, backend resolution, version."""
    previous: bool = ak.set_input_checks(False)
    ak.set_input_checks(previous)
    with ak.input_checks(False):
        unchecked = ak.cosine_loss(torch.rand(4), torch.randn(4, 8))
    enabled: bool = ak.input_checks_enabled()
    ops = ak.resolve_backend("torch", torch.randn(2, 8))
    backends: tuple[str, ...] = ak.BACKENDS
    version: str = ak.__version__
    return [unchecked, enabled, ops.name, backends, version]


def sentence_transformers_losses(model_path: str) -> list[torch.nn.Module]:
    """Every loss of angle_kernels.integrations.sentence_transformers, as the README constructs CoSENTLoss."""
    from sentence_transformers import SentenceTransformer, util

    from angle_kernels.integrations import sentence_transformers as ak_st

    model = SentenceTransformer(model_path, device="cpu")
    guide = SentenceTransformer(model_path, device="cpu")
    cosent = ak_st.CoSENTLoss(model, scale=20.0, similarity_fct=util.pairwise_angle_sim, backend="torch")
    mnrl = ak_st.MultipleNegativesRankingLoss(model, scale=20.0, similarity_fct=util.dot_score,
                                              directions=("query_to_doc", "doc_to_query"),
                                              partition_mode="per_direction", hardness_mode="hard_negatives",
                                              hardness_strength=5.0, backend="auto")
    losses: list[torch.nn.Module] = [
        ak_st.CoSENTLoss(model),
        cosent,
        ak_st.AnglELoss(model, scale=20.0, backend="torch"),
        mnrl,
        ak_st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=16, mini_batch_num_tokens=None,
                                                 gather_across_devices=False, show_progress_bar=False),
        ak_st.MultipleNegativesSymmetricRankingLoss(model, scale=20.0, similarity_fct=util.cos_sim),
        ak_st.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=16),
        ak_st.GISTEmbedLoss(model, guide, temperature=0.01, margin_strategy="absolute", margin=0.0),
        ak_st.CachedGISTEmbedLoss(model, guide, mini_batch_size=16, margin_strategy="relative", margin=0.05),
        ak_st.MatryoshkaLoss(model, cosent, [384, 256, 128], matryoshka_weights=[1.0, 0.5, 0.25], n_dims_per_step=2),
        ak_st.AdaptiveLayerLoss(model, mnrl, n_layers_per_step=1, last_layer_weight=1.0),
        ak_st.Matryoshka2dLoss(model, mnrl, [384, 128], matryoshka_weights=None, n_layers_per_step=1,
                               n_dims_per_step=1, layer_weighting="log"),
    ]
    fused: list[bool] = [cosent.uses_fused_path, mnrl.uses_fused_path]
    assert all(fused)
    return losses


def angle_emb_patching() -> torch.Tensor:
    """angle_kernels.integrations.angle_emb, as the README uses it."""
    import angle_emb

    from angle_kernels.integrations import angle_emb as ak_angle_emb

    y_pred = torch.randn(8, 64, requires_grad=True)
    y_true = torch.tensor([1., 1., 0., 0., 1., 1., 0., 0.])[:, None]
    with ak_angle_emb.patched():
        loss: torch.Tensor = angle_emb.loss.in_batch_negative_loss(y_true, y_pred)
    ak_angle_emb.patch(backend="torch")
    patched: bool = ak_angle_emb.is_patched()
    ak_angle_emb.unpatch()
    names: tuple[str, ...] = ak_angle_emb.PATCHED_NAMES
    assert patched and "AngleLoss" in names
    return loss


def _misuses(y_true: torch.Tensor, y_pred: torch.Tensor) -> None:
    """Never run: every call below is wrong, and the annotations must say so (see the module docstring)."""
    from sentence_transformers import SentenceTransformer

    from angle_kernels.integrations import angle_emb as ak_angle_emb
    from angle_kernels.integrations import sentence_transformers as ak_st

    ak.cosine_loss(y_true, y_pred, dims=range(8, 65, 8))  # type: ignore[arg-type]
    ak.cosine_loss(y_true, y_pred, dims=(64, 32), dim_weights="heavy")  # type: ignore[arg-type]
    ak.cosine_loss(y_true, y_pred, layer_weights={"last": 1.0})  # type: ignore[arg-type]
    ak.angle_loss(y_true, y_pred, dims=64)  # type: ignore[arg-type]
    ak.in_batch_negative_loss(y_true, y_pred, group_ids=[0, 1])  # type: ignore[arg-type]
    ak.contrastive_with_negative_loss(y_pred, y_pred, layer_weights="uniform")  # type: ignore[arg-type]
    ak.arccon_loss(y_pred, y_pred, dim_weights=0.5)  # type: ignore[arg-type]
    ak.triplet_loss(y_pred, y_pred, y_pred, dims=(64.0,))  # type: ignore[arg-type]
    ak.multiple_negatives_ranking_loss(y_pred, y_pred, dims="64")  # type: ignore[arg-type]
    ak.multiple_negatives_ranking_loss(y_pred, y_pred, directions="query_to_doc")  # type: ignore[arg-type]
    ak.gist_loss(y_pred, y_pred, y_pred, y_pred, backend=1)  # type: ignore[arg-type]
    ak.AngleLoss(dims=64)  # type: ignore[arg-type]
    ak.AngleLoss(dataset_format="A", dim_weights=[1, "a"])  # type: ignore[list-item]
    ak.AngleLoss(dataset_format="A")(y_true, y_pred, layer_weights="uniform")  # type: ignore[arg-type]
    ak.AngleLoss(dataset_format="A")([1.0, 0.0], y_pred)  # type: ignore[arg-type]
    ak.ArcCSELoss(dims=(1.5,))  # type: ignore[arg-type]
    ak.ArcCSELoss()(y_pred, None)  # type: ignore[arg-type]
    ak.ArcCSELoss()(y_pred, y_pred, layer_weights={0: 1.0})  # type: ignore[arg-type]
    ak.set_input_checks("no")  # type: ignore[arg-type]
    ak.resolve_backend(0, y_pred)  # type: ignore[arg-type]
    ak_angle_emb.patch(backend=1)  # type: ignore[arg-type]
    with ak_angle_emb.patched(backend=True):  # type: ignore[arg-type]
        pass
    model = SentenceTransformer("unused")
    ak_st.CoSENTLoss(model, scale="20")  # type: ignore[arg-type]
    ak_st.CoSENTLoss("a model name")  # type: ignore[arg-type]
    ak_st.AnglELoss(model, backend=0)  # type: ignore[arg-type]
    ak_st.MultipleNegativesRankingLoss(model, directions=("query_to_everything",))  # type: ignore[arg-type]
    ak_st.CachedMultipleNegativesRankingLoss(model, mini_batch_size="32")  # type: ignore[arg-type]
    ak_st.MultipleNegativesSymmetricRankingLoss(model, similarity_fct="cos")  # type: ignore[arg-type]
    ak_st.CachedMultipleNegativesSymmetricRankingLoss(model, backend=[])  # type: ignore[arg-type]
    ak_st.GISTEmbedLoss(model, "a guide name")  # type: ignore[arg-type]
    ak_st.CachedGISTEmbedLoss(model, model, margin_strategy="soft")  # type: ignore[arg-type]
    ak_st.MatryoshkaLoss(model, ak_st.CoSENTLoss(model), 384)  # type: ignore[arg-type]
    ak_st.Matryoshka2dLoss(model, ak_st.CoSENTLoss(model), [384], layer_weighting="cubic")  # type: ignore[arg-type]


if __name__ == "__main__":  # the torch-only part, run by tests/test_public_typing.py
    values = functional_losses() + modules()
    assert all(torch.isfinite(v).all() for v in values), values
    switches()
    print(f"typed_usage: {len(values)} losses computed")
