#!/usr/bin/env bash
# Evaluate on a GPU: the model zoo's script name, kept for its users; the same arguments as
# run_eval.sh (see its --help) with --device_target GPU.
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_eval.sh" "$@" --device_target GPU
