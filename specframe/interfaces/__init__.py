"""The bodies of the four component interfaces (drafter, mask builder, partitioner, verifier) and the data they
exchange, one module per component kind.

A plugin never imports these modules: ``specframe.api`` re-exports every public name from them (with the same
identity), and is the one module a plugin imports, versioned by ``API_VERSION``. They sit below the engine and the
plugin registry and import neither, so the core's lower layers (``specframe.hookspecs``, ``specframe.sampling``) can
name the interfaces without climbing to the API.
"""
