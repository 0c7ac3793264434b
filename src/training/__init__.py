"""Training: a run's parts built from its config (factory, resume, loop: what train.py composes), the
step cell, loss, lr schedules, optimizers, precision, callbacks, checkpoints, faults, the run record and
distributed set-up."""
