"""growtrain/runtime/memtrace.py, what benchmarks/growth_memory.py reads: off unless GROWTRAIN_MEMORY_TRACE
is set; on, one JSON line per phase with the live tensor bytes at its start and at its peak."""

from __future__ import annotations

import json

import torch

from growtrain.runtime import memtrace


def test_a_phase_records_nothing_unless_the_trace_is_on(tmp_path, monkeypatch):
    monkeypatch.delenv(memtrace.ENV, raising=False)
    with memtrace.phase("s", "growth"):
        torch.ones(10)
    assert not any(tmp_path.iterdir())


def test_a_phase_sees_what_it_held_at_its_peak_and_what_was_alive_before(tmp_path, monkeypatch):
    monkeypatch.setenv(memtrace.ENV, str(tmp_path / "trace"))
    before = torch.zeros(1_000_000)  # 4 MB alive at the start
    with memtrace.phase("experts", "growth", rank=3):
        big = torch.ones(4_000_000)  # 16 MB made inside, then freed
        del big
        small = torch.ones(1_000)
    (record,) = [json.loads(line) for line in (tmp_path / "trace" / "rank-3.jsonl").read_text().splitlines()]
    assert record["stage"] == "experts" and record["phase"] == "growth" and record["rank"] == 3
    assert record["baseline_bytes"] >= before.numel() * 4
    assert record["live_peak_bytes"] - record["baseline_bytes"] >= 16_000_000
    assert record["live_peak_bytes"] - record["baseline_bytes"] < 16_000_000 + 1_000_000
    assert small.sum() == 1_000


def test_the_live_meter_counts_real_storages_and_not_a_model_built_on_meta():
    from growtrain.runtime.memory import LiveTensorMeter
    from growtrain.model import GrowLM, ModelConfig

    with LiveTensorMeter() as meter:
        with torch.device("meta"):
            GrowLM(ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, ffn_hidden=128))
        held = torch.zeros(1000)
    assert meter.peak == held.nbytes  # the meta model held nothing
