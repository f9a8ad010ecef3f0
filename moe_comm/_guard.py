"""A failed phase makes its Buffer unusable: peers may hold half a call's data."""
from __future__ import annotations

import functools
import inspect

from .fault import RankExcludedError


def _failed(owner, what: str, error: BaseException) -> None:
    """Marks the Buffer of ``owner`` (the Buffer, or one of its engines) failed by ``error``,
    unless the rank was cut off (``clean_mask`` takes it back)."""
    if not isinstance(error, RankExcludedError):
        owner._mark_failed(f"an earlier {what} failed ({error})")


def poisons_buffer_on_error(what: str):
    """Decorates a phase method of a Buffer or of its engines (``self._check_usable()`` and
    ``self._mark_failed(reason)``): any exception marks the Buffer failed, then re-raises;
    except RankExcludedError. A phase written as a generator of steps (a normal-mode receive
    that runs its call's rounds: ``moe_comm.normal_mode``) is guarded over all its steps."""

    def wrap(method):
        if inspect.isgeneratorfunction(method):
            @functools.wraps(method)
            def steps(self, *args, **kwargs):
                self._check_usable()
                try:
                    return (yield from method(self, *args, **kwargs))
                except BaseException as error:
                    _failed(self, what, error)
                    raise

            return steps

        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            self._check_usable()
            try:
                return method(self, *args, **kwargs)
            except BaseException as error:
                _failed(self, what, error)
                raise

        return guarded

    return wrap


def run_steps(steps):
    """Runs a generator of steps to its end; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
