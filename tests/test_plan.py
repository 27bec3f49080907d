"""``qpage plan`` against the worked example of docs/serving.md (Llama-3-8B on a 24 GiB card).

The example: KV 128 KiB/token in FP16 and ~66 KiB in FP8 with per-token scales (qpage's fp16
scales make it 65 KiB); weights ~16 GB in FP16 and ~5.7 GB with INT4 g128 linears; with
~1.5 GB kept back, ~62 k tokens (FP16 + FP16 KV), ~141 k (INT4 + FP16 KV) and ~277 k
(INT4 + FP8 KV, 4.5x the FP16 setup). The tolerance is 2%: the design rounds its figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qpage.cli import main
from qpage.plan import load_arch, num_params, plan, run_plan

GIB = 2**30


def rows_by_key(model: str = "Llama-3-8B") -> dict[tuple[str, str], object]:
    _, arch = load_arch(model)
    return {(r.weights, r.kv): r for r in plan(arch, 24 * GIB, int(1.5 * GIB), 8192)}


def test_llama3_8b_matches_the_worked_example() -> None:
    _, arch = load_arch("Llama-3-8B")
    assert num_params(arch) == pytest.approx(8.03e9, rel=0.01)
    rows = rows_by_key()
    fp16 = rows[("FP16", "FP16")]
    assert fp16.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # exactly 128 KiB
    assert rows[("FP16", "FP8")].kv_bytes_per_token == pytest.approx(66 * 1024, rel=0.02)
    assert fp16.weight_bytes == pytest.approx(16.0e9, rel=0.01)
    assert rows[("INT4 g128", "FP16")].weight_bytes == pytest.approx(5.7e9, rel=0.02)
    assert fp16.tokens == pytest.approx(62_000, rel=0.02)
    assert rows[("INT4 g128", "FP16")].tokens == pytest.approx(141_000, rel=0.02)
    best = rows[("INT4 g128", "FP8")]
    assert best.tokens == pytest.approx(277_000, rel=0.02)
    assert best.tokens / fp16.tokens == pytest.approx(4.5, abs=0.1)
    assert best.concurrent == best.tokens // 8192
    assert all(r.tokens % 16 == 0 for r in rows.values())  # whole blocks
    # int8 KV: codes + an fp16 scale per head (as FP8); int4: half-byte codes + fp16 scale and zero.
    assert rows[("FP16", "INT8")].kv_bytes_per_token == 2 * 32 * 8 * (128 + 2)
    assert rows[("FP16", "INT4")].kv_bytes_per_token == 2 * 32 * 8 * (64 + 4)
    assert rows[("FP16", "K8V4")].kv_bytes_per_token == 32 * 8 * (128 + 2 + 64 + 4)
    int4 = rows[("INT4 g128", "INT4")]
    assert int4.tokens / rows[("INT4 g128", "FP16")].tokens >= 3.4


def test_70b_does_not_fit_24gib() -> None:
    rows = rows_by_key("Llama-3-70B")
    assert not any(r.fits for r in rows.values())
    assert all(r.tokens == 0 for r in rows.values())


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "Llama-3-8B", "--gpu-memory", "24GiB"]) == 0
    table = capsys.readouterr().out
    assert "| INT4 g128 | FP8 | 5.73 |" in table and "| 276,832 |" in table
    assert main(["plan", "Qwen2.5-7B", "--json", "--context-len", "4096"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context_len"] == 4096 and len(data["rows"]) == 20


def test_plan_reads_a_local_config(tmp_path: Path) -> None:
    cfg = json.loads((Path(__file__).parents[1] / "qpage/data/configs/Mistral-7B.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert run_plan(str(tmp_path), "24GiB", "1.5GiB", 4096) == run_plan("Mistral-7B", "24GiB", "1.5GiB", 4096) \
        .replace("Mistral-7B:", f"{tmp_path.name}:")


def test_unknown_model_names_the_bundled_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "Llama-9-1T"]) == 2
    err = capsys.readouterr().err
    assert "Llama-3-8B" in err and "Qwen2.5-32B" in err


def test_llama3_70b_int4_fp8_fits_two_24gib_cards() -> None:
    """70B at INT4 (~37 GB) does not fit one card; split over two, each card holds half the
    weights and half the KV heads (4 of 8), so the per-token KV bytes halve too."""
    _, arch = load_arch("Llama-3-70B")
    one = {(r.weights, r.kv): r for r in plan(arch, 24 * GIB, int(1.5 * GIB), 8192)}
    two = {(r.weights, r.kv): r for r in plan(arch, 24 * GIB, int(1.5 * GIB), 8192, tp=2)}
    assert not one[("INT4 g128", "FP8")].fits
    row = two[("INT4 g128", "FP8")]
    assert row.fits and row.concurrent >= 1
    assert row.weight_bytes == pytest.approx(one[("INT4 g128", "FP8")].weight_bytes / 2, rel=0.01)
    assert row.kv_bytes_per_token == one[("INT4 g128", "FP8")].kv_bytes_per_token // 2
    free = 24 * GIB - int(1.5 * GIB) - row.weight_bytes
    assert row.tokens == free // (row.kv_bytes_per_token * 16) * 16
    text = run_plan("Llama-3-70B", "24GiB", "1.5GiB", None, tp=2)
    assert "2 cards of 24.0 GiB" in text and "| INT4 g128 | FP8 |" in text
    with pytest.raises(ValueError, match="does not fit 64 query heads over 8 KV heads"):
        run_plan("Llama-3-70B", "24GiB", "1.5GiB", None, tp=128)


@pytest.mark.parametrize("name, total, active", [("Qwen3-30B-A3B", 30.53e9, 3.35e9),
                                                 ("Mixtral-8x7B", 46.70e9, 12.88e9)])
def test_moe_total_and_active_parameters(name: str, total: float, active: float) -> None:
    """Every expert counts toward the weights a card holds, only the top-k toward a token's work:
    the published totals (30.5B / 3.3B active; 46.7B / 12.9B) to the precision printed."""
    _, a = load_arch(name)
    assert abs(num_params(a) - total) < 0.005e9 and abs(num_params(a, active=True) - active) < 0.005e9
    rows = plan(a, 24 * 2**30, 3 * 2**29, 8192)
    int4 = next(r for r in rows if r.weights == "INT4 g128" and r.kv == "FP16")
    assert int4.weight_bytes > 0.5 * total  # every expert is held: 4 bits plus scales and zeros
