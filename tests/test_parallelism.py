"""classify.parallelism: tensor x data parallel chosen from the model's size and the GPUs' memory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from vidlabel import families
from vidlabel.core import config as vconfig
from vidlabel.serve.settings import ServeSettings
from vidlabel.serve.parallelism import (
    GIB,
    ParallelismError,
    choose_layout,
    gpu_memory_gib,
    granted_gpus,
    model_footprint,
)

DATA = Path(__file__).resolve().parent / "data"
QWEN_7B = DATA / "qwen2_5_vl_7b"
QWEN_72B = DATA / "qwen2_5_vl_72b"
Q25 = families.by_name("qwen2_5_vl")
H200_GIB = 143771 / 1024  # nvidia-smi memory.total of an H200, MiB
H100_80_GIB = 81559 / 1024


def config(model: Path | str, memory_gib: float | None = None, planning: dict | None = None,
           **classify) -> ServeSettings:
    return ServeSettings.from_config(vconfig.validate({
        "posts": "p.csv", "media_root": "/m", "results": "/m/results",
        "planning": planning or {"model_family": "qwen2_5_vl"},  # a made-up model's family: Qwen2.5-VL
        "classify": {"model": str(model), "gpu_memory_gib": memory_gib, **classify}}))


def gpus(n: int) -> dict:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


def test_parameter_count_from_the_model_config_matches_the_published_sizes():
    # Published: 8.29B (7B) and 73.4B (72B) parameters, bf16.
    small, big = model_footprint(str(QWEN_7B), Q25), model_footprint(str(QWEN_72B), Q25)
    assert small.weight_bytes / 2 == pytest.approx(8.29e9, rel=0.002)
    assert big.weight_bytes / 2 == pytest.approx(73.41e9, rel=0.002)
    # KV cache per token: 2 (K and V) x layers x KV heads x head size x 2 bytes.
    assert small.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert big.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert big.attention_heads == 64


@pytest.mark.parametrize("model,n,memory,tensor,data", [
    (QWEN_7B, 1, H200_GIB, 1, 1),
    (QWEN_7B, 4, H100_80_GIB, 1, 4),     # a 7B on a 4-GPU job: four copies, not one split four ways
    (QWEN_7B, 2, H200_GIB, 1, 2),
    (QWEN_72B, 2, H200_GIB, 2, 1),       # 137 GiB of weights fit 2 x 141 GB
    (QWEN_72B, 4, H100_80_GIB, 4, 1),    # but not 2 x 80 GB with a 32k-token request
    (QWEN_72B, 4, H200_GIB, 2, 2),
    (QWEN_72B, 8, H100_80_GIB, 4, 2),
])
def test_auto_picks_the_smallest_tensor_parallel_size_that_fits(model, n, memory, tensor, data):
    layout = choose_layout(config(model, memory), 32768, gpus(n))
    assert (layout.tensor, layout.data) == (tensor, data), layout.reason
    assert layout.held == n  # what the job's labels record as its GPUs
    assert "smallest tensor-parallel size that fits" in layout.reason
    assert layout.groups() == [tuple(str(i) for i in range(k * tensor, (k + 1) * tensor)) for k in range(data)]
    # The decision names its inputs.
    assert f"{n} GPUs (CUDA_VISIBLE_DEVICES: {','.join(str(i) for i in range(n))})" in layout.reason
    assert "classify.gpu_memory_gib" in layout.reason
    assert "largest request 32768 tokens" in layout.reason


def test_the_largest_request_decides_at_the_margin():
    # 72B at TP 2 on 82 GiB GPUs (0.9 usable: 73.8 GiB): weights 68.4 GiB + 4 GiB overhead + the KV
    # cache of a 1,000-token request fit; that of a 32k-token request (10 GiB over two GPUs) does not.
    cfg = config(QWEN_72B, 82.0)
    small = choose_layout(cfg, 1000, gpus(4))
    big = choose_layout(cfg, 32768, gpus(4))
    assert (small.tensor, small.data) == (2, 2) and (big.tensor, big.data) == (4, 1)
    assert "smallest tensor-parallel size that fits" in small.reason and "smallest" in big.reason
    # Nothing fits: every GPU for one copy, and the log says so.
    hopeless = choose_layout(config(QWEN_72B, 20.0), 32768, gpus(4))
    assert (hopeless.tensor, hopeless.data) == (4, 1) and "does not fit even at tensor 4" in hopeless.reason


@pytest.mark.parametrize("server_args,tensor,data", [
    ("", 2, 1),                                        # bf16: 137 GiB of weights need two H200s
    ("--quantization fp8", 1, 2),                      # 68 GiB: one copy per H200
    ("--quantization=fp8 --kv-cache-dtype fp8", 1, 2),
    ("-q awq", 1, 2),
])
def test_quantization_in_the_server_args_sizes_the_weights(server_args, tensor, data):
    layout = choose_layout(config(QWEN_72B, H200_GIB, server_args=server_args), 32768, gpus(2))
    assert (layout.tensor, layout.data) == (tensor, data), layout.reason
    if server_args:
        assert "--quantization" in layout.reason
        weights = float(layout.reason.split("weights ")[1].split(" GiB")[0])
        bytes_per_parameter = 1 if "fp8" in server_args else 0.5
        assert weights == pytest.approx(73.41e9 * bytes_per_parameter / GIB, rel=0.002)
    if "kv-cache-dtype" in server_args:
        assert "KV 160 KiB/token" in layout.reason  # 2 x 80 layers x 8 heads x 128 x 1 byte


@pytest.mark.parametrize("n,memory,tensor,data", [
    (1, H200_GIB, 1, 1),      # the 72B in FP8 (68 GiB) on one 141 GB H200
    (2, H100_80_GIB, 2, 1),   # 68 GiB + a 32k-token request + overhead is over one 80 GB GPU
    (4, H100_80_GIB, 2, 2),
    (4, H200_GIB, 1, 4),      # four FP8 copies on a four-H200 node
])
def test_classify_quantization_fp8_lays_out_the_smallest_tensor_parallel_size_that_fits(n, memory, tensor, data):
    cfg = config(QWEN_72B, memory, quantization="fp8")
    layout = choose_layout(cfg, 32768, gpus(n))
    assert (layout.tensor, layout.data) == (tensor, data), layout.reason
    assert "--quantization fp8: 1 byte(s) per parameter" in layout.reason
    # bf16 needs twice the tensor-parallel size on the same GPUs.
    plain = choose_layout(config(QWEN_72B, memory), 32768, gpus(max(n, 4)))
    assert plain.tensor == 2 * tensor or plain.tensor == 4, plain.reason


def test_gpu_decoding_takes_its_memory_from_the_fit():
    # 8 API servers decoding on the GPU hold 15.4 GiB of it: a 72B FP8 copy still fits one H200 ...
    cfg = config(QWEN_72B, H200_GIB, planning={"decode": "gpu"}, quantization="fp8")
    layout = choose_layout(cfg, 32768, gpus(1))
    assert layout.tensor == 1 and "GPU decoding 15.4 GiB per GPU" in layout.reason, layout.reason
    # ... but a GPU just large enough without decoding is not enough with it.
    weights = 73.41e9 / GIB  # FP8: one byte per parameter
    kv = 2 * 80 * 8 * 128 * 2 * 32768 / GIB
    snug = (weights + kv + 4.0 + 1.0) / 0.9
    assert choose_layout(config(QWEN_72B, snug, quantization="fp8"), 32768, gpus(2)).tensor == 1
    assert choose_layout(config(QWEN_72B, snug, planning={"decode": "gpu"}, quantization="fp8"), 32768,
                         gpus(2)).tensor == 2


def test_a_checkpoint_quantized_already_is_not_shrunk_again(tmp_path):
    folder = tmp_path / "Qwen2.5-VL-72B-Instruct-FP8"
    folder.mkdir()
    cfg = json.loads((QWEN_72B / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 73.41e9}}))
    layout = choose_layout(config(folder, H200_GIB, server_args="--quantization fp8"), 32768, gpus(1))
    assert "--quantization" not in layout.reason and "weights 68.4 GiB" in layout.reason


def test_explicit_layout_is_kept_and_checked_against_the_gpus():
    cfg = config(QWEN_7B, None, parallelism={"tensor": 2, "data": 2})
    layout = choose_layout(cfg, 1000, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert (layout.tensor, layout.data) == (2, 2) and layout.groups() == [("4", "5"), ("6", "7")]
    with pytest.raises(ParallelismError, match="classify.parallelism.*needs 4 GPUs but the job has 2"):
        choose_layout(cfg, 1000, gpus(2))


def test_unknown_size_or_memory_uses_every_gpu_for_one_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    layout = choose_layout(config("some-org/mystery-model", 80.0), 1000, gpus(4))
    assert (layout.tensor, layout.data) == (4, 1) and "model size unknown" in layout.reason
    layout = choose_layout(config(QWEN_7B, None), 1000, gpus(4))
    assert (layout.tensor, layout.data) == (4, 1) and "GPU memory unknown" in layout.reason
    # A size in the model's name is the last resort.
    by_name = choose_layout(config("org/Some-VL-7B", 80.0), 1000, gpus(4))
    assert by_name.data == 4 and "KV size unknown (size in the model name" in by_name.reason
    assert "nan" not in by_name.reason
    # No GPU seen (a stand-in server): one copy, and no GPUs the labels could count.
    alone = choose_layout(config(QWEN_7B, 80.0), 1000, {})
    assert alone.gpus == ("0",) and alone.held == 0


def test_model_files_from_the_hugging_face_cache_and_weights_from_the_index(monkeypatch, tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-VL-7B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((QWEN_7B / "config.json").read_text())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    fp = model_footprint("Qwen/Qwen2.5-VL-7B-Instruct", Q25)
    assert fp.weight_bytes / 2 == pytest.approx(8.29e9, rel=0.002) and str(snapshot) in fp.source
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16584333312}}))
    fp = model_footprint("Qwen/Qwen2.5-VL-7B-Instruct", Q25)
    assert fp.weight_bytes == 16584333312 and "total_size" in fp.source


def test_gpus_and_memory_from_nvidia_smi_when_nothing_says_otherwise(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in\n  -L) printf "GPU 0: H200 (UUID: a)\\nGPU 1: H200 (UUID: b)\\n";;\n'
                   '  *) printf "143771\\n143771\\n";;\nesac\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert granted_gpus({}) == (["0", "1"], "nvidia-smi -L")
    assert granted_gpus({"CUDA_VISIBLE_DEVICES": "3"}) == (["3"], "CUDA_VISIBLE_DEVICES")
    memory, source = gpu_memory_gib(config(QWEN_72B, None).layout)
    assert memory == pytest.approx(H200_GIB) and source == "nvidia-smi memory.total"
    layout = choose_layout(config(QWEN_72B, None), 32768, {})
    assert (layout.tensor, layout.data) == (2, 1), layout.reason
    assert GIB == 1024 ** 3


# ------------------------------------------------------------------ copies served by the classify job

def _shard(tmp_path: Path, n: int, classify: dict, monkeypatch):
    """A shard of n requests for the default server command, whose `vllm` is the stand-in (2 slots
    per copy, 0.3 s per request)."""
    from standin import vllm_shim
    from standin.shards import (
        YES_IF,
        make_config,
        make_video,
        manifest_rows,
        write_manifest,
    )

    media = tmp_path / "media"
    clip = make_video(media / "clip.mp4")
    log = tmp_path / "requests.jsonl"
    shim = vllm_shim(tmp_path / "bin", "--request-log", str(log), "--slots", "2", "--latency", "0.3", *YES_IF)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    default = vconfig.load_schema()["properties"]["classify"]["properties"]["server_command"]["default"]
    cfg = make_config(tmp_path, media, classify={**classify, "server_command": default})
    rows = manifest_rows(cfg, [{"post_id": f"p{i}", "media_path": str(clip), "caption": "buy" if i % 2 else "x"}
                               for i in range(n)])
    return cfg, write_manifest(tmp_path / "shard.parquet", rows), log


def test_one_server_per_copy_with_its_gpus_and_balanced_requests(tmp_path, monkeypatch):
    """tensor 1 x data 2 on a job granted GPUs 4,5: two stand-in servers, one per GPU; the client
    spreads the requests over both and keeps classify.concurrency in flight at each."""
    import pyarrow.parquet as pq
    from standin import is_probe, max_in_flight, read_request_log

    from vidlabel.serve.classify import run_shard

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    cfg, shard, log = _shard(tmp_path, 24, {"parallelism": {"tensor": 1, "data": 2}, "concurrency": 2}, monkeypatch)
    run_shard(cfg, shard, tmp_path / "labels.parquet", tmp_path / "journal.jsonl", tmp_path / "server.log", 0)
    labels = pq.read_table(tmp_path / "labels.parquet").to_pylist()
    assert len(labels) == 24 and {r["status"] for r in labels} == {"ok"}
    logs = {i: (tmp_path / f"server.copy-{i}.log").read_text() for i in (0, 1)}
    assert "CUDA_VISIBLE_DEVICES 4," in logs[0] and "CUDA_VISIBLE_DEVICES 5," in logs[1]
    assert all("tensor 1 x data 1, api servers 4" in text for text in logs.values())  # 16 CPUs / 2 copies / 2
    events = [e for e in read_request_log(log) if not is_probe(e["request_id"])]
    by_server: dict[int, list] = {}
    for e in events:
        by_server.setdefault(e["pid"], []).append(e)
    assert len(by_server) == 2
    served = sorted(sum(e["event"] == "received" for e in evs) for evs in by_server.values())
    assert served[0] >= 8 and sum(served) == 24  # both copies did a fair share
    # Two requests in flight per copy: four at once over the job, never more.
    assert max_in_flight(events) == 4


def test_vllm_data_parallel_is_one_server_with_the_copies_behind_one_port(tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    from standin import is_probe, max_in_flight, read_request_log

    from vidlabel.serve.classify import run_shard

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg, shard, log = _shard(tmp_path, 12, {"parallelism": {"tensor": 1, "data": 2}, "concurrency": 2,
                                            "data_parallel_backend": "vllm"}, monkeypatch)
    run_shard(cfg, shard, tmp_path / "labels.parquet", tmp_path / "journal.jsonl", tmp_path / "server.log", 0)
    assert {r["status"] for r in pq.read_table(tmp_path / "labels.parquet").to_pylist()} == {"ok"}
    text = (tmp_path / "server.log").read_text()
    assert "CUDA_VISIBLE_DEVICES 0,1," in text and "tensor 1 x data 2" in text
    events = [e for e in read_request_log(log) if not is_probe(e["request_id"])]
    assert len({e["pid"] for e in events}) == 1 and max_in_flight(events) == 4
