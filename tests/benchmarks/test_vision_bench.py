"""benchmarks/vision.py: the tiny preset end to end, and its argument checks."""

from __future__ import annotations

import pytest

from benchmarks import vision


def _table(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_tiny_preset_reports_every_size_and_bucket(capsys):
    result = vision.main(["--preset", "tiny", "--images", "2", "--dtype", "float32",
                          "--sizes", "60x60,150x100,400x250", "--buckets", "1"])
    out = capsys.readouterr().out
    images = _table(out, "image (WxH)")
    assert [row[0] for row in images] == ["60x60", "150x100", "400x250"]
    # tiles and bucket calls: the base tile alone fills a 2-bucket, a 3x2 grid an 8-bucket, and
    # 25 tiles run as 8 + 8 + 8 + 1.
    assert [(row[1], row[2]) for row in images] == [("2", "2"), ("7", "8"), ("25", "8+8+8+1")]
    for row in images:
        numbers = [_number(cell) for cell in row[3:]]
        assert all(n > 0 for n in numbers), row
        tokens, preprocess, encode, pack, total, rate = numbers
        assert total == pytest.approx(preprocess + encode + pack, abs=0.2)
        # (the table rounds total to 0.1 ms, which moves a tiny image's rate by up to 0.05 / total)
        assert rate == pytest.approx(tokens / total * 1e3, rel=0.02 + 0.06 / total)
    # The placeholder counts are the processor's (the benchmark checks the packed rows against them).
    assert [r["tokens"] for r in result["images"]] == [36, 120, 151]
    towers = _table(out, "bucket (tiles)")
    assert [row[0] for row in towers] == ["1", "2", "8"]  # the images' buckets and --buckets 1
    assert [int(row[1]) for row in towers] == [2 + 2, 2, 2 + 2 * 3]
    assert all(_number(cell) > 0 for row in towers for cell in row[2:])
    assert result["dtype"] == "float32"


@pytest.mark.parametrize("argv", [["--images", "0"], ["--sizes", "384by384"], ["--sizes", "0x10"],
                                  ["--preset", "llava-next"], ["--buckets", "3"]])
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        vision.main(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err
