"""The inventory's tables, without the probing: the probe fields, the item struct, the post columns,
and ``items_table`` (one row per media item).

Kept apart from ``vidlabel.prepare.inventory`` (which opens media with PyAV and Pillow) so that the
stages reading the inventory (transcribe, transcode, manifest) and the posts-table checks the Snakefile
runs before any job import no media library for it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

PROBE_SCHEMA = pa.schema(
    [
        ("size_bytes", pa.int64()),
        ("duration_s", pa.float64()),
        ("fps", pa.float64()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("video_codec", pa.string()),
        ("has_audio", pa.bool_()),
        ("probe_error", pa.string()),
        ("pix_fmt", pa.string()),
        ("rotation", pa.int64()),
        ("container", pa.string()),
        ("header_frames", pa.int64()),
        ("base_fps", pa.float64()),
    ]
)
PROBE_FIELDS = tuple(PROBE_SCHEMA.names)
#: What ``vidlabel.prepare.item_probe.probe_item`` returns of a file: its kind, the video probe's fields, and
#: an image's format, pixel mode and EXIF orientation.
ITEM_FIELDS = ("kind", "size_bytes", "media_format", "video_codec", "audio_codec", "width", "height",
               "orientation", "duration_s", "fps", "frames", "has_audio", "probe_error", "image_mode",
               *(f for f in PROBE_FIELDS if f not in ("size_bytes", "video_codec", "width", "height", "duration_s",
                                                       "fps", "has_audio", "probe_error")))
#: Kinds of item that carry sound worth transcribing (a photo has none).
SOUND_KINDS = ("video", "audio")
_ITEM_TYPES = {**{f.name: f.type for f in PROBE_SCHEMA}, "kind": pa.string(), "media_format": pa.string(),
               "audio_codec": pa.string(), "orientation": pa.int64(), "frames": pa.int64(), "image_mode": pa.string()}
ITEM_TYPE = pa.struct([("index", pa.int32()), ("path", pa.string()), ("source_path", pa.string()),
                       *((name, _ITEM_TYPES[name]) for name in ITEM_FIELDS)])
BASE_COLUMNS = ("post_id", "source_path", "video_path", "caption")
POST_COLUMNS = pa.schema([("post_type", pa.string()), ("n_items", pa.int64()), ("items_dropped", pa.string()),
                          ("items", pa.list_(ITEM_TYPE))])


def items_table(inventory: pa.Table) -> pa.Table:
    """One row per media item: post_id, caption, then ``ITEM_TYPE``'s fields, in the posts' order.

    An inventory written before posts had items (no ``items`` column) is read as one video item per
    post, from the post's own probe fields, so that the stages after it need no rerun of the inventory.
    """
    if "items" in inventory.column_names:
        items = inventory.column("items").combine_chunks()
        parents = pc.list_parent_indices(items)
        flat = pc.list_flatten(items)
        columns = {"post_id": inventory.column("post_id").combine_chunks().take(parents)}
        columns["caption"] = inventory.column("caption").combine_chunks().take(parents)
        columns.update({name: flat.field(name) for name in (f.name for f in ITEM_TYPE)})
        return pa.table(columns)
    n = inventory.num_rows
    ok = pc.is_null(inventory.column("probe_error"))
    columns = {"post_id": inventory.column("post_id"), "caption": inventory.column("caption"),
               "index": pa.array([0] * n, pa.int32()), "path": inventory.column("video_path"),
               "source_path": inventory.column("source_path")}
    for field in ITEM_TYPE:
        if field.name in columns:
            continue
        if field.name == "kind":
            columns["kind"] = pc.if_else(ok, pa.scalar("video"), pa.scalar(None, pa.string()))
        elif field.name in inventory.column_names:
            columns[field.name] = inventory.column(field.name)
        else:
            columns[field.name] = pa.nulls(n, field.type)
    return pa.table(columns)
