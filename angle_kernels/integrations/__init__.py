"""Ways into angle_kernels from the training libraries people already use.

* `angle_kernels.integrations.sentence_transformers`: CoSENTLoss, AnglELoss, MultipleNegativesRankingLoss,
  CachedMultipleNegativesRankingLoss, MultipleNegativesSymmetricRankingLoss,
  CachedMultipleNegativesSymmetricRankingLoss, GISTEmbedLoss, CachedGISTEmbedLoss, MatryoshkaLoss, AdaptiveLayerLoss
  and Matryoshka2dLoss, subclasses of sentence-transformers' losses of the same names (same arguments, same results
  but for the GIST losses' tie allowance: that module's docstring) computed by angle_kernels' fused losses. Needs
  sentence-transformers.
* `angle_kernels.integrations.angle_emb`: `patch()` / `unpatch()` / `patched()` make the angle-emb trainer
  (angle-emb 0.6.1) use angle_kernels' losses and AngleLoss. Needs angle-emb.

The submodules are imported on demand (`from angle_kernels.integrations import sentence_transformers`), so
importing angle_kernels never imports either library.
"""

__all__ = ["sentence_transformers", "angle_emb"]
