"""Interrupting and resuming with keras.callbacks.BackupAndRestore."""

import pytest

from reference import InterruptAt
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_weight_diff

from tfaccum import GradientAccumulationCallback


def test_epoch_backups_lose_nothing(tmp_path):
    """With save_freq="epoch" the window is empty at every backup (flushed)."""
    x, y = make_data()
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])

    model = make_model(optimizer="adam")
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup),  # listed first: saves after our flush
            GradientAccumulationCallback(accumulation_steps=4),
            InterruptAt(epoch=1, batch=6),  # mid-epoch, mid-window
        ])
    resumed = make_model(optimizer="adam")  # a fresh process would build it anew
    resumed.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup),
        GradientAccumulationCallback(accumulation_steps=4),
    ])
    assert max_weight_diff(reference, resumed) < 1e-5
    assert int(resumed.optimizer.iterations) == 12


def test_epoch_backups_of_unknown_length_lose_nothing(tmp_path):
    """The window ends in `on_epoch_end` there: before the backup listed first."""
    import tensorflow as tf

    x, y = make_data()

    def dataset():  # a length tf.data cannot know
        return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(8)

    reference = make_model(optimizer="adam")
    reference.fit(dataset(), epochs=3, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    model = make_model(optimizer="adam")
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(dataset(), epochs=3, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup),
            GradientAccumulationCallback(accumulation_steps=4),
            InterruptAt(epoch=1, batch=6),
        ])
    resumed = make_model(optimizer="adam")
    resumed.fit(dataset(), epochs=3, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(backup),
        GradientAccumulationCallback(accumulation_steps=4),
    ])
    assert max_weight_diff(reference, resumed) < 1e-5
    assert int(resumed.optimizer.iterations) == 12


def test_a_checkpoint_listed_first_saves_the_applied_window(tmp_path):
    import tensorflow as tf

    x, y = make_data(n=40)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(8)
    path = str(tmp_path / ("model.keras" if hasattr(keras, "saving") else "model.h5"))
    model = make_model()
    model.fit(dataset, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(path),  # every epoch
        GradientAccumulationCallback(accumulation_steps=3),  # 5 micro-batches: 3 + a flushed 2
    ])
    saved = make_model()
    saved.load_weights(path)
    assert int(model.optimizer.iterations) == 2
    assert max_weight_diff(saved, model) == 0.0


@pytest.mark.keras3
def test_orbax_checkpoints_by_batch_are_refused_by_name():
    from tfaccum import _keras

    orbax = _keras.orbax_checkpoint_class()
    if orbax is None:
        pytest.skip("OrbaxCheckpoint came with Keras 3.14")
    checkpoint = orbax.__new__(orbax)  # without orbax installed: its class is what counts
    keras.callbacks.Callback.__init__(checkpoint)
    checkpoint.save_freq = 2
    x, y = make_data(n=16)
    model = make_model()
    with pytest.raises(ValueError, match=r"OrbaxCheckpoint with an integer `save_freq` cannot "
                       r"resume.*save_freq='epoch'.*Received: OrbaxCheckpoint\(save_freq=2\) "
                       r"with accumulation_steps=2"):
        model.fit(x, y, batch_size=4, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2), checkpoint])
    assert int(model.optimizer.iterations) == 0
    model.fit(x, y, batch_size=4, verbose=0)  # plain again
    assert int(model.optimizer.iterations) == 4


def test_keras_backups_by_batch_are_warned_about_with_the_exact_one_named(tmp_path):
    x, y = make_data(16)
    with pytest.warns(UserWarning, match=r"callbacks.BackupAndRestore\(save_freq=2\) backs up "
                      r"the weights of the last update.*tfaccum.BackupAndRestore takes the same"):
        make_model().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=2),
            GradientAccumulationCallback(accumulation_steps=2)])
