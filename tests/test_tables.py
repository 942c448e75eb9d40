"""The one Markdown table helper."""

import pytest

from kvlab import tables


def test_a_table_is_header_rule_and_rows():
    assert tables.markdown(["a", "b"], [[1, "x|y"], ["2\nz", 3.5]], align="lc") == (
        "| a | b |\n|:---|:---:|\n| 1 | x\\|y |\n| 2 z | 3.5 |")


@pytest.mark.parametrize("header,rows,align,match", [
    ([], [], None, "header"), (["a"], [[1, 2]], None, "row 0 has 2 cells"), (["a", "b"], [], "l", "align"),
    (["a"], [], "x", "align")])
def test_a_malformed_table_is_refused(header, rows, align, match):
    with pytest.raises(ValueError, match=match):
        tables.markdown(header, rows, align)
