"""classify.in_flight_from_kv_cache: the job keeps no more requests in flight than the servers' KV caches hold
of its shard's requests (+ 2 per server), read from vLLM's /metrics once the servers are identified."""

from __future__ import annotations

import sys

from standin import is_probe, max_in_flight, read_request_log, standin_command
from standin.shards import YES_IF, make_config, make_video, manifest_rows, write_manifest

from vidlabel.serve.concurrency import IN_FLIGHT_HEADROOM, fit_in_flight
from vidlabel.serve.probe import kv_cache_tokens


def test_the_in_flight_count_a_kv_cache_holds():
    # The 72B FP8 on one H200: 162,512 tokens of KV cache, requests of ~15,800 tokens with the answer.
    n, why = fit_in_flight(32, [162_512], 15_800)
    assert n == 10 + IN_FLIGHT_HEADROOM
    assert why.startswith("12 in flight, not classify.concurrency 32: the KV cache of 162,512 tokens holds 10 ")
    # A 7B's cache holds more than classify.concurrency: the setting stands.
    assert fit_in_flight(32, [1_500_000], 15_800) == (32, "32 in flight (classify.concurrency; the KV caches hold "
                                                           "more of these requests)")
    # Per server: each gets its share of the most; one that reports no KV cache keeps its share.
    n, why = fit_in_flight(64, [100_000, None], 15_000)
    assert n == (6 + 2) + 32 and "1 server(s) report no KV cache" in why
    # Nothing to go by: the setting stands.
    assert fit_in_flight(32, [None], 15_800)[0] == 32 and fit_in_flight(32, [], 15_800)[0] == 32
    assert fit_in_flight(32, [162_512], 0)[0] == 32
    # A cache smaller than one request still lets the headroom through (vLLM refuses what never fits).
    assert fit_in_flight(32, [8_000], 15_800)[0] == IN_FLIGHT_HEADROOM


def test_the_kv_cache_in_tokens_from_vllm_s_cache_config_info():
    # As vLLM 0.26 writes the info gauge (every CacheConfig field a label), two engines behind one server,
    # one of them written again by a second API server.
    def info(engine, blocks):
        return (f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{engine}",'
                f'gpu_memory_utilization="0.92",num_gpu_blocks="{blocks}",prefix_caching_hash_algo="sha256"}} 1.0')
    text = "\n".join(["# TYPE vllm:cache_config_info gauge", info(0, 6422), info(1, 6422), info(1, 6422)])
    assert kv_cache_tokens(text) == 2 * 6422 * 16
    assert kv_cache_tokens(text.replace('num_gpu_blocks="6422"', 'num_gpu_blocks="None"')) is None
    assert kv_cache_tokens("vllm:num_requests_running 3.0") is None and kv_cache_tokens(None) is None


def _shard(tmp_path, n, classify):
    media = tmp_path / "media"
    clip = make_video(media / "clip.mp4")
    cfg = make_config(tmp_path, media, classify=classify)
    rows = manifest_rows(cfg, [{"post_id": f"p{i}", "media_path": str(clip), "caption": "buy" if i % 2 else "x"}
                               for i in range(n)])
    return cfg, write_manifest(tmp_path / "shard.parquet", rows), rows


def _serve(cfg, log, kv_tokens: int) -> None:
    # 32 slots: the stand-in would run everything at once; its KV cache admits what fits, the rest wait.
    cfg["classify"]["server_command"] = standin_command(sys.executable, log, *YES_IF, "--slots", "32",
                                                        "--latency", "0.2", "--kv-capacity-tokens", str(kv_tokens))


def test_a_job_keeps_in_flight_what_its_servers_kv_cache_holds(tmp_path, caplog):
    import logging

    import pyarrow.parquet as pq

    from vidlabel.serve.classify import run_shard

    for name, on in (("fitted", True), ("off", False)):
        cfg, shard, rows = _shard(tmp_path / name, 30, {"concurrency": 16, "max_tokens": 64,
                                                        "in_flight_from_kv_cache": on})
        request = sum(r["est_prompt_tokens"] for r in rows) / len(rows) + 64  # the shard's mean, with its answer
        kv = int(3.5 * request) // 16 * 16  # whole blocks of 16 tokens: 3 of the shard's requests
        log = tmp_path / name / "requests.jsonl"
        _serve(cfg, log, kv)
        caplog.clear()
        caplog.set_level(logging.INFO, logger="vidlabel.serve.classify")
        out = tmp_path / name
        run_shard(cfg, shard, out / "labels.parquet", out / "journal.jsonl", out / "server.log", 0)
        assert {r["status"] for r in pq.read_table(out / "labels.parquet").to_pylist()} == {"ok"}
        events = [e for e in read_request_log(log) if not is_probe(e["request_id"])]
        said = [r.getMessage() for r in caplog.records if "in flight, not classify.concurrency" in r.getMessage()]
        if on:
            assert max_in_flight(events) == 3 + IN_FLIGHT_HEADROOM
            assert said == [f"shard 0: 5 in flight, not classify.concurrency 16: the KV cache of {kv:,} tokens holds "
                            f"3 of this shard's mean request ({request:,.0f} tokens with its answer), + 2 per server "
                            "(classify.in_flight_from_kv_cache)"]
        else:  # classify.concurrency in flight: the rest queue in the engine
            assert max_in_flight(events) == 16 and said == []
