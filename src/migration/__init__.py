"""Coming from elsewhere: PyTorch weights in and out, the parity check and its PyTorch mirror
network, and the model zoo's config keys."""
