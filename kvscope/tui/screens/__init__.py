"""Screens: each takes its feed(s) and the player in ``__init__`` and binds its own actions."""

from kvscope.tui.screens.dashboard import DashboardScreen, LiveDashboard, ReplayDashboard
from kvscope.tui.screens.detail import RequestDetailScreen
from kvscope.tui.screens.diagnosis import DiagnosisScreen
from kvscope.tui.screens.help import HelpScreen
from kvscope.tui.screens.seek import SeekScreen

__all__ = ["DashboardScreen", "LiveDashboard", "ReplayDashboard", "RequestDetailScreen", "DiagnosisScreen",
           "HelpScreen", "SeekScreen"]
