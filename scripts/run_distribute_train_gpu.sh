#!/usr/bin/env bash
# Data-parallel training on GPUs: the model zoo's script name, kept for its users; the same arguments as
# run_distribute_train.sh (see its --help) with --device_target GPU.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_distribute_train.sh" "$@" --device_target GPU
