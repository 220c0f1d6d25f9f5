"""The protocol between the probe's hooks and what they record into: one call's :class:`Recording`.

    with gens.running(recording):       # an engine, around its host's forward
        host_forward()                  # the probe's hooks call recording.before_forward(...), after_forward(...)

A ``generate`` call's :class:`~nxl_hooks.hooks.generate.Run` and an engine's packed step
(:mod:`nxl_hooks.hooks.engines`) both implement it; :data:`NOT_RECORDED` is the null one, for a call that is not
recorded (its call record says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .forward import Capture

__all__ = ["NOT_RECORDED", "Recording"]


class Recording(Protocol):
    """What the probe's hooks feed, in the thread that runs a recorded call: a ``generate`` call's
    :class:`~nxl_hooks.hooks.generate.Run`, a continuous-batching step, or :data:`NOT_RECORDED`.

    ``gens.current()`` returns one (None outside every call); the hooks call, per forward of the model:
    ``before_forward`` with the backbone's bound arguments, ``after_forward`` with its :class:`Capture`, then
    ``after_task`` with the task model's output (its logits). ``fail`` stops recording it. Hooks skip a recording
    whose ``failed`` is true. None of these raise into the host: the probe catches and calls ``fail``.
    """

    @property
    def failed(self) -> bool: ...

    def before_forward(self, arguments: dict[str, Any]) -> None: ...

    def after_forward(self, capture: Capture) -> None: ...

    def after_task(self, output: Any) -> None: ...

    def fail(self, what: str, error: BaseException) -> None: ...


class _NotRecorded:
    """The null :class:`Recording`: a call that is not recorded (its call record says why). Its forwards are
    neither recorded as the call's steps nor as plain forwards."""

    failed = True

    def before_forward(self, arguments: dict[str, Any]) -> None:
        pass

    def after_forward(self, capture: Capture) -> None:
        pass

    def after_task(self, output: Any) -> None:
        pass

    def fail(self, what: str, error: BaseException) -> None:
        pass

    def __repr__(self) -> str:
        return "NOT_RECORDED"


#: The recording of a call that is not recorded.
NOT_RECORDED: Recording = _NotRecorded()
