"""What only CUDA has, held to what it claims (skipped without a GPU: the ``gpu`` marker): CUDA-event
phase times against the job's wall time, NVML energy against mean power x time, no graph compiled
inside the timing after the compile warm-up, and peak memory from the CUDA allocator."""

import pytest
import torch

from specbench.run import runner
from helpers import tiny_cfg

pytestmark = pytest.mark.gpu


def cuda_job(tiny_dirs, tmp_path, **over):
    base = {"device": "cuda", "dtype": "fp32", "kernel": "torch", "warmup": True, "max_new_tokens": 48,
            "method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    base.update(over)
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, **base), sweep_id="gpu")
    assert all(r["status"] == "ok" for r in recs), [r.get("error") for r in recs]
    return recs


def test_cuda_event_phases_add_up_to_the_wall_time(tiny_dirs, tmp_path):
    for rec in cuda_job(tiny_dirs, tmp_path):
        m = rec["metrics"]
        phases = sum(m["time_s"][p] for p in ("prefill", "draft", "verify", "accept"))
        assert 0.95 * m["wall_s"] <= phases <= 1.05 * m["wall_s"], (rec["method"], m["time_s"], m["wall_s"])
        assert m["time_s"]["forward"] <= phases * 1.05


def test_nvml_energy_matches_mean_power_times_time(tiny_dirs, tmp_path):
    pytest.importorskip("pynvml")
    for rec in cuda_job(tiny_dirs, tmp_path, max_new_tokens=200, limit=4):
        m = rec["metrics"]
        nv = m["nvml"]
        if m["energy_j"] is None:
            pytest.skip("this GPU has no NVML energy counter")
        assert nv["samples"] >= 5
        est = nv["power_w_mean"] * m["wall_s"]
        assert abs(m["energy_j"] - est) <= 0.25 * est, (m["energy_j"], est)


def test_no_graph_is_compiled_inside_the_timing_after_the_warm_up(tiny_dirs, tmp_path):
    for rec in cuda_job(tiny_dirs, tmp_path, compile=True, bs=2):
        assert rec["metrics"]["compile"]["graphs_in_timing"] == 0


def test_graphs_capture_everything_before_the_timing_and_say_what_it_holds(tiny_dirs, tmp_path):
    for rec in cuda_job(tiny_dirs, tmp_path, compile="graphs", bs=2):
        c = rec["metrics"]["compile"]
        assert c["graphs_in_timing"] == 0 and c["graphs"] > 0 and c["capture_bytes"] > 0, c


def test_peak_memory_comes_from_the_cuda_allocator(tiny_dirs, tmp_path):
    torch.cuda.empty_cache()
    for rec in cuda_job(tiny_dirs, tmp_path):
        peak = rec["metrics"]["peak_mem_bytes"]
        assert 0 < peak <= torch.cuda.max_memory_allocated()
        assert peak < 2 << 30  # a tiny model: the allocator's bytes, not the process's RSS
