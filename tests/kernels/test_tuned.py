"""The shipped per-GPU kernel tables (``kernels.tuned``): lookup rules and the files' validity."""

from __future__ import annotations

import json

import pytest

from qpage.kernels.tuned import (
    CONFIG_DIR,
    decode_key,
    device_key,
    matmul_kind,
    pick_m,
    problems,
    tuned_matmul,
)

TABLE = {"matmul": {"int4-g128": {"4096x14336": {
    "1": {"block_m": 16, "block_n": 128, "block_k": 64, "split_k": 8, "kind": "gemv"},
    "16": {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4},
    "256": {"block_m": 128, "block_n": 128, "block_k": 64, "kind": "dequant"}}}}}


def test_device_key_and_kinds() -> None:
    assert device_key("NVIDIA GeForce RTX 4090") == "nvidia_geforce_rtx_4090"
    assert device_key("NVIDIA H200") == "nvidia_h200"
    assert matmul_kind(4, 128, 4096, awq=False, act_order=False) == "int4-g128"
    assert matmul_kind(8, 4096, 4096, awq=False, act_order=False) == "int8-chan"
    assert matmul_kind(4, 64, 4096, awq=True, act_order=False) == "awq-g64"
    assert matmul_kind(4, 128, 4096, awq=False, act_order=True) is None
    assert decode_key("e4m3", True, 128, 4) == "fp8-e4m3-per-token/d128/g4"
    assert decode_key(None, False, 64, 3) == "fp16/d64/g3"


@pytest.mark.parametrize(("m", "want"), [(1, "1"), (2, "16"), (16, "16"), (17, "256"), (4096, "256")])
def test_pick_smallest_tuned_m_at_least_m(m: int, want: str) -> None:
    entries = TABLE["matmul"]["int4-g128"]["4096x14336"]
    assert pick_m(entries, m) is entries[want]
    assert tuned_matmul(TABLE, "int4-g128", m, 14336, 4096) is entries[want]


def test_untuned_problems_fall_back() -> None:
    entries = TABLE["matmul"]["int4-g128"]["4096x14336"]
    assert tuned_matmul(TABLE, "int4-g128", 1, 28672, 4096) is entries["1"]  # same K, N within 2x
    assert tuned_matmul(TABLE, "int4-g128", 1, 4096, 4096) is None  # N 3.5x away
    assert tuned_matmul(TABLE, "int4-g128", 1, 14336, 8192) is None  # another K
    assert tuned_matmul(TABLE, "int8-chan", 1, 14336, 4096) is None  # kind not tuned
    assert tuned_matmul(TABLE, None, 1, 14336, 4096) is None  # act-order: never tuned
    assert tuned_matmul({}, "int4-g128", 1, 14336, 4096) is None


def test_shipped_tables_are_valid() -> None:
    """Every shipped table parses, names its device, and every entry is usable."""
    for path in sorted(CONFIG_DIR.glob("*.json")):
        table = json.loads(path.read_text())
        assert device_key(table["device"]) == path.stem, path
        assert problems(table) == [], path


def test_table_problems_are_named() -> None:
    assert problems({"device": "x", **TABLE}) == []
    bad = {"matmul": {"int4-g128": {"4096by14336": {"0": {"block_m": 16, "block_n": 60, "block_k": 64},
                                                     "1": {"tile": 3}, "2": {"block_m": 16, "block_n": 64,
                                                                             "block_k": 64, "kind": "pairs"}}}},
           "paged_decode": {"fp16/d128/g4": {"block_n": 64, "partition": 100}}}
    errors = "\n".join(problems(bad))
    for part in ("no 'device' field", "not KxN", "M must be a positive integer", "multiples of 8",
                 "unknown fields ['tile']", "must be a multiple of block_n",
                 "kind='pairs' is not one of"):
        assert part in errors


def test_a_table_no_kernel_takes_is_ignored_with_a_warning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A shipped file with an unknown field (here an option of an older tuner) or bad JSON is
    not used: the defaults run, and the warning names the file and the problem."""
    from qpage.kernels.tuned import read_table

    bad = {"device": "x", "matmul": {"int4-g128": {"4096x14336": {"1": {**TABLE["matmul"]["int4-g128"][
        "4096x14336"]["1"], "lean": True}}}}}
    (tmp_path / "old.json").write_text(json.dumps(bad))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "good.json").write_text(json.dumps({"device": "good", **TABLE}))
    assert read_table("old", tmp_path) == {} and read_table("broken", tmp_path) == {}
    assert "old.json ignored (matmul int4-g128 4096x14336 M=1: unknown fields ['lean'])" in caplog.text
    assert "broken.json ignored (unreadable" in caplog.text
    assert read_table("good", tmp_path)["matmul"] == TABLE["matmul"]
