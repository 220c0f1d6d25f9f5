"""When: hooks on a live model.

- :mod:`.probe`: :func:`attach` / :class:`Probe`, the hook lifecycle (handles, detach, guards)
- :mod:`.explain`: :func:`explain`, one forward attached, run and detached
- :mod:`.plan`: what one attach explains, checked up front
- :mod:`.forward`: one forward's capture and its attribution
- :mod:`.generate`: the ``generate`` wrapper and each call's feature cache
- :mod:`.recording`: what the hooks feed during a call (a `Recording`; `NOT_RECORDED`)
- :mod:`.engines`: serving engines (the `Engine` protocol, its registry; transformers' continuous batching), per request
- :mod:`.publish`: where records go (call list, ``on_step``, ``subscribe()``, sink)
- :mod:`.guard`: failures stop recording, never the model
"""

from .explain import explain
from .probe import Probe, attach, detach_all

__all__ = ["Probe", "attach", "detach_all", "explain"]
