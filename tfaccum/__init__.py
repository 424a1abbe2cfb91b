"""tfaccum: exact, observable gradient accumulation for Keras 3 / TensorFlow."""

from tfaccum.callback import GradientAccumulationCallback
from tfaccum.convert import convert_batch_norm
from tfaccum.layers import AccumBatchNormalization
from tfaccum.hook import AccumulationHook
from tfaccum.observers import Window
from tfaccum.hook import install_accumulation_hook
from tfaccum.hook import remove_accumulation_hook
from tfaccum.items import count_items
from tfaccum.multi_worker import disable_keras3_multi_worker
from tfaccum.multi_worker import enable_keras3_multi_worker
from tfaccum.reduction import Reduction
from tfaccum.window_loss import InBatchSoftmax
from tfaccum.window_loss import NTXent
from tfaccum.window_loss import WindowLoss

__version__ = "0.1.0"

__all__ = [
    "AccumBatchNormalization",
    "AccumulationHook",
    "GradientAccumulationCallback",
    "InBatchSoftmax",
    "NTXent",
    "Reduction",
    "Window",
    "WindowLoss",
    "convert_batch_norm",
    "count_items",
    "disable_keras3_multi_worker",
    "enable_keras3_multi_worker",
    "install_accumulation_hook",
    "remove_accumulation_hook",
]
