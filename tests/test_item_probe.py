"""Per-item probing (kind read from the file) and the conversion of images the server would misread."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pillow_heif
import pytest
from PIL import Image

from vidlabel.demo import make_video, speak
from vidlabel.prepare import images
from vidlabel.prepare.item_probe import probe_item
from vidlabel.prepare.media import probe


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-y", *args], check=True)


def photo(path: Path, size=(1080, 1920), orientation: int | None = None, **save) -> Path:
    """A noisy camera-like picture with a red square in the stored top-left corner."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(60, 200, (size[1], size[0], 3), dtype=np.uint8)
    pixels[:40, :40] = (255, 0, 0)
    image = Image.fromarray(pixels)
    if orientation is not None:
        exif = Image.Exif()
        exif[images.EXIF_ORIENTATION] = orientation
        save["exif"] = exif
    image.save(path, **save)
    return path


def test_a_jpeg_photo_is_an_image_not_a_one_frame_video(tmp_path):
    path = photo(tmp_path / "p.jpg", quality=90)
    # The video probe the inventory runs today takes it for a video: the bug this module fixes.
    assert probe(path)["video_codec"] == "mjpeg" and probe(path)["probe_error"] is None
    info = probe_item(path)
    assert info["kind"] == "image" and info["probe_error"] is None
    assert (info["media_format"], info["width"], info["height"], info["video_codec"]) == ("jpeg", 1080, 1920, None)


def test_kind_comes_from_the_content_not_the_name(tmp_path):
    photo(tmp_path / "photo.mp4", size=(64, 48), format="JPEG")
    make_video(tmp_path / "clip.mp4", duration=1.0, size=(64, 48), fps=10, audio=False)
    (tmp_path / "clip.mp4").rename(tmp_path / "clip.jpg")
    assert probe_item(tmp_path / "photo.mp4")["kind"] == "image"
    clip = probe_item(tmp_path / "clip.jpg")
    assert (clip["kind"], clip["video_codec"]) == ("video", "h264")


def test_exif_orientation_swaps_the_display_size_and_conversion_makes_it_upright(tmp_path):
    src = photo(tmp_path / "sideways.jpg", size=(1920, 1080), orientation=6, quality=92)
    info = probe_item(src)
    assert (info["width"], info["height"], info["orientation"]) == (1080, 1920, 6)
    problem = images.server_image_problem(images.probe_image(src))
    assert problem and "orientation 6" in problem
    out = images.convert_image(src, tmp_path / "upright.jpg")
    assert out == {"width": 1080, "height": 1920}
    with Image.open(tmp_path / "upright.jpg") as upright:
        assert upright.getexif().get(images.EXIF_ORIENTATION) in (None, 1)
        # Orientation 6 shows the stored top row as the right column: the red corner is now top right.
        r, g, b = upright.getpixel((upright.width - 10, 10))
        assert r > 200 and g < 60 and b < 60
    assert images.server_image_problem(images.probe_image(tmp_path / "upright.jpg")) is None


def test_16_bit_grey_png_is_scaled_not_clipped(tmp_path):
    src = tmp_path / "deep.png"
    Image.fromarray(np.full((48, 64), 32768, dtype=np.uint16)).save(src)
    still = images.probe_image(src)
    assert still["mode"] == "I;16"
    assert "clips" in images.server_image_problem(still)
    with Image.open(src) as raw:  # what the server's convert("RGB") makes of it: white
        assert raw.convert("RGB").getpixel((5, 5)) == (255, 255, 255)
    images.convert_image(src, tmp_path / "deep.jpg")
    with Image.open(tmp_path / "deep.jpg") as out:
        assert all(abs(v - 128) <= 2 for v in out.getpixel((5, 5)))


def test_48_bit_png_and_cmyk_jpeg_are_read_by_the_server_as_they_are(tmp_path):
    ffmpeg("-f", "lavfi", "-i", "testsrc2=s=64x48", "-frames:v", "1", "-pix_fmt", "rgb48be", str(tmp_path / "rgb48.png"))
    Image.new("CMYK", (64, 48), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    for name in ("rgb48.png", "cmyk.jpg"):
        assert images.server_image_problem(images.probe_image(tmp_path / name)) is None, name


@pytest.mark.parametrize("fmt,name", [("HEIF", "p.heic"), ("AVIF", "p.avif"), ("TIFF", "p.tiff")])
def test_formats_the_server_may_not_open_are_converted(tmp_path, fmt, name):
    src = photo(tmp_path / name, size=(120, 90), format=fmt)
    info = probe_item(src)
    assert (info["kind"], info["media_format"], info["width"]) == ("image", fmt.lower(), 120)
    assert fmt in images.server_image_problem(images.probe_image(src))
    out = images.convert_image(src, tmp_path / "out.jpg", size=(56, 28))
    assert out == {"width": 56, "height": 28}
    with Image.open(tmp_path / "out.jpg") as jpeg:
        assert (jpeg.format, jpeg.mode, jpeg.size) == ("JPEG", "RGB", (56, 28))


def test_transparency_goes_over_white_as_on_the_server(tmp_path):
    src = tmp_path / "alpha.png"
    Image.new("RGBA", (32, 32), (0, 0, 0, 0)).save(src)
    images.convert_image(src, tmp_path / "alpha.jpg")
    with Image.open(tmp_path / "alpha.jpg") as out:
        assert min(out.getpixel((3, 3))) >= 250


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animation_is_a_video_and_converts_to_h264(tmp_path, fmt):
    frames = [Image.new("RGB", (64, 48), (i * 40, 255 - i * 40, 0)) for i in range(6)]
    src = tmp_path / f"anim.{fmt.lower()}"
    frames[0].save(src, format=fmt, save_all=True, append_images=frames[1:], duration=250, loop=0)
    info = probe_item(src)
    assert (info["kind"], info["video_codec"], info["frames"]) == ("video", fmt.lower(), 6)
    assert info["duration_s"] == pytest.approx(1.5) and info["fps"] == pytest.approx(4.0)
    out = images.convert_animation(src, tmp_path / "anim.mp4")
    assert out["frames"] == 6 and out["duration_s"] == pytest.approx(1.5)
    video = probe_item(tmp_path / "anim.mp4")
    assert (video["kind"], video["video_codec"], video["width"], video["height"]) == ("video", "h264", 64, 48)
    assert video["duration_s"] == pytest.approx(1.5, abs=0.05)


def test_a_single_frame_gif_is_an_image(tmp_path):
    Image.new("P", (20, 20)).save(tmp_path / "still.gif")
    assert probe_item(tmp_path / "still.gif")["kind"] == "image"


def test_audio_files_are_audio_with_or_without_a_cover(tmp_path):
    (tmp_path / "speech.wav").write_bytes(speak("A soundtrack for the slideshow."))
    ffmpeg("-i", str(tmp_path / "speech.wav"), "-c:a", "libmp3lame", str(tmp_path / "track.mp3"))
    photo(tmp_path / "cover.jpg", size=(64, 64), quality=80)
    ffmpeg("-i", str(tmp_path / "speech.wav"), "-i", str(tmp_path / "cover.jpg"), "-map", "0", "-map", "1",
           "-c:a", "aac", "-c:v", "mjpeg", "-disposition:v", "attached_pic", str(tmp_path / "covered.m4a"))
    for name, codec in (("track.mp3", "mp3"), ("covered.m4a", "aac")):
        info = probe_item(tmp_path / name)
        assert (info["kind"], info["audio_codec"], info["has_audio"]) == ("audio", codec, True), name
        assert info["duration_s"] > 1.0 and info["probe_error"] is None
    # The video probe calls both a probe error: an audio item was unusable before.
    assert "no video stream" in probe(tmp_path / "track.mp3")["probe_error"]


def test_bad_items_get_their_own_reason(tmp_path):
    photo(tmp_path / "whole.jpg", size=(400, 300), quality=90)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.png").write_text("not a picture\n")
    (tmp_path / "notes.mp4").write_text("not a clip\n")
    cases = {"cut.jpg": "corrupt image", "empty.jpg": "empty file", "notes.png": "Invalid data", "notes.mp4": "not a video: unrecognised data",
             "missing.jpg": "missing"}
    for name, reason in cases.items():
        info = probe_item(tmp_path / name)
        assert info["kind"] is None and reason in info["probe_error"], (name, info["probe_error"])


def test_heif_opener_is_registered():
    assert pillow_heif.__version__  # declared dependency: HEIC photos come from iPhones
    assert "HEIF" in Image.registered_extensions().values()
