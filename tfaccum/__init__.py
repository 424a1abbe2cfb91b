"""tfaccum: exact, observable gradient accumulation for Keras 3 / TensorFlow."""

from tfaccum.callback import GradientAccumulationCallback
from tfaccum.hook import AccumulationHook
from tfaccum.hook import Window
from tfaccum.hook import install_accumulation_hook
from tfaccum.hook import remove_accumulation_hook

__version__ = "0.1.0"

__all__ = [
    "AccumulationHook",
    "GradientAccumulationCallback",
    "Window",
    "install_accumulation_hook",
    "remove_accumulation_hook",
]
