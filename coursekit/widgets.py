"""Interactive demos (ipywidgets; only API shared by ipywidgets 7 and 8).

Each demo has a static counterpart in the chapter (a figure or a printed table), because
the HTML book shows no live widgets.
"""

from __future__ import annotations

from typing import Iterable


def format_explorer(
    value: str = "0.1",
    formats: Iterable[str] = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"),
):
    """Type a number; see its bits, stored value and nearest neighbours in each format.

    Returns the widget box (display it as a cell's last expression).
    """
    import ipywidgets as w

    from trainmem.formats import describe_value

    formats = tuple(formats)
    box = w.Text(
        value=str(value), description="x =", placeholder="0.1, 65504, 1e-8, -2.5 …"
    )
    out = w.Output(layout=w.Layout(overflow="auto"))

    def show(change=None):
        # Set the Output's content directly (no print / clear_output messages), so the
        # widget behaves the same in a live front end, under nbclient and under nbval.
        try:
            text = describe_value(float(box.value), formats)
        except ValueError:
            text = f"not a number: {box.value!r} (try 0.1, 65504, 1e-8)"
        out.outputs = (
            {"output_type": "stream", "name": "stdout", "text": text + "\n"},
        )

    box.observe(show, names="value")
    show()
    return w.VBox([box, out])
