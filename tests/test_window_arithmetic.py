"""Feature arithmetic the core holds for every backend, checked with NumPy.

Each backend calls these with its own array namespace (TensorFlow's
accumulation-aware batch normalization and bfloat16 accumulators do today);
here they meet a NumPy oracle, so a fault in them fails on every pass.
"""

import numpy as np

from tfaccum import moment_pooling
from tfaccum import output_weighting
from tfaccum import stochastic_rounding


def micro_batches(seed=0):
    rng = np.random.default_rng(seed)
    sizes = [5, 1, 0, 12, 3, 7]  # an empty share too (a device that drew nothing)
    return [rng.normal(loc=rng.uniform(-3, 3), scale=rng.uniform(0.1, 2), size=(n, 4))
            for n in sizes]


def summary_of(samples):
    return moment_pooling.summary(float(len(samples)), samples.mean(0) if len(samples) else
                                  np.zeros(4), samples.var(0) if len(samples) else np.zeros(4))


def test_pooled_moments_are_the_whole_windows():
    batches = micro_batches()
    pooled = (0.0, np.zeros(4), np.zeros(4))
    for samples in batches:
        pooled = moment_pooling.combine(pooled, summary_of(samples), np)
    mean, variance = moment_pooling.mean_and_variance(*pooled, np)
    every = np.concatenate(batches)
    assert pooled[0] == len(every)
    np.testing.assert_allclose(mean, every.mean(0), rtol=1e-12)
    # The spread between micro-batches (their means differ by up to 6) is in it:
    np.testing.assert_allclose(variance, every.var(0), rtol=1e-12)
    assert (variance > np.mean([b.var(0) for b in batches if len(b)], 0)).all()


def test_devices_pool_by_adding_their_sums():
    devices = [micro_batches(seed) for seed in (1, 2)]
    sums = [0.0, 0.0, 0.0]
    for batches in devices:
        window = (0.0, np.zeros(4), np.zeros(4))
        for samples in batches:
            window = moment_pooling.combine(window, summary_of(samples), np)
        sums = [a + b for a, b in zip(sums, moment_pooling.to_sums(*window))]  # the all-reduce
    mean, variance = moment_pooling.mean_and_variance(*moment_pooling.from_sums(*sums, np), np)
    every = np.concatenate([s for batches in devices for s in batches])
    np.testing.assert_allclose(mean, every.mean(0), rtol=1e-10)
    np.testing.assert_allclose(variance, every.var(0), rtol=1e-9)


def test_an_empty_window_pools_to_zero():
    empty = (0.0, np.zeros(2), np.zeros(2))
    count, mean, m2 = moment_pooling.combine(empty, empty, np)
    assert count == 0 and not mean.any() and not m2.any()
    assert not moment_pooling.mean_and_variance(count, mean, m2, np)[1].any()


def test_outputs_that_count_apart_are_the_large_batchs_means():
    rng = np.random.default_rng(3)
    # Two outputs, each micro-batch unmasking its own number of elements of each:
    counts = [[3, 0, 5, 1], [1, 2, 0, 4]]
    weights, share = [0.5, 2.0], 0.25  # loss_weights; a device's share of the loss
    totals, loss_sums, gradient_sums, every_loss, every_gradient = [], [], [], [], []
    for output in counts:
        losses = [rng.uniform(0, 3, n) for n in output]         # per element
        grads = [rng.normal(size=(n, 6)) for n in output]       # per element
        # What a device's micro-step adds: its mean (times its share of the loss),
        # times its count:
        loss_sums.append(sum(share * l.mean() * len(l) for l in losses if len(l)))
        gradient_sums.append(sum(share * g.mean(0) * len(g) for g in grads if len(g)))
        totals.append(float(sum(output)))
        every_loss.append(np.concatenate(losses).mean())
        every_gradient.append(np.concatenate(grads).mean(0))
    for total, summed, large in zip(totals, gradient_sums, every_gradient):
        np.testing.assert_allclose(summed / output_weighting.divisor(total, share, np), large,
                                   rtol=1e-12)
    np.testing.assert_allclose(
        output_weighting.window_loss(weights, loss_sums, totals, share, np),
        sum(w * l for w, l in zip(weights, every_loss)), rtol=1e-12)
    # An output that counted nothing over the window adds nothing:
    assert output_weighting.divisor(0.0, share, np) == share
    assert output_weighting.window_loss([1.0], [0.0], [0.0], share, np) == 0.0


def rounded(values, noise):
    bits = np.asarray(values, np.float32).view(np.int32)
    return stochastic_rounding.round_bits(bits, noise.astype(np.int32)).view(np.float32)


def test_stochastic_rounding_is_unbiased_and_lands_on_bfloat16_values():
    rng = np.random.default_rng(0)
    below, above = np.float32(1.0), np.float32(1.0 + 2.0**-7)  # neighbouring bfloat16s
    for between in (np.float32(1.0 + 2.0**-10), np.float32(1.0 + 3 * 2.0**-10)):
        draws = rng.integers(0, stochastic_rounding.NOISE_BOUND, 400_000)
        for sign in (1, -1):
            out = rounded(np.full(draws.shape, sign * between), draws)
            assert set(np.unique(out)) == {sign * below, sign * above}
            # The mean is the float32 value (within 4 standard errors of the draws):
            assert abs(out.mean() - sign * between) < 4 * 2.0**-7 * 0.5 / np.sqrt(len(draws))


def test_stochastic_rounding_keeps_what_bfloat16_holds():
    exact = np.float32([0.0, -0.0, 1.0, -2.5, 2.0**127, 2.0**-130, np.inf, -np.inf])
    for noise in (0, stochastic_rounding.NOISE_BOUND - 1):
        out = rounded(exact, np.full(exact.shape, noise))
        np.testing.assert_array_equal(out, exact)
        assert np.isnan(rounded([np.nan], np.full(1, noise))).all()
    out = rounded(np.float32([1.0 + 2.0**-10]), np.int32([0, 0xFFFF]))
    np.testing.assert_array_equal(out, np.float32([1.0, 1.0 + 2.0**-7]))
