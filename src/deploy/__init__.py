"""Running exported files (MINDIR, ONNX) outside training."""
