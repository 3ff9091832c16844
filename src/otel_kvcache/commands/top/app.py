"""The live view of ``otel-kvcache top``, on Textual: the frame redrawn about once a
second, and keys to sort, filter and quit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Input, Static

from otel_kvcache.commands.top.frame import View, render


class TopApp(App):
    """``read_frame`` gives the frame to draw (``frame.json_frame``), every ``interval`` seconds."""

    TITLE = "otel-kvcache top"
    CSS = """
    #frame { width: 1fr; height: auto; }
    #filter { dock: bottom; display: none; }
    #filter.editing { display: block; }
    """
    BINDINGS = [
        Binding("s", "sort", "Sort"),
        # A priority binding, so the application reads "f" itself and gives the field the
        # focus before it passes on the keys typed after it (see ``check_action``).
        Binding("f", "filter", "Filter by model or tenant", priority=True),
        Binding("escape", "clear_filter", "Clear the filter"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, read_frame: Callable[[], dict[str, Any]], interval: float, view: View) -> None:
        super().__init__()
        self.read_frame = read_frame
        self.interval = interval
        self.view = view
        self.frame: dict[str, Any] | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="frame")
        yield Input(placeholder="model or tenant (Enter to apply, Escape to clear)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_frame()
        self.set_interval(self.interval, self.refresh_frame)

    def refresh_frame(self) -> None:
        self.frame = self.read_frame()
        self.redraw()

    def redraw(self) -> None:
        if self.frame is not None:
            self.query_one("#frame", Static).update(render(self.frame, self.view))

    def action_sort(self) -> None:
        self.view.next_sort()
        self.redraw()

    def action_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.value = self.view.filter
        field.add_class("editing")
        # At once: ``field.focus()`` waits until the keys already read have gone elsewhere,
        # and a quick typist's (or a loaded host's) "fteam-a" would lose "team-a".
        self.set_focus(field)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool:
        """While the filter is being typed, "f" is a letter of it, not the filter key."""
        return action != "filter" or not self.query_one("#filter", Input).has_class("editing")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.view.filter = event.value.strip()
        event.input.remove_class("editing")
        self.set_focus(None)
        self.redraw()

    def action_clear_filter(self) -> None:
        self.view.filter = ""
        field = self.query_one("#filter", Input)
        field.remove_class("editing")
        self.set_focus(None)
        self.redraw()
