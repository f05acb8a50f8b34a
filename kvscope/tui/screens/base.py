"""What every kvscope screen shares: it draws from its feeds when the App says so, and reaches
the App typed (``self.kvscope``), never by probing it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, cast

from textual.screen import ModalScreen, Screen

if TYPE_CHECKING:
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import Feed
    from kvscope.tui.palette import Palette

# (title, help text, what to run): a screen's entries in the command palette (ctrl+p)
Command = tuple[str, str, Callable[[], object]]


class FeedView:
    """Mixed into screens that show feeds; the App's one timer calls ``draw`` when something moved."""

    selected: int | None = None  # the request under the cursor, lit in the block map
    feed: "Feed | None" = None  # the feed this screen is about, where there is one

    @property
    def kvscope(self) -> "KvscopeApp":
        return cast("KvscopeApp", self.app)  # type: ignore[attr-defined]

    def draw(self, pal: "Palette") -> None:
        """Repaint from the feeds (and the player) as they are now."""

    def draw_key(self) -> tuple:
        """What, beside the feeds and the player, changes this screen's picture."""
        return (self.selected,)

    def commands(self) -> Iterable[Command]:
        return ()


class FeedScreen(FeedView, Screen):
    pass


class FeedModal(FeedView, ModalScreen):
    pass
