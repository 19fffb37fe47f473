"""``dev/bench/gpu_stable_abi.py``: the static check whether a vLLM wheel's CUDA extensions load on an older
torch (issue 45: vLLM 0.34 on the GPU host's torch 2.11). Its rules on synthetic inputs and torch's own
headers; the run on the real 0.34 wheel is recorded in README's version table."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_module_from_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def abi():
    return load_module_from_file(ROOT / "dev" / "bench" / "gpu_stable_abi.py", "gpu_stable_abi")


def test_version_guards_are_read(abi, tmp_path: Path) -> None:
    header = tmp_path / "shim.h"
    header.write_text(
        "AOTI_TORCH_EXPORT int aoti_torch_old(int x);\n"
        "#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_10_0\n"
        "AOTI_TORCH_EXPORT int torch_ten(int x);\n"
        "#ifdef USE_CUDA\n"
        "AOTI_TORCH_EXPORT int torch_ten_cuda(void);\n"
        "#endif\n"
        "#endif\n"
        "#if TORCH_FEATURE_VERSION >= TORCH_VERSION_2_14_0\n"
        "AOTI_TORCH_EXPORT int torch_new (int x);\n"
        "#endif\n"
    )
    names = {"aoti_torch_old", "torch_ten", "torch_ten_cuda", "torch_new", "torch_absent"}
    assert abi.introduced_in([header], names) == {
        "aoti_torch_old": "unguarded",
        "torch_ten": "2.10",
        "torch_ten_cuda": "2.10",
        "torch_new": "2.14",
    }


def test_symbol_classes(abi) -> None:
    assert abi.CXX_TORCH.match("_ZN3c1019UndefinedTensorImpl10_singletonE")
    assert abi.CXX_TORCH.match("_ZNK2at10TensorBase4sizeEl")
    assert not abi.CXX_TORCH.match("_ZNKSt9exception4whatEv")
    assert abi.STABLE.match("aoti_torch_get_current_cuda_stream") and abi.STABLE.match("torch_from_blob")


def test_this_torchs_headers_date_the_stable_abi(abi) -> None:
    """The venv's torch headers carry the guards the check reads (a symbol of 2.11 and one older)."""
    import torch

    include = Path(torch.__file__).parent / "include"
    headers = [p for p in include.rglob("*.h") if "stable" in p.parts or "aoti_torch" in p.parts]
    since = abi.introduced_in(headers, {"torch_from_blob", "aoti_torch_get_data_ptr", "torch_call_dispatcher"})
    assert since == {
        "torch_from_blob": "2.11",
        "aoti_torch_get_data_ptr": "unguarded",
        "torch_call_dispatcher": "2.10",
    }
