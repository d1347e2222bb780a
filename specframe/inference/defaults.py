"""Decoding defaults the command line shows in its help: a leaf module, so ``specframe --help`` reads them without
importing the engine (and torch)."""

#: tokens generated per prompt when a command or a benchmark is not told otherwise
DEFAULT_MAX_NEW_TOKENS = 256
