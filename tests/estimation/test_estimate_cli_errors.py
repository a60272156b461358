"""``python -m llmmem estimate``: every bad value is one line naming the option and what it takes
(issue 14, item 6); no traceback, no argparse riddle, no table whose columns run together."""

from __future__ import annotations

import json
import re

import pytest

from llmmem.__main__ import main


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--device-memory", "1e1000000"], ["device_memory", "larger than any memory"]),
        (["--device-memory", "1e-999999999999999999999GB"], ["device_memory", "exponent"]),
        (["--device-memory", "-1GB"], ["device_memory", ">= 0 bytes", "-1GB"]),
        (["--device-memory", "-0.5"], ["device_memory", ">= 0 bytes"]),
        (["--checkpointing", "0"], ["checkpointing", "positive integer"]),
        (["--seq", "100000000000"], ["--seq 100000000000", "more than any memory", "expected"]),
        (["--batch", "10000000000000000", "--seq", "100000"], ["--batch 10000000000000000", "more than any memory"]),
    ],
)
def test_bad_values_give_one_line_naming_the_option(argv, words, capsys):
    assert main(["estimate", "llama-7b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_a_negative_value_reaches_the_option_s_own_check(capsys):
    # argparse used to take "-1GB" for an option and say "expected one argument"
    with pytest.raises(SystemExit):
        main(["estimate", "llama-7b", "--batch", "-1GB"])
    err = capsys.readouterr().err
    assert "--batch" in err and "invalid int value: '-1GB'" in err


def test_checkpointing_takes_the_integer_form_it_advertises(capsys):
    assert main(["estimate", "llama-7b", "--checkpointing", "4", "--json"]) == 0
    as_int = json.loads(capsys.readouterr().out)
    assert main(["estimate", "llama-7b", "--checkpointing", "every-4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == as_int
    assert as_int["settings"]["checkpointing"] == "every-4"


@pytest.mark.parametrize("seq", ["2048", "3000000", "30000000"])
def test_table_columns_stay_apart_for_large_figures(seq, capsys):
    assert main(["estimate", "llama-7b", "--seq", seq]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = out[out.index(next(line for line in out if line.startswith("per device"))) + 1 :]
    rows = [line for line in rows if line.startswith("  ")]  # the table's rows
    assert len(rows) >= 9, out
    for line in rows:
        # "<figure> <unit>" then at least one space, then the exact byte count
        assert re.search(r"\d(?:\.\d\d)? (?:B|[KMGTPE]iB) +[\d,]+(?:  |$)", line), line
