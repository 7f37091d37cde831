"""Image tokens on a real vLLM: which pixel bounds the server applies to photos, checked against vidlabel.

Two questions the stand-in answers from vLLM's source but no GPU run has measured yet:

1. Does the flat ``--mm-processor-kwargs '{"min_pixels":..,"max_pixels":..}'`` of vidlabel's default
   server command bound images as well as video frames (transformers' ``_merge_kwargs`` applies a flat
   key to every modality), and do ``images_kwargs`` / ``videos_kwargs`` give each its own bounds?
2. The exact 400 for more images than ``--limit-mm-per-prompt`` allows, and the encoder cache size
   vLLM picks with images enabled (its log line "encoder_cache_size").

Steps (WORKDIR inside the server's --allowed-local-media-path):

    python benchmarks/gpu_images.py media WORKDIR
    vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000 --allowed-local-media-path WORKDIR \\
        --max-model-len 32768 --limit-mm-per-prompt '{"image":4,"video":1}' \\
        --mm-processor-kwargs '{"min_pixels":100352,"max_pixels":602112}' > flat.log 2>&1 &
    python benchmarks/gpu_images.py check WORKDIR --url http://127.0.0.1:8000/v1 --expect flat
    # restart the server with per-modality bounds:
    #   --mm-processor-kwargs '{"images_kwargs":{"min_pixels":3136,"max_pixels":12845056},
    #                           "videos_kwargs":{"min_pixels":100352,"max_pixels":602112}}' > split.log
    python benchmarks/gpu_images.py check WORKDIR --url http://127.0.0.1:8000/v1 --expect split
    grep -h "encoder_cache_size\\|encoder cache" flat.log split.log

``check`` prints per photo the server's image tokens (prompt tokens with the photo less those of the
same text alone) next to vidlabel's estimate under both hypotheses, and the body of a request with
five images; it exits 1 when the server disagrees with ``--expect``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vidlabel.demo_mixed import camera_photo  # noqa: E402
from vidlabel.prepare import tokens as tk  # noqa: E402
from vidlabel.prepare.items import probe_item  # noqa: E402

PHOTOS = {"portrait.jpg": ((1080, 1920), None, "JPEG"), "sideways.jpg": ((1920, 1080), 6, "JPEG"),
          "feed.webp": ((1080, 1350), None, "WEBP"), "camera.jpg": ((4000, 3000), None, "JPEG"),
          "small.jpg": ((300, 200), None, "JPEG")}
HYPOTHESES = {"flat": tk.ImageBounds(100352, 602112), "split": tk.ImageBounds()}
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
    print(f"{'photo':14} {'server':>7} " + " ".join(f"{h:>7}" for h in HYPOTHESES))
    for name in PHOTOS:
        info = probe_item(workdir / name)
        status, body = chat(url, model, [{"type": "image_url", "image_url": {"url": (workdir / name).as_uri()}},
                                         {"type": "text", "text": TEXT}])
        served = body["usage"]["prompt_tokens"] - base if status == 200 else f"HTTP {status}"
        guesses = {h: int(tk.image_tokens([info["width"]], [info["height"]], b)[0]) for h, b in HYPOTHESES.items()}
        wrong += served != guesses[expect]
        print(f"{name:14} {served!s:>7} " + " ".join(f"{g:>7}" for g in guesses.values()))
    many = [{"type": "image_url", "image_url": {"url": (workdir / "small.jpg").as_uri()}}] * 5
    status, body = chat(url, model, [*many, {"type": "text", "text": TEXT}])
    print(f"5 images: HTTP {status} {json.dumps(body)[:400]}")
    print(f"{'all' if not wrong else wrong} photo(s) {'match' if not wrong else 'differ from'} the {expect!r} bounds")
    return 1 if wrong else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["media", "check"])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    parser.add_argument("--expect", choices=sorted(HYPOTHESES), default="flat")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    if args.step == "media":
        make_media(workdir)
        return 0
    return check(workdir, args.url, args.model, args.expect)


if __name__ == "__main__":
    raise SystemExit(main())
