#!/usr/bin/env bash
# Train on one GPU: the model zoo's script name, kept for its users; the same arguments as
# run_standalone_train.sh (see its --help) with --device_target GPU.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_standalone_train.sh" "$@" --device_target GPU
