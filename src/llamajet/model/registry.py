"""The architectures llamajet runs, by name (ModelConfig.architecture)."""

from __future__ import annotations

from llamajet.errors import UnsupportedModelError
from llamajet.model.spec import ArchSpec

_ARCHS: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    if spec.name in _ARCHS:
        raise ValueError(f"architecture {spec.name!r} registered twice")
    _ARCHS[spec.name] = spec
    return spec


def get(name: str) -> ArchSpec:
    import llamajet.model  # noqa: F401  (registers every architecture)

    try:
        return _ARCHS[name]
    except KeyError:
        raise UnsupportedModelError(f"architecture {name!r} is not supported; supported: "
                                    f"{', '.join(sorted(_ARCHS))}") from None


def names() -> list[str]:
    import llamajet.model  # noqa: F401

    return sorted(_ARCHS)
