"""captionkit: train, evaluate, inspect and use image captioning models."""

__version__ = "0.1.0"
