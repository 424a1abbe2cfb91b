"""The TensorBoard "Accumulation" dashboard for tfaccum's summaries.

Imports no TensorFlow: TensorBoard loads it through the `tensorboard_plugins`
entry point. The series, tags and kinds it reads are the writer's schema,
`tfaccum.dashboard_schema`, which imports no framework either.
"""
