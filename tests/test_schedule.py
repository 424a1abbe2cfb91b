"""AccumulationSchedule and every rejected form of `accumulation_steps`."""

import numpy as np
import pytest

from reference import make_data
from reference import make_model

from tfaccum import GradientAccumulationCallback
from tfaccum.schedule import AccumulationSchedule


def test_constant_dict_and_callable():
    assert [AccumulationSchedule(3)(e) for e in range(3)] == [3, 3, 3]
    assert AccumulationSchedule(np.int64(2))(0) == 2
    schedule = AccumulationSchedule({0: 8, 5: 4})
    assert [schedule(e) for e in (0, 4, 5, 9)] == [8, 8, 4, 4]
    assert [AccumulationSchedule({2: 4})(e) for e in (0, 1, 2)] == [1, 1, 4]
    assert [AccumulationSchedule(lambda e: e + 1)(e) for e in (0, 3)] == [1, 4]


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "Received: accumulation_steps=0"),
        (-2, ValueError, "Received: accumulation_steps=-2"),
        (2.5, TypeError, r"Received: accumulation_steps=2.5 \(of type float\)"),
        ("4", TypeError, r"Received: accumulation_steps='4' \(of type str\)"),
        (True, TypeError, r"Received: accumulation_steps=True \(of type bool\)"),
        (None, TypeError, r"Received: accumulation_steps=None \(of type NoneType\)"),
        ({}, ValueError, r"must not be an empty dict.*Received: accumulation_steps=\{\}"),
        ({-1: 2}, ValueError, r"keys .* must be epochs \(integers >= 0\).*with key -1"),
        ({"0": 2}, ValueError, r"keys .* must be epochs.*with key '0'"),
        ({0.5: 2}, ValueError, r"keys .* must be epochs.*with key 0.5"),
        ({0: 4, 3: 0}, ValueError, r"Received: accumulation_steps=\{0: 4, 3: 0\} with value 0 for epoch 3"),
        ({0: -4}, ValueError, r"with value -4 for epoch 0"),
    ],
)
def test_bad_accumulation_steps(value, error, message):
    with pytest.raises(error, match=r"`accumulation_steps` must|" + message) as info:
        GradientAccumulationCallback(accumulation_steps=value)
    assert info.match(message)


@pytest.mark.parametrize("returned, error", [(0, ValueError), (2.0, TypeError), (None, TypeError)])
def test_callable_returning_a_bad_value_fails_at_that_epoch(returned, error):
    x, y = make_data()
    model = make_model()
    callback = GradientAccumulationCallback(
        accumulation_steps=lambda epoch: 4 if epoch < 1 else returned)
    with pytest.raises(error, match=rf"Received: {returned!r}, returned by accumulation_steps\(1\)"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[callback])
    # Epoch 0 ran (its window applied), then the hook was taken off.
    assert int(model.optimizer.iterations) == 4
    assert "train_step" not in model.__dict__
