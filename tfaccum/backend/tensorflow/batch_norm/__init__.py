"""Accumulation-aware batch normalization on TensorFlow, a feature the hook composes.

`moments` (each forward pass's batch statistics staged, pooled over the window
exactly and moved once per update: the layers' `WindowedMoments` and the
hook's `BatchNormWindows` observer), `layers` (Keras 3's
`AccumBatchNormalization`, and what `convert_batch_norm`, the core's, makes)
and `keras2` (their tf_keras twins). The backend asks `moments` for a model's observers;
nothing else of the backend imports this package.
"""

from tfaccum.backend.tensorflow.batch_norm.layers import AccumBatchNormalization  # noqa: F401
from tfaccum.backend.tensorflow.batch_norm.layers import ConvertedBatchNormalization  # noqa: F401
