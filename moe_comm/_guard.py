"""A failed phase makes its Buffer unusable: peers may hold half a call's data."""
from __future__ import annotations

import functools

from .fault import RankExcludedError


def poisons_buffer_on_error(what: str):
    """Decorates a Buffer phase method: any exception marks the Buffer failed, then re-raises;
    except RankExcludedError (the rank was cut off; ``clean_mask`` takes it back)."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            self._check_usable()
            try:
                return method(self, *args, **kwargs)
            except RankExcludedError:
                raise
            except BaseException as error:
                self._failure = f"an earlier {what} failed ({error})"
                raise

        return guarded

    return wrap
