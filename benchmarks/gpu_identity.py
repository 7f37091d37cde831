"""What a job sees of a real vLLM's identity (vidlabel.serve.probe), and whether the calibration videos
count as the plan expects on it.

Starts the job's own server twice with the default server command (``vllm`` on PATH, or the test
stand-in with ``--standin``), each time probing it as a classify job does (``/version``, ``/v1/models``,
``/metrics``, ``/server_info`` with VLLM_SERVER_DEV_MODE=1, the two calibration videos):

- ``a``: as planned (``planning.fps`` 2, the default pixel bounds): the calibration videos' visual
  tokens must equal what the plan expects (else every job on this vLLM logs "samples videos otherwise
  than the plan" and names it in the labels' ``server`` column);
- ``b``: the server started with ``--fps-b`` and ``--max-pixels-b`` while the plan expects ``a``'s: the
  fingerprint must differ from ``a``'s, and the probe must say that the server samples unlike the plan.

Printed per phase: ``vllm --version`` (the program identity a job with nothing to send checks), the
identity's fields, the measured and expected tokens of each video, and the fingerprint; also in
WORKDIR/gpu_identity.json. Exit status 0 when ``a`` matches the plan and ``b`` is told apart.

    python benchmarks/gpu_identity.py --workdir /tmp/vidlabel-identity --server-args "--load-format dummy"
    python benchmarks/gpu_identity.py --workdir /tmp/vidlabel-identity --standin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from vidlabel.core import config as vconfig  # noqa: E402
from vidlabel.core import identity  # noqa: E402
from vidlabel.serve.calibration import calibration  # noqa: E402
from vidlabel.serve.command import placeholder_command  # noqa: E402
from vidlabel.serve.endpoints import Endpoint  # noqa: E402
from vidlabel.serve.probe import identify  # noqa: E402
from vidlabel.serve.server import VLLMServer  # noqa: E402
from vidlabel.serve.settings import ServeSettings  # noqa: E402


def config(work: Path, args, fps: float, max_pixels: int) -> dict:
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    return vconfig.validate({
        "posts": str(work / "posts.csv"), "media_root": str(media), "results": str(work / "results"),
        "classify": {"model": args.model, "server_args": args.server_args, "startup_timeout_s": args.startup_timeout,
                     "questions": [{"id": "q", "text": "Is there a product?"}]},
        "planning": {"fps": fps, "max_pixels": max_pixels}})


async def probe(server: VLLMServer, planned: ServeSettings) -> dict:
    await server.wait_ready()
    ep = Endpoint(0, server.base_url, server.api_key, owned=True)
    async with aiohttp.ClientSession() as session:
        found = await identify(session, ep, planned.model, calibration(planned))
    videos = calibration(planned).videos
    return {"label": found.label, "fingerprint": found.fingerprint, "version": found.version,
            "model_root": found.model_root, "max_model_len": found.max_model_len, "reported": found.reported,
            "calibration": {v.what: {"measured": found.calibration.get(v.what), "expected": v.expected_tokens}
                            for v in videos},
            "unlike_plan": list(found.unlike_plan)}


def phase(work: Path, args, name: str, fps: float, max_pixels: int, planned: ServeSettings) -> dict:
    served = ServeSettings.from_config(config(work, args, fps, max_pixels))
    with VLLMServer(served, work / f"server-{name}.log", env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        result = asyncio.run(probe(server, planned))
    result["program"] = identity.program_version(placeholder_command(served.server))
    print(f"{name}: {json.dumps(result, indent=2, default=str)}", flush=True)
    return result


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/vidlabel-identity")
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--server-args", default="", help="classify.server_args, e.g. --load-format dummy")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--fps-b", type=float, default=1.0)
    ap.add_argument("--max-pixels-b", type=int, default=301056)
    ap.add_argument("--standin", action="store_true", help="the test stand-in as `vllm` (no GPU needed)")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.standin:
        from standin import vllm_shim

        shim = vllm_shim(work / "standin-bin", "--random-weights")
        os.environ["PATH"] = f"{shim.parent}{os.pathsep}{os.environ['PATH']}"
    planned = ServeSettings.from_config(config(work, args, 2.0, 602112))
    a = phase(work, args, "a", 2.0, 602112, planned)
    b = phase(work, args, "b", args.fps_b, args.max_pixels_b, planned)
    ok = not a["unlike_plan"] and all(v["measured"] == v["expected"] for v in a["calibration"].values()) \
        and b["fingerprint"] != a["fingerprint"] and bool(b["unlike_plan"])
    (work / "gpu_identity.json").write_text(json.dumps({"a": a, "b": b, "ok": ok}, indent=2, default=str))
    print(f"gpu_identity: {'OK' if ok else 'FAILED'}: a as planned {not a['unlike_plan']}, "
          f"b told apart {b['fingerprint'] != a['fingerprint']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
