"""Model families: one module each (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_omni``, ``fixed_frames``), each
defining ``FAMILY``, a ``vidlabel.families.base.Family``. They are found by looking in this package, so a
new family is one new module (and its tests).

``by_name`` gives the family ``planning.model_family`` names; ``of_model_type`` the family of a config.json's
``model_type``; ``of_name`` the family a hub name is known to be (for a model with no files here). Which
applies to a model is decided in ``vidlabel.core.models`` (it finds the files).
"""

from __future__ import annotations

import importlib
import pkgutil

from vidlabel.families.base import (
    CalibrationVideo,
    Family,
    FamilyError,
    ImageBounds,
    ModelShape,
    Sampling,
    VideoEstimate,
)

__all__ = ["AUTO", "CalibrationVideo", "FAMILIES", "Family", "FamilyError", "ImageBounds", "ModelShape", "Sampling",
           "VideoEstimate", "by_name", "known", "of_config", "of_model_type", "of_name"]

#: ``planning.model_family`` for "read it from each model".
AUTO = "auto"
_NOT_FAMILIES = {"base", "resize", "samplers"}


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name in _NOT_FAMILIES:
            continue
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found[family.name] = family
    return dict(sorted(found.items()))


FAMILIES: dict[str, Family] = _discover()


def known() -> str:
    """The families and the model types each serves, in words (for messages)."""
    return "; ".join(f"{name} ({', '.join(f.model_types) or 'chosen by hand only'})" for name, f in FAMILIES.items())


def by_name(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"no model family {name!r}; known: {known()}") from None


def of_config(config) -> Family:
    """The family a model's or a plan's config was resolved for (vidlabel.core.models.model_config)."""
    name = config["planning"]["model_family"]
    if name == AUTO:
        raise FamilyError("planning.model_family is auto here: this config holds several model families; "
                          "plan and serve under one model's or one plan's config (vidlabel.core.models)")
    return by_name(name)


def of_model_type(model_type: str | None) -> Family | None:
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    return None


def of_name(model: str) -> Family | None:
    """The family a model's name says it is (the last part of a hub name or path), if any."""
    last = str(model).rstrip("/").rsplit("/", 1)[-1].lower()
    for family in FAMILIES.values():
        if any(known_name in last for known_name in family.known_names):
            return family
    return None
