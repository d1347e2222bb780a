"""specframe's built-in plugins, importable as ``specframe_plugins.<folder>``.

Each folder is one plugin, registered through the ``specframe`` entry-point group exactly as a third-party package
would be, and each imports nothing from specframe but ``specframe.api``.
"""
