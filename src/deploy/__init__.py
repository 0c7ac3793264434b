"""Deployment: writing and verifying exported files (MINDIR, ONNX, AIR; int8), and running them outside training."""
