"""Evaluation's pieces: metrics over a dataset (sharded across ranks), the report of a checkpoint,
the model's summary and the profiler's table."""
