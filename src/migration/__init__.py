"""Coming from elsewhere: PyTorch weights in and out, the parity check and its PyTorch mirror network,
train_parity.py's two sides, steps, tables and verdicts, and the zoo's fine-tune flow (the model zoo's
config keys are translated by src/config/zoo.py, with the loader)."""
