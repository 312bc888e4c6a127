"""coursekit.widgets.format_explorer: typing a value updates the table; bad input says
so."""

from coursekit.widgets import format_explorer  # noqa: E402


def _text(ui):
    return "".join(o["text"] for o in ui.children[1].outputs)


def test_format_explorer_updates_on_new_value():
    ui = format_explorer("0.1", formats=("fp16", "bf16"))
    assert _text(ui).startswith("x = 0.1\n") and "0 01011 1001100110" in _text(ui)
    ui.children[0].value = "70000"
    text = _text(ui)
    assert "x = 70000.0" in text and "0 11111 0000000000" in text and "65504" in text
    assert "fp32" not in text  # only the formats asked for


def test_format_explorer_rejects_non_numbers():
    ui = format_explorer("abc")
    assert "not a number: 'abc'" in _text(ui)
