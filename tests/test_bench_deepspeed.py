"""benchmarks/bench_deepspeed.py without DeepSpeed: sizing and the refusal to run (no timings asserted).

The benchmark itself needs ``deepspeed`` (not a dependency of ucp_dcp or of
this suite); these checks run where it is absent, in well under a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_deepspeed  # noqa: E402  (benchmarks/)


def test_state_sizes_come_close_to_what_was_asked() -> None:
    for size_mb in (30, 280, 1000):
        layers = bench_deepspeed.stack_layers(size_mb, 1024)
        state = 3 * 4 * layers * (1024 * 1024 + 1024)  # fp32 weights + exp_avg + exp_avg_sq
        assert abs(state - size_mb * 1e6) <= 0.5 * 3 * 4 * (1024 * 1024 + 1024), (size_mb, layers)


def test_hf_model_size_comes_close_to_what_was_asked() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    import torch

    cfg = bench_deepspeed.llama_config(150)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    assert 0.9 * 150e6 <= nbytes <= 1.1 * 150e6, nbytes


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_without_deepspeed_it_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_deepspeed.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs deepspeed" in err and "DS_ACCELERATOR=cpu" in err


def test_pipeline_mode_names_and_result_file() -> None:
    # The engine module's names of a PipelineModule of LayerSpecs, as nn.Sequential gives them.
    assert bench_deepspeed.pipe_names(2) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    args = bench_deepspeed.parse_args(["--pipeline"])
    assert args.out.endswith("deepspeed_pipeline.json") and args.ds_dp == 2
    assert args.universal_reader == "torch"
