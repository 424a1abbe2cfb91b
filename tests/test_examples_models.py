"""The examples on real models (keras_hub, Keras applications) run and report what they claim.

Apart from test_examples.py so that the two slowest files run side by side.
"""

import re

from test_examples import dashboard_runs
from test_examples import run
from reference import not_on_torch


def test_finetune_causal_lm_is_token_exact_offline(tmp_path):
    out = run("examples/finetune_causal_lm.py", "--epochs", "1", "--logdir", str(tmp_path))
    assert float(re.search(r"largest weight difference: (\S+)", out).group(1)) < 1e-5
    updates = int(re.search(r"optimizer updates: (\d+) \(batch 16\), (\d+)", out).group(2))
    assert re.search(rf"optimizer updates: {updates} \(batch 16\)", out)
    assert dashboard_runs(tmp_path) == {"4x4": updates}


@not_on_torch("batch_norm")
def test_transfer_learning_bn_pools_the_backbone_statistics(tmp_path):
    # One window shown (the fine-tuning that follows runs the same callback on).
    out = run("examples/transfer_learning_bn.py", "--epochs", "0", "--logdir", str(tmp_path))
    assert "Converted 27 BatchNormalization layers" in out
    converted = float(re.search(r"converted, 4 x 8 accumulated vs batch 32: (\S+)", out).group(1))
    plain = float(re.search(r"plain BatchNormalization, 4 x 8 vs batch 32: (\S+)", out).group(1))
    assert converted < 1e-5 < 1e-4 < plain
    assert dashboard_runs(tmp_path) == {"mobilenet-4x8": 1}


@not_on_torch("window_loss")
def test_dual_encoder_window_wide_is_the_batch_of_128(tmp_path):
    out = run("examples/dual_encoder_digits.py", "--epochs", "1", "--logdir", str(tmp_path))
    difference = float(re.search(r"largest weight difference (\S+)", out).group(1))
    assert difference < 1e-5
    accuracy = dict(re.findall(r"  (.+?)\s+retrieval top-1\s+(\S+)%", out))
    assert set(accuracy) == {"plain micro-batches of 16", "ordinary accumulation, 8 x 16",
                             "window-wide accumulation, 8 x 16", "batch of 128 (reference)"}
    assert accuracy["window-wide accumulation, 8 x 16"] == accuracy["batch of 128 (reference)"]
    assert list(tmp_path.iterdir())  # the dashboard's summaries
