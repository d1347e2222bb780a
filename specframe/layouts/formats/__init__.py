"""The foreign readers: one module per drafter folder format specframe imports (``speculators``, the flat EAGLE-3 /
P-EAGLE configs of SafeAILab and SpecForge, PARD and specframe's ParallelSpec, DeepSpec's and SpecForge's DSpark),
each contributing ``Format`` records (``base``); ``specframe.layouts.imports`` lists them in the order it tries them.
"""
