"""A vLLM pod's load from its /metrics page (kvnode/index/vllm_load.py): the few vLLM gauges,
summed over engines, in Prometheus's text format with everything it allows around them."""

from __future__ import annotations

from pagekv.kvnode.index.vllm_load import parse_vllm_load

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0"'
PAGE = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{MODEL}}} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{MODEL}}} 3.0 1764600000000
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{MODEL}}} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="28000",prefix_caching_hash_algo="sha256"}} 1.0
vllm:iteration_tokens_total_bucket{{le="1.0",{MODEL}}} 3.0
vllm:num_requests_waiting_by_reason{{reason="capacity"}} 99.0
python_gc_objects_collected_total{{generation="0"}} 1.0
"""


def test_one_engine_gives_its_queue_and_free_blocks() -> None:
    assert parse_vllm_load(PAGE) == {"waiting": 3.0, "running": 7.0, "free_blocks": 21000.0}


def test_engines_are_summed_and_free_blocks_left_out_when_ambiguous() -> None:
    page = PAGE + "\n".join([
        'vllm:num_requests_running{model_name="m",engine="1"} 2',
        'vllm:num_requests_waiting{model_name="m",engine="1"} 1',
        'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.5',
    ])
    assert parse_vllm_load(page) == {"waiting": 4.0, "running": 9.0}


def test_older_names_odd_labels_and_garbage() -> None:
    page = "\n".join([
        'vllm:gpu_cache_usage_perc{model_name="a } b, \\"c\\""} 0.9',  # braces, quotes inside
        'vllm:cache_config_info{num_gpu_blocks="1000",block_size="16"} 1',
        "vllm:num_requests_running 5",  # no labels at all
        "vllm:num_requests_waiting{unclosed 5",
        "vllm:num_requests_waiting{} not-a-number",
        "vllm:",
    ])
    assert parse_vllm_load(page) == {"running": 5.0, "free_blocks": 100.0}


def test_a_page_without_vllm_gauges_gives_nothing() -> None:
    assert parse_vllm_load("") == {}
    assert parse_vllm_load("# just comments\nup 1\n") == {}
