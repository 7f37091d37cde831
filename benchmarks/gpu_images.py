"""Image tokens on a real vLLM: which pixel bounds the server applies to photos, checked against vidlabel.

Two questions the stand-in answers from vLLM 0.26's source but no GPU run has measured yet:

1. Which ``--mm-processor-kwargs`` form vLLM (with the transformers it runs) honours for images apart
   from video frames (vidlabel.serve.command.PIXEL_BOUNDS_FORM): the flat pair binds every modality
   (transformers' ``_merge_kwargs``); ``split`` (images_kwargs / videos_kwargs with min/max_pixels) and
   ``split-size`` (the same with transformers 5's ``size``) give each its own.
2. The exact 400 for more images than ``--limit-mm-per-prompt`` allows, and the encoder cache size
   vLLM picks (its log line naming the encoder cache): with a split form its profiler sizes its video
   by the image processor's own bound (tests/standin/qwen_image.py says what the source gives).

Steps (WORKDIR inside the server's --allowed-local-media-path; ``flags FORM`` prints that form's
--mm-processor-kwargs JSON, made by vidlabel.serve.command.mm_processor_kwargs from the default config):

    python benchmarks/gpu_images.py media WORKDIR
    for form in flat split split-size; do
      vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000 --allowed-local-media-path WORKDIR \\
          --max-model-len 32768 --limit-mm-per-prompt '{"image":5,"video":1}' \\
          --mm-processor-kwargs "$(python benchmarks/gpu_images.py flags $form)" > $form.log 2>&1 &
      python benchmarks/gpu_images.py check WORKDIR --url http://127.0.0.1:8000/v1 --expect $form
      kill %1; wait
    done
    grep -h "encoder cache\\|encoder_cache" flat.log split.log split-size.log

``check`` prints per photo the server's image tokens (prompt tokens with the photo less those of the
same text alone) next to vidlabel's estimate under the flat and the split bounds, and the body of a
request with six images; it exits 1 when the server disagrees with ``--expect``. The form whose check
passes goes into PIXEL_BOUNDS_FORM (``split`` is what the source read says; docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.demo_mixed import camera_photo  # noqa: E402
from vidlabel import families  # noqa: E402
from vidlabel.prepare.item_probe import probe_item  # noqa: E402

PHOTOS = {"portrait.jpg": ((1080, 1920), None, "JPEG"), "sideways.jpg": ((1920, 1080), 6, "JPEG"),
          "feed.webp": ((1080, 1350), None, "WEBP"), "camera.jpg": ((4000, 3000), None, "JPEG"),
          "small.jpg": ((300, 200), None, "JPEG")}
Q25 = families.by_name("qwen2_5_vl")
# What each form of the pixel bounds would make of a photo: the flat pair bounds photos like video frames.
HYPOTHESES = {"flat": families.ImageBounds(Q25.default_sampling.min_pixels, Q25.default_sampling.max_pixels),
              "split": Q25.default_image_bounds, "split-size": Q25.default_image_bounds}
# The --mm-processor-kwargs of each form, for the frames' and the photos' bounds.
FORMS = {"flat": lambda v, i: {"min_pixels": v.min_pixels, "max_pixels": v.max_pixels},
         "split": lambda v, i: {"images_kwargs": {"min_pixels": i.min_pixels, "max_pixels": i.max_pixels},
                                "videos_kwargs": {"min_pixels": v.min_pixels, "max_pixels": v.max_pixels}},
         "split-size": lambda v, i: {"images_kwargs": {"size": {"shortest_edge": i.min_pixels, "longest_edge": i.max_pixels}},
                                     "videos_kwargs": {"size": {"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels}}}}
TEXT = "Describe the picture in one word."


def make_media(workdir: Path) -> None:
    for seed, (name, (size, orientation, fmt)) in enumerate(PHOTOS.items()):
        camera_photo(workdir / name, size, seed, orientation, fmt)
    print(f"wrote {len(PHOTOS)} photos to {workdir}")


def chat(url: str, model: str, content: list[dict]) -> tuple[int, dict]:
    body = json.dumps({"model": model, "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(f"{url}/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def check(workdir: Path, url: str, model: str, expect: str) -> int:
    _, alone = chat(url, model, [{"type": "text", "text": TEXT}])
    base = alone["usage"]["prompt_tokens"]
    wrong = 0
    print(f"{'photo':14} {'server':>7} " + " ".join(f"{h:>10}" for h in HYPOTHESES))
    for name in PHOTOS:
        info = probe_item(workdir / name)
        status, body = chat(url, model, [{"type": "image_url", "image_url": {"url": (workdir / name).as_uri()}},
                                         {"type": "text", "text": TEXT}])
        served = body["usage"]["prompt_tokens"] - base if status == 200 else f"HTTP {status}"
        guesses = {h: int(Q25.image_tokens([info["width"]], [info["height"]], b)[0]) for h, b in HYPOTHESES.items()}
        wrong += served != guesses[expect]
        print(f"{name:14} {served!s:>7} " + " ".join(f"{g:>10}" for g in guesses.values()))
    many = [{"type": "image_url", "image_url": {"url": (workdir / "small.jpg").as_uri()}}] * 6
    status, body = chat(url, model, [*many, {"type": "text", "text": TEXT}])
    print(f"6 images: HTTP {status} {json.dumps(body)[:400]}")
    print(f"{'all' if not wrong else wrong} photo(s) {'match' if not wrong else 'differ from'} the {expect!r} bounds")
    return 1 if wrong else 0


def flags(form: str) -> str:
    """The server's --mm-processor-kwargs JSON in ``form`` for Qwen2.5-VL's default bounds."""
    return json.dumps(FORMS[form](Q25.default_sampling, Q25.default_image_bounds), separators=(",", ":"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["media", "check", "flags"])
    parser.add_argument("workdir", help="WORKDIR (media, check) or the form (flags)")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    parser.add_argument("--expect", choices=sorted(HYPOTHESES), default="flat")
    args = parser.parse_args(argv)
    if args.step == "flags":
        print(flags(args.workdir))
        return 0
    workdir = Path(args.workdir).resolve()
    if args.step == "media":
        make_media(workdir)
        return 0
    return check(workdir, args.url, args.model, args.expect)


if __name__ == "__main__":
    raise SystemExit(main())
