"""benchmarks/hbm_bandwidth.py, the GPU suite's first figure, end to end on the CPU at a toy size."""

from __future__ import annotations

import json

from benchmarks import hbm_bandwidth


def test_reports_the_bandwidth_and_the_floor_it_sets(tmp_path, capsys):
    out = tmp_path / "bw.json"
    assert hbm_bandwidth.main(["--gib", "0.0625", "--repeats", "3", "--weights-gb", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bytes"] == 0.0625 * (1 << 30)
    assert result["bytes_per_s"] == result["bytes"] / result["seconds"] > 0
    # One GB of weights at that rate, in milliseconds.
    assert abs(result["floor_ms"] - 1e9 / result["bytes_per_s"] * 1e3) < 1e-9
    assert "TB/s" in capsys.readouterr().out
