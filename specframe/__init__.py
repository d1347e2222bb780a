"""specframe: one framework to train, serve and compare speculative-decoding drafters."""

__version__ = "0.1.0"
