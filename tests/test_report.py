"""Named report sections: rewritten in place, others untouched."""

from foresight.eval.report import write_section


def test_sections_are_replaced_in_place_and_others_kept(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text("# Benchmarks\n\nintro\n")
    write_section(path, "decode", "table one")
    write_section(path, "labels", "memory table")
    write_section(path, "decode", "table two")
    text = path.read_text()
    assert text.count("table") == 2 and "table one" not in text
    assert text.index("intro") < text.index("table two") < text.index("memory table")
    assert text.startswith("# Benchmarks\n\nintro\n")
