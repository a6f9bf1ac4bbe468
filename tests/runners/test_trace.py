"""Chrome-trace analysis: categories, busy-time union, gaps, streaming memory, trimming.

Simulator fixtures under tests/fixtures/traces (README there says how they were recorded);
hand-built traces where an exact answer is needed."""

from __future__ import annotations

import gzip
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from runners.profiler_trace.events import GPU_EVENT_CATEGORIES, iter_events
from runners.profiler_trace.kernels import CATEGORIES, classify_kernel
from runners.profiler_trace.summary import summarize, summarize_many, top_kernels
from runners.profiler_trace.trim import summarize_and_trim, trim

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def _fixture(name: str) -> Path:
    return FIXTURES / f"{name}.pt.trace.json.gz"


def _kernel(name: str, ts: float, dur: float, stream: int = 7, cat: str = "kernel",
            device: int = 0) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": device, "tid": stream, "ts": ts,
            "dur": dur, "args": {"device": device, "stream": stream}}


def _write(path: Path, events: list[dict[str, Any]], **top: Any) -> Path:
    text = json.dumps({"schemaVersion": 1, **top, "traceEvents": events})
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# --- kernel categories --------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "category"), [
    # Real H200 names (vLLM 0.26, shared/gpu/README.md "Profiling").
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("void flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>, "
     "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90>>", "attention"),
    ("void flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>>, 7, 256, 1, false>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
     "(vllm::Fp8KVCacheDataType)0>", "kv_write"),
    ("triton_poi_fused_mul_silu_slice_3", "activation"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>",
     "activation"),
    # Other families of vLLM's map.
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t>>",
     "gemm"),
    ("fused_moe_kernel", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     "communication"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>", "communication"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8, __nv_bfloat16>", "norm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
    ("void vllm::dynamic_scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn>",
     "quantize"),
    ("kernel_unified_attention_2d", "attention"),
    ("triton_tem_fused_flex_attn_0", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<128, 8, 16>", "attention"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>",
     "other"),
])
def test_kernel_names_fall_in_vllm_categories(name: str, category: str) -> None:
    assert classify_kernel(name) == category, f"{name} belongs to {category}"


def test_memcpy_and_memset_are_classified_by_event_category() -> None:
    assert classify_kernel("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "memcpy"
    assert classify_kernel("Memset (Device)", "gpu_memset") == "memset"


# --- simulator fixtures -------------------------------------------------------------------------

def test_simulated_eager_trace_is_less_busy_than_graphs() -> None:
    eager = summarize(_fixture("sim_eager"))
    graphs = summarize(_fixture("sim_graphs"))
    assert eager["gpu_busy_fraction"] < 0.4 < graphs["gpu_busy_fraction"], \
        "eager leaves launch gaps between kernels; CUDA graphs do not"
    assert eager["median_gap_us"] > 10 * graphs["median_gap_us"]
    assert eager["idle_gap_share"] == pytest.approx(1 - eager["gpu_busy_fraction"])


def test_only_the_tp2_trace_has_communication() -> None:
    shares = {name: summarize(_fixture(name))["communication_share"]
              for name in ("sim_graphs", "sim_eager", "sim_fp8", "sim_tp2")}
    assert shares["sim_tp2"] > 0.1, "TP=2 all-reduces twice per layer"
    assert all(v == 0.0 for k, v in shares.items() if k != "sim_tp2"), shares


def test_fp8_weights_lower_the_gemm_share_and_add_quantize_kernels() -> None:
    bf16 = summarize(_fixture("sim_graphs"))
    fp8 = summarize(_fixture("sim_fp8"))
    assert fp8["gemm_share"] < bf16["gemm_share"], "fp8 GEMMs read half the weight bytes"
    assert fp8["quantize_share"] > 0.0 == bf16["quantize_share"]


def test_summary_has_every_category_and_shares_add_up() -> None:
    summary = summarize(_fixture("sim_tp2"))
    assert all(f"{c}_s" in summary and f"{c}_share" in summary for c in CATEGORIES)
    assert sum(summary[f"{c}_share"] for c in CATEGORIES) == pytest.approx(1.0)
    assert sum(summary[f"{c}_s"] for c in CATEGORIES) == \
        pytest.approx(summary["kernel_time_s"])
    assert summary["num_kernels"] == 1500
    assert all(isinstance(v, float) for v in summary.values()), "summaries are flat floats"
    assert summary["gpu_busy_s"] <= summary["kernel_span_s"]


def test_top_kernels_ranks_by_total_time() -> None:
    top = top_kernels(_fixture("sim_tp2"), n=3)
    assert [k.category for k in top[:2]] == ["gemm", "communication"]
    assert top[0].total_s >= top[1].total_s >= top[2].total_s
    assert top[0].count > 100 and len(top) == 3


def test_summarize_many_averages_ranks() -> None:
    one = summarize(_fixture("sim_graphs"))
    other = summarize(_fixture("sim_eager"))
    both = summarize_many([_fixture("sim_graphs"), _fixture("sim_eager")])
    assert both["num_ranks"] == 2
    assert both["gpu_busy_fraction"] == pytest.approx(
        (one["gpu_busy_fraction"] + other["gpu_busy_fraction"]) / 2)
    with pytest.raises(ValueError, match="at least one"):
        summarize_many([])


# --- exact answers on hand-built traces ---------------------------------------------------------

def test_busy_time_is_the_union_of_overlapping_streams(tmp_path: Path) -> None:
    events = [
        _kernel("nvjet_a", 0, 10, stream=7),   # [0, 10)
        _kernel("nvjet_b", 5, 10, stream=13),  # [5, 15): overlaps -> [0, 15)
        _kernel("nvjet_c", 12, 2, stream=7),   # inside
        _kernel("ncclDevKernel_AllReduce", 20, 5, stream=21),  # [20, 25)
        _kernel("Memcpy HtoD", 30, 10, cat="gpu_memcpy"),     # [30, 40)
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -100, "dur": 1000},  # CPU: ignored
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 50},  # not a complete event
    ]
    random.Random(0).shuffle(events)  # file order is not time order
    summary = summarize(_write(tmp_path / "t.pt.trace.json", events))
    assert summary["num_kernels"] == 5
    assert summary["kernel_span_s"] == pytest.approx(40e-6)
    assert summary["gpu_busy_s"] == pytest.approx(30e-6), "[0,15) + [20,25) + [30,40)"
    assert summary["gpu_busy_fraction"] == pytest.approx(0.75)
    assert summary["kernel_time_s"] == pytest.approx(37e-6), "durations summed, not unioned"
    assert summary["communication_share"] == pytest.approx(5 / 37)
    assert summary["num_streams"] == 3 and summary["num_late_kernels"] == 0


def test_median_gap_is_taken_on_the_busiest_stream(tmp_path: Path) -> None:
    busy = [_kernel("nvjet", i * 15.0, 10.0, stream=7) for i in range(101)]  # 5 us gaps
    sparse = [_kernel("triton_poi_fused", i * 500.0, 1.0, stream=9) for i in range(10)]
    summary = summarize(_write(tmp_path / "t.pt.trace.json", busy + sparse))
    assert summary["median_gap_us"] == pytest.approx(5.0, rel=0.03)


def test_events_later_than_the_reorder_window_are_counted_not_lost(tmp_path: Path) -> None:
    events = [_kernel("nvjet", 100.0 + i * 10, 5.0) for i in range(50)]
    events.append(_kernel("nvjet", 0.0, 5.0))  # the earliest kernel written last
    path = _write(tmp_path / "t.pt.trace.json", events)
    exact = summarize(path)
    windowed = summarize(path, reorder_window=4)
    assert exact["num_late_kernels"] == 0 and exact["gpu_busy_s"] == pytest.approx(255e-6)
    assert windowed["num_late_kernels"] == 1
    assert windowed["num_kernels"] == 51 and windowed["kernel_time_s"] == exact["kernel_time_s"]
    assert windowed["gpu_busy_s"] <= exact["gpu_busy_s"], "a late kernel is never double-counted"


def test_a_trace_without_gpu_events_gives_only_counts(tmp_path: Path) -> None:
    path = _write(tmp_path / "cpu.pt.trace.json",
                  [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 2}])
    assert summarize(path) == {"num_kernels": 0.0, "kernel_time_s": 0.0}


# --- reading ------------------------------------------------------------------------------------

def test_reader_matches_json_load_at_any_chunk_size(tmp_path: Path) -> None:
    events = [_kernel(f"k{i} \u00e9 \\\" ,]}}", i * 1.5, 0.25) for i in range(40)]
    events.insert(3, {"ph": "M", "name": "process_name", "args": {"name": "[GPU 0]"}})
    path = _write(tmp_path / "t.pt.trace.json", events,
                  deviceProperties=[{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 10 ** 12}])
    expected = json.loads(path.read_text())["traceEvents"]
    for chunk_chars in (1, 7, 64, 1 << 20):
        assert list(iter_events(path, chunk_chars=chunk_chars)) == expected, chunk_chars


def test_bare_array_traces_are_read(tmp_path: Path) -> None:
    path = tmp_path / "bare.json"
    path.write_text(json.dumps([_kernel("nvjet", 0, 4), _kernel("nvjet", 10, 4)]))
    assert summarize(path)["gpu_busy_fraction"] == pytest.approx(8 / 14)


@pytest.mark.parametrize("text", ['{"traceEvents": [{"ph": "X", "cat": "kernel"',
                                  '{"traceEvents": [{"ph": "X"}, oops]}', "not json", ""])
def test_a_broken_trace_raises_value_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "broken.pt.trace.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        summarize(path)


def test_a_cut_gzip_trace_raises_value_error(tmp_path: Path) -> None:
    whole = _fixture("sim_graphs").read_bytes()
    path = tmp_path / "cut.pt.trace.json.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="truncated"):
        summarize(path)


@pytest.mark.slow  # a large trace written and read: most of a minute
def test_a_large_trace_is_summarized_in_bounded_memory(tmp_path: Path) -> None:
    """100k events (~22 MB; tracemalloc makes more slow): the reader keeps one chunk and the
    reorder window, so the peak does not grow with the file."""
    path = tmp_path / "big.pt.trace.json"
    num_events = 100_000
    with path.open("w", encoding="utf-8") as handle:
        handle.write('{"schemaVersion": 1, "traceEvents": [')
        for i in range(num_events):
            cat = "cpu_op" if i % 4 == 0 else "kernel"
            event = {"ph": "X", "cat": cat, "name": f"nvjet_sm90_tst_{i % 64}x8_v_bz_TNT",
                     "pid": 0, "tid": 7 + i % 2, "ts": i * 10.0, "dur": 6.0,
                     "args": {"device": 0, "stream": 7 + i % 2, "correlation": i,
                              "grid": [132, 1, 1], "block": [384, 1, 1]}}
            handle.write(("," if i else "") + json.dumps(event))
        handle.write("]}")
    file_bytes = path.stat().st_size
    tracemalloc.start()
    try:
        summary = summarize(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summary["num_kernels"] == num_events * 3 / 4
    assert peak < file_bytes / 5, f"peak {peak / 1e6:.1f} MB for a {file_bytes / 1e6:.0f} MB file"


# --- trimming -----------------------------------------------------------------------------------

def test_trim_writes_a_small_valid_trace_of_gpu_events(tmp_path: Path) -> None:
    out = tmp_path / "small.pt.trace.json.gz"
    count = trim(_fixture("sim_tp2"), out, max_events=300, note="test")
    with gzip.open(out, "rt", encoding="utf-8") as handle:
        data = json.load(handle)
    assert count == len(data["traceEvents"]) == 300
    assert all(e["ph"] == "X" and e["cat"] in GPU_EVENT_CATEGORIES
               for e in data["traceEvents"])
    assert data["nightshift_trim"]["source"] == "sim_tp2.pt.trace.json.gz"
    summary = summarize(out)
    assert summary["num_kernels"] == 300 and summary["communication_share"] > 0


def test_trim_skips_to_the_requested_window(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.pt.trace.json", [_kernel("nvjet", i * 10.0, 5.0)
                                                 for i in range(100)])
    out = tmp_path / "w.pt.trace.json"
    assert trim(path, out, max_events=10, start_offset_us=500.0) == 10
    starts = [e["ts"] for e in json.loads(out.read_text())["traceEvents"]]
    assert starts == [500.0 + 10 * i for i in range(10)]
    with pytest.raises(ValueError, match="max_events"):
        trim(path, out, max_events=0)


@pytest.mark.parametrize("name", ["sim_graphs", "sim_eager", "sim_tp2"])
def test_summarize_and_trim_in_one_read_equals_the_two(name: str, tmp_path: Path) -> None:
    path = FIXTURES / f"{name}.pt.trace.json.gz"
    one = summarize_and_trim(path, tmp_path / "one.json.gz", max_events=300, note="n")
    trim(path, tmp_path / "two.json.gz", max_events=300, note="n")
    assert one == summarize(path)
    assert gzip.decompress((tmp_path / "one.json.gz").read_bytes()) == \
        gzip.decompress((tmp_path / "two.json.gz").read_bytes())
