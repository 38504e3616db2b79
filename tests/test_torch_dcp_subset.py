"""A few of PyTorch's own DCP tests, run with ucp_dcp's classes substituted for DCP's defaults.

The full harness is ``python tests/torch_dcp/run.py`` (docs/torch-dcp-tests.md).
This test runs a handful of PyTorch tests that pass both with DCP's defaults
and substituted (three single-process, one on 2 gloo ranks, two on 4 ranks) in
a child pytest with ``UCP_DCP_SUBSTITUTE=1``, and checks that they pass and
that every process, the spawned ranks included, ran with the UCP classes.

PyTorch's test files are not committed (tests/torch_dcp/MANIFEST.json says
why and which); without them, or without the ``expecttest`` package that
``torch.testing._internal`` needs, this test is skipped and says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "torch_dcp"
UPSTREAM = HARNESS / "upstream"

SUBSET = [
    "test_file_system_checkpoint_cpu.py::TestDistributedStateDictSaveLoad::test_read_write_only_tensor_thread_count_1",
    "test_file_system_checkpoint_cpu.py::TestDistributedReshardOnLoad::test_save_load_bytes_thread_count_1",
    "test_format_utils.py::TestFormatUtils::test_torch_save_to_dcp",
    "e2e/test_e2e_save_and_load.py::TestInitStateDict::test_init_state_dict",
    # Single process, about a second each: what a load reports (storage_meta),
    # and DCP's strict-load error text.
    "test_compatibility.py::TestDCPCompatbility::test_storage_meta",
    "test_planner.py::TestLoadPlanner::test_strict",
]


def _env(tmp_path: Path, substitute: bool) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src")]
    if (HARNESS / "_deps").is_dir():
        paths.append(str(HARNESS / "_deps"))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        UCP_DCP_TORCH_TESTS="1",
        UCP_DCP_SUBSTITUTE="1" if substitute else "0",
        UCP_DCP_SUBSTITUTE_LOG=str(tmp_path / "substituted-pids"),
        UCP_DCP_TEST_TIMEOUT="120",
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="110",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.mark.multiproc
def test_pytorch_dcp_tests_pass_substituted(tmp_path):
    missing = [t.split("::")[0] for t in SUBSET if not (UPSTREAM / t.split("::")[0]).exists()]
    if missing:
        pytest.skip(
            f"PyTorch's test files are not in tests/torch_dcp/upstream/ ({', '.join(sorted(set(missing)))}): "
            "bring them in with tests/torch_dcp/get_tests.py (docs/torch-dcp-tests.md)"
        )
    env = _env(tmp_path, substitute=True)
    if subprocess.run([sys.executable, "-c", "import expecttest"], env=env).returncode != 0:
        pytest.skip("torch.testing._internal needs the 'expecttest' package (pip install expecttest)")

    ids = [f"tests/torch_dcp/upstream/{t}" for t in SUBSET]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *ids],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"PyTorch DCP tests failed with the UCP classes substituted:\n{tail}"
    assert f"{len(SUBSET)} passed" in proc.stdout, tail

    # The pytest process and every spawned rank (2 + 4 + 4) replaced DCP's names.
    pids = (tmp_path / "substituted-pids").read_text().split("\n")
    records = [line.split() for line in pids if line.strip()]
    assert len(records) >= 1 + 2 + 4 + 4, records
    assert all(int(n) >= 4 for _, n in records), records
