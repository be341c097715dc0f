"""The log view's rows (dflashctl/tui/logrows.py): the filter's lines, wrapped rows
cut at the width (wide characters counted as two cells), and rows kept right as the
oldest lines are dropped and more are appended."""

from __future__ import annotations

from dflashctl.tui.logrows import Rows, words_of, wrap_starts


def test_the_filter_shows_the_lines_with_every_word_and_finds_them_when_all_are_shown():
    lines = ["step 1 loss 2.0", "WARNING step 2", "step 3 warning again", "step 4"]
    only = Rows(words_of("Warning STEP"))
    only.extend(lines, 0)
    assert only.line == [1, 2] and only.found == [1, 2]
    every = Rows(words_of("warning"), only_matches=False)
    every.extend(lines, 10)
    assert every.line == [10, 11, 12, 13] and every.found == [11, 12] and every.upto == 14


def test_wrapped_rows_cut_a_line_at_the_width_in_cells():
    assert wrap_starts("x" * 25, 10) == [0, 10, 20]
    assert wrap_starts("short", 10) == [0] and wrap_starts("x" * 50, 0) == [0]
    assert wrap_starts("漢" * 6, 4) == [0, 2, 4]  # two cells each
    rows = Rows(wrap_width=10)
    rows.extend(["a" * 25, "b"], 0)
    assert list(zip(rows.line, rows.start)) == [(0, 0), (0, 10), (0, 20), (1, 0)]
    assert [rows.end_of(r, 25) for r in range(3)] == [10, 20, 25]


def test_dropping_the_oldest_lines_keeps_the_rows_of_the_others():
    rows = Rows(words_of("x"), only_matches=False)
    rows.extend(["x1", "a", "x2", "b"], 0)
    rows.drop_before(2)
    assert rows.line == [2, 3] and rows.found == [2]
    rows.extend(["x3"], 4)
    assert rows.line == [2, 3, 4] and rows.found == [2, 4] and rows.first_row_of(3) == 1
    assert rows.first_row_of(0) is None and rows.row_at_or_after(0) == 0
    assert rows.widest == 2
