"""The manifest's log of the posts planned for the transcode groups them by reason with the figures
left out, and keeps the codecs' names whole (issue 34, part 7: 'h264' read 'hN', 'vp9' 'vpN')."""

from __future__ import annotations

import logging

from test_transcode import _probed_inventory, formats  # noqa: F401 (fixture)

from vidlabel.prepare import transcode as tc
from vidlabel.prepare.manifest import build


def test_the_transcode_reasons_keep_codec_names_and_drop_figures(formats, tmp_path, caplog):  # noqa: F811
    cfg, inv, _ = _probed_inventory(formats, tmp_path)
    chunk = tmp_path / "transcoded" / "chunk-0.parquet"
    tc.run_chunk(cfg, inv, 0, chunk, tmp_path / "media-out")
    with caplog.at_level(logging.INFO, logger="vidlabel.prepare.manifest"):
        build(cfg, inv, [], [chunk], [tmp_path / "shard-0.parquet"], tmp_path / "excluded.parquet",
              tmp_path / "plan.csv")
    reasons = [r.getMessage().split("planned for the transcode: ", 1)[1] for r in caplog.records
               if "planned for the transcode" in r.getMessage()]
    assert reasons and all(r.startswith("transcode to h264: ") for r in reasons)
    assert any("codec mpeg4 is not among" in r for r in reasons)
    assert any(r.startswith("transcode to h264: N frame(s) in the file") for r in reasons)
    assert not any("hN" in r or "mpegN" in r for r in reasons)
