"""The one transition check of the handoff's state machines (P's leases, D's loads).

Each role states its machine once, as a table of the transitions it allows
(``producer.TRANSITIONS``, ``loads.TRANSITIONS``), and changes a request's state only through
:meth:`Transitions.step`, which refuses any other transition with :class:`IllegalTransition` naming the
request, both states and the ones allowed from the old state. A refused transition is a bug in this
package, never the effect of peer input: peer input is checked before it reaches a state change.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["IllegalTransition", "Transitions"]

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A request's state machine was asked for a transition it does not have (a bug, never peer input)."""


class Transitions(Generic[S]):
    """The allowed transitions of one machine (``table[old]``: the states ``old`` may move to).

    ``what`` names the machine's subject in errors (``"lease"``, ``"load"``). States are enums whose
    values are their names in messages.
    """

    def __init__(self, what: str, table: Mapping[S, frozenset[S]]) -> None:
        self.what = what
        self.table = table

    def step(self, subject: str, old: S, new: S) -> S:
        """``new`` if ``old -> new`` is allowed, else :class:`IllegalTransition` (``subject``: the request)."""
        allowed = self.table[old]
        if new not in allowed:
            names = ", ".join(s.value for s in allowed) or "none"
            raise IllegalTransition(f"{self.what} of {subject}: {old.value} -> {new.value} is not a "
                                    f"transition (from {old.value}: {names})")
        return new
