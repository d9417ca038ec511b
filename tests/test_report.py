"""Named report sections (rewritten in place, others untouched) and the emphasis of the result plots."""

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


def test_a_plot_with_a_learned_row_draws_it_golden_and_the_strongest_heuristics_apart_and_mutes_the_rest():
    from foresight.eval.report import MUTED, STRONGEST, _emphasis

    values = {"full": 1.0, "golden": 1.1, "learned": 1.2, **{f"h{i}": 1.3 + i / 10 for i in range(6)}}
    curves = {policy: [(128, value)] for policy, value in reversed(values.items())}
    styles = _emphasis(curves, "full", ["learned"], "golden", higher_is_better=False)
    assert list(styles) == ["full", "golden", "learned", "h0", "h1", "h2", "h3", "h4", "h5"]  # the legend's order
    assert styles["learned"]["linewidth"] > styles["golden"]["linewidth"] > styles["h0"]["linewidth"]
    strong = [p for p, style in styles.items() if p.startswith("h") and style["color"] != MUTED]
    assert strong == ["h0", "h1", "h2"] and len(strong) == STRONGEST
    higher = _emphasis(curves, "full", ["learned"], "golden", higher_is_better=True)
    assert [p for p, style in higher.items() if p.startswith("h") and style["color"] != MUTED] == ["h5", "h4", "h3"]
