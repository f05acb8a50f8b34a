"""transformers' own progress bars ("Loading weights", "Writing model shards") off while kvscope loads or converts
a model: kvscope says what it is doing in its own lines, and a second bar would glue itself to them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def transformers_bars_off() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
