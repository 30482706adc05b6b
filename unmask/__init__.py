"""unmask: train, sample and evaluate masked-diffusion language models."""

__version__ = "0.1.0"
