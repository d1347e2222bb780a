"""What ``specframe prepare`` and ``specframe regenerate --capture`` share in writing a feature cache: the
``FeatureSpec`` an ``--aux-layers`` value names."""

from __future__ import annotations


def feature_spec(aux_layers: str, num_layers: int, *, final_hidden: bool = True):
    """The ``FeatureSpec`` of an ``--aux-layers`` value ('default', 'none' or comma-separated ids)."""
    from specframe.errors import UsageError
    from specframe.features import FeatureSpec, low_mid_high_layers

    if aux_layers == "default":
        aux = low_mid_high_layers(num_layers)
    elif aux_layers == "none":
        aux = None
    else:
        try:
            aux = tuple(int(x) for x in aux_layers.split(","))
        except ValueError:
            raise UsageError(f"--aux-layers must be 'default', 'none' or comma-separated integers, not '{aux_layers}'") from None
    return FeatureSpec(aux_layers=aux, final_hidden=final_hidden)
