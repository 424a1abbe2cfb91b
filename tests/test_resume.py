"""Interrupting and resuming with keras.callbacks.BackupAndRestore."""

from conftest import keras
import pytest
from conftest import make_data
from conftest import make_model
from conftest import max_weight_diff

from tfaccum import GradientAccumulationCallback


class InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


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
