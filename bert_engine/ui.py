"""Building blocks for a task's Gradio tab, so every tab (built-in or a plugin's) has one layout:
inputs, a run button and examples next to each other (one click on an example runs it; Ctrl/Cmd+Enter
in a text box runs the tab), the answer right below, and the raw result with its provenance behind a
closed accordion.

    def build_tab(predictor):
        import gradio as gr
        from bert_engine import ui

        text = gr.Textbox(label="Text")
        button = ui.run_button(gr, "Classify")
        bars = gr.Label(label="Labels")
        details = ui.details(gr)
        ui.wire(gr, button, run, [text], [bars, details], api_name="sentiment",
                examples=[[e["text"]] for e in EXAMPLES])

Gradio is imported by the caller (`gr`), so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import html
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

RUN_CLASS = "be-run"  # the run button of a tab: Ctrl/Cmd+Enter clicks the one in the visible tab

# For gr.Blocks(head=...): Ctrl/Cmd+Enter in any input of a tab clicks that tab's run button.
KEYBOARD_JS = f"""
<script>
document.addEventListener("keydown", (event) => {{
  if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey)) return;
  const panel = event.target.closest && event.target.closest("[role=tabpanel]");
  const button = panel && panel.querySelector("button.{RUN_CLASS}");
  if (button && !button.disabled) {{ event.preventDefault(); button.click(); }}
}});
</script>
"""


# The host's wrapper for the handlers `wire` connects (see `wiring`), the task's description, the host's
# publisher of the task's API endpoint, and each run button's examples place.
_WIRING: ContextVar[tuple[Callable[..., Any], str, Callable[..., None] | None] | None] = ContextVar(
    "bert_engine_ui_wiring", default=None)
_EXAMPLE_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def wiring(wrap: Callable[[Callable[..., Any], str | None], Callable[..., Any]], description: str = "",
           publish: Callable[..., None] | None = None) -> Iterator[None]:
    """For the host, not for tabs: while a tab builds, every handler `wire` connects is served as
    `wrap(fn, api_name)` (api_name None for the Enter key and the examples), and the run button's
    endpoint is described by `description` (the task's) when given. The playground uses it to show a
    task's InputError as the UI's message, to tell visitors apart and to name each MCP tool.

    With `publish`, the run button's own event is the browser's (`{api_name}_view`, undocumented: its
    outputs are the page's components) and `publish(fn, inputs, api_name, description)` makes the API
    endpoint and MCP tool `api_name` itself (the playground's answers JSON: the result and provenance)."""
    token = _WIRING.set((wrap, description, publish))
    try:
        yield
    finally:
        _WIRING.reset(token)


def run_button(gr, label: str):
    """The tab's primary button (Ctrl/Cmd+Enter clicks it), with a place right under it, next to the
    inputs, where `wire` puts the examples."""
    button = gr.Button(label, variant="primary", elem_classes=[RUN_CLASS])
    _EXAMPLE_SLOTS[button] = gr.Column(elem_classes=["be-examples"])
    return button


def details(gr, label: str = "Details: the raw result and its provenance"):
    """A closed accordion holding the JSON result, under the answer."""
    with gr.Accordion(label, open=False):
        return gr.JSON(label="Result and provenance", show_label=False)


def wire(gr, button, fn: Callable[..., Any], inputs: Sequence[Any], outputs: Sequence[Any], *, api_name: str,
         examples: Sequence[Sequence[Any]] = (), example_label: str = "Examples (click one to run it)"):
    """Connect the run button (the task's one API endpoint, `api_name`) and the examples: clicking an
    example fills the inputs and runs `fn` (not cached, not an API endpoint). Single-line text boxes
    also run on Enter. Returns the click event.

    The API endpoint's (and MCP tool's) input names are `fn`'s parameter names, its description
    `fn`'s docstring (an `Args:` section describes each input) unless the host gives the task's. In the
    playground the endpoint `api_name` answers with the result as JSON text and the button's own event is
    `{api_name}_view` (see `wiring`)."""
    wrap, description, publish = _WIRING.get() or ((lambda f, _name: f), "", None)
    described = {"api_description": description} if description else {}
    if publish is None:
        event = button.click(wrap(fn, api_name), list(inputs), list(outputs), api_name=api_name, **described)
    else:  # the host publishes the endpoint; the button's event serves the page
        event = button.click(wrap(fn, api_name), list(inputs), list(outputs), api_name=f"{api_name}_view",
                             api_visibility="undocumented")
        publish(fn, list(inputs), api_name, description)
    for component in inputs:
        if isinstance(component, gr.Textbox) and (component.lines or 1) == 1:
            component.submit(wrap(fn, None), list(inputs), list(outputs), api_visibility="private")
    if examples:
        width = max(len(row) for row in examples)
        slot = _EXAMPLE_SLOTS.get(button)
        with slot if slot is not None else _here():  # under the run button when it made the place
            shown = gr.Examples([list(row) for row in examples], list(inputs)[:width], cache_examples=False,
                                api_visibility="private", label=example_label)
        # The example fills its own fields, then runs with every input as it stands: the visitor's options too
        # (Gradio's run_on_click passed the example's fields alone, the others at their start values). A second
        # example clicked while the first runs runs after it ("always_last"; Gradio's "once" dropped it, and left
        # the second text beside the first one's answer).
        shown.load_input_event.then(wrap(fn, None), list(inputs), list(outputs), api_visibility="private",
                                    trigger_mode="always_last")
    return event


@contextlib.contextmanager
def _here():
    yield


def whole(value: Any) -> Any:
    """A tab's number (Gradio hands a slider's value over as a float) as an int when it is a whole number;
    otherwise the value as it came, for the task's own check to refuse by name (2.5 n-best paths was
    silently read as 2)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def user_text(text: str) -> str:
    """A visitor's text as HTML: escaped, and isolated (<bdi>) so that the direction controls it may hold
    (U+202E RIGHT-TO-LEFT OVERRIDE, say) end with it and cannot reverse the app's own labels after it."""
    return f'<bdi style="color:inherit">{html.escape(text)}</bdi>' if text else ""  # (the mark's own colour)


def empty_state(text: str) -> str:
    """An output's content before the first run: what will appear there, in the theme's own text colour."""
    return f'<p class="be-empty"><em>{html.escape(text)}</em></p>'


def percent(score: float) -> str:
    """A probability as users read it: "88 %", "0.4 %", "< 0.1 %"."""
    value = 100 * float(score)
    if value >= 9.95:
        return f"{value:.0f} %"
    return f"{value:.1f} %" if value >= 0.05 else "< 0.1 %"


def bar(score: float, label: str = "") -> str:
    """One HTML row: the label, a bar as long as the score and the score in percent (escaped). Without a
    label the row has no label column (a table cell's bar: 6em of nothing pushed a phone's table wide)."""
    width = max(0.0, min(1.0, float(score))) * 100
    head = f'<span class="be-bar-label">{html.escape(label)}</span>' if label else ""
    return (f'<div class="be-bar{"" if label else " be-bar-bare"}">{head}'
            f'<span class="be-bar-track"><span class="be-bar-fill" style="width:{width:.1f}%"></span></span>'
            f'<span class="be-bar-value">{percent(score)}</span></div>')


def _luminance(rgb: tuple[int, int, int]) -> float:
    """WCAG relative luminance of an sRGB colour (0-255 channels)."""
    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    """WCAG contrast ratio of two sRGB colours (1 to 21; text wants 4.5)."""
    low, high = sorted((_luminance(a), _luminance(b)))
    return (high + 0.05) / (low + 0.05)


def readable_text(background: tuple[int, int, int]) -> str:
    """White or HIGHLIGHT_TEXT, whichever contrasts more with an opaque background."""
    dark = (0x11, 0x18, 0x27)
    return "#ffffff" if contrast(background, (255, 255, 255)) > contrast(background, dark) else HIGHLIGHT_TEXT


# Colours that read in light and dark themes: highlights carry their own dark text on a pale
# background (contrast above 7:1 for every pair below), never the theme's text colour.
HIGHLIGHT_TEXT = "#111827"
CSS = f"""
.be-bar {{ display: grid; grid-template-columns: minmax(6em, 14em) 1fr 4.5em; gap: .5em; align-items: center;
          margin: .15em 0; }}
.be-bar-bare {{ grid-template-columns: minmax(2em, 1fr) 4.5em; }}
.be-bar-label {{ overflow-wrap: anywhere; }}
.be-bar-track {{ background: rgba(127, 127, 127, .2); border-radius: 3px; height: .8em; }}
.be-bar-fill {{ display: block; height: 100%; background: #2563eb; border-radius: 3px; }}
.be-bar-value {{ text-align: right; font-variant-numeric: tabular-nums; }}
mark, .be-mark {{ color: {HIGHLIGHT_TEXT} !important; }}
"""
