"""Base class of the dashboard widgets: they render from the shared TuiState.

Widgets build their picture as rich ``Text`` lines (easy to write and test) and
hand Textual ready-made ``Strip``s through the line API: a line whose styles are
plain appends (the usual case) becomes one Segment per run of equal style, with
parsed styles cached, which is several times cheaper than the general path for
a block map with thousands of coloured cells.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from kvscope.tui.palette import DEFAULT, Palette

_STYLES: dict = {}


def _style(base, span) -> Style:
    key = (base, span)
    st = _STYLES.get(key)
    if st is None:
        b = base if isinstance(base, Style) else Style.parse(base) if base else Style.null()
        s = span if isinstance(span, Style) else Style.parse(span) if span else Style.null()
        st = b + s
        if len(_STYLES) > 4096:
            _STYLES.clear()
        _STYLES[key] = st
    return st


def text_to_strip(line: Text, console=None) -> Strip:
    """One line of Text as a Strip (fast path for non-overlapping spans)."""
    plain = line.plain
    base = line.style
    spans = line.spans
    segs: list[Segment] = []
    pos = 0
    prev = None
    buf: list[str] = []
    for sp in spans:
        if sp.start < pos or sp.end < sp.start:
            if console is None:
                break
            return Strip(list(line.render(console)))
        if sp.start > pos:
            st = _style(base, None)
            if st is not prev and buf:
                segs.append(Segment("".join(buf), prev))
                buf = []
            prev = st
            buf.append(plain[pos:sp.start])
        st = _style(base, sp.style)
        if st is not prev and buf:
            segs.append(Segment("".join(buf), prev))
            buf = []
        prev = st
        buf.append(plain[sp.start:sp.end])
        pos = sp.end
    else:
        if pos < len(plain):
            st = _style(base, None)
            if st is not prev and buf:
                segs.append(Segment("".join(buf), prev))
                buf = []
            prev = st
            buf.append(plain[pos:])
        if buf:
            segs.append(Segment("".join(buf), prev))
        return Strip(segs)
    return Strip(list(line.render(console)))


class _Lines(Text):
    """A joined Text that remembers its lines (so render_line need not split it)."""

    lines: list


def join_lines(lines) -> Text:
    """Lines joined into one Text that is cropped, never wrapped, at the widget's width."""
    lines = list(lines)
    t = _Lines(no_wrap=True, overflow="ellipsis")
    t.append_text(Text("\n").join(lines))
    t.lines = lines
    return t


class StateWidget(Widget):
    """A widget drawn from a ``TuiState``; ``show`` hands it the latest one.

    Widgets never change the state. The app calls ``show`` from its repaint timer
    (at most 30 times a second) and only when the state changed.
    """

    DEFAULT_CSS = """
    StateWidget {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.state = None
        self.pal: Palette = DEFAULT
        self.selected: int | None = None
        self._strips: list[Strip] | None = None

    def show(self, state, pal: Palette, selected: int | None) -> None:
        self.state = state
        self.pal = pal
        self.selected = selected
        self.refresh()

    def refresh(self, *args, **kwargs):
        self._strips = None
        return super().refresh(*args, **kwargs)

    def _build_strips(self) -> list[Strip]:
        text = self.render()
        lines = getattr(text, "lines", None)
        if lines is None:
            lines = text.split("\n", allow_blank=True) if isinstance(text, Text) else [Text(str(text))]
        console = self.app.console
        base = self.rich_style  # the widget's CSS colours under the content's own styles
        width = self.size.width
        pad = Style(bgcolor=base.bgcolor)
        return [text_to_strip(ln, console).apply_style(base).adjust_cell_length(width, pad) for ln in lines]

    FAST_LINES = True  # False: let Textual render ``render()`` itself (tests compare both)

    def render_line(self, y: int) -> Strip:
        if not self.FAST_LINES:
            return super().render_line(y)
        if self._strips is None or getattr(self, "_strips_size", None) != self.size:
            self._strips = self._build_strips()
            self._strips_size = self.size
        if 0 <= y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.size.width, self.rich_style)
