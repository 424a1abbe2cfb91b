"""The TensorBoard "Accumulation" dashboard for tfaccum's summaries.

Imports no TensorFlow: TensorBoard loads it through the `tensorboard_plugins`
entry point, and the writer side (`tfaccum.backend.tensorflow.summary`) shares `metadata`.
"""
