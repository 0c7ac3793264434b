"""Training: the step cell, optimizers, precision, callbacks, checkpoints, faults, the run record,
metrics and distributed set-up."""
