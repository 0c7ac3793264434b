"""Developer tools beside the entry points: instruments and checks, never imported by the training path."""
