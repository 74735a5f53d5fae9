"""The GPU validation call's CPU form (benchmarks/gpu_checks.sh --cpu): its training checks run
here on every CI run, so the script cannot rot while no GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env


@pytest.mark.slow
def test_gpu_checks_cpu_form_trains_resumes_and_counts_syncs(tmp_path):
    done = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--cpu"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=cli_env(OUT=str(tmp_path), PY=sys.executable))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    train = summary["3_train_resume"]
    assert train["growth_checks"] == "passed" and train["resumed"] and train["resume_bitwise"], train
    # On the CPU the "device" run would be the CPU reference run: it is run once, nothing compared.
    assert train["max_rel_loss_diff_first_steps"] is None and train["killed_rc"] == -9, train
    # the killed run continued the reference from step 50 and was killed at 63; its resume crossed
    # the growth into 'nf4' (65) and every step from 51 on was compared
    assert train["resume_compared_steps"] == [51, 70], train
    assert summary["4_memory_vs_plan"]["applicable"] is False
    assert summary["5_host_syncs"]["syncs_per_step_4_moe_blocks_accum2"] == 1, summary["5_host_syncs"]
