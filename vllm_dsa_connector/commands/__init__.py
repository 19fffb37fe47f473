"""Sub-commands of ``vllm-dsa`` (one module each), and the dev package's commands.

The wheel ships ``inspect`` and ``options``. The workshop's commands (``demo``, ``make-model``, ``bench ...``) live
in the dev package (``dev/`` of the repository, not in the wheel); it announces them through the entry-point group
:data:`DEV_GROUP`, so nothing here imports it by name.
"""

from __future__ import annotations

import importlib.metadata
from types import ModuleType

#: The entry-point group a dev package registers under: its object has ``COMMANDS``, ``BENCHES`` (the tables of
#: :mod:`vllm_dsa_connector.cli`) and ``option_sections()`` (the settings classes of ``vllm-dsa options``).
DEV_GROUP = "vllm_dsa.dev"
#: What a user without the dev package is told.
DEV_HINT = "part of the dev package, not of the wheel: install it with `pip install -e dev/` from a clone of the repository"


def dev_packages() -> list[ModuleType]:
    """The installed dev packages' command modules (none in a deployment: the wheel alone). An entry point seen
    twice (an editable install and a build's ``*.egg-info`` on the path) counts once."""
    eps = {ep.value: ep for ep in importlib.metadata.entry_points(group=DEV_GROUP)}
    return [eps[value].load() for value in sorted(eps)]
