"""How to install what an optional feature needs, said in words that work however szformat was installed.

szformat installs from its source tree or a built wheel (``pip install -e ".[gpu]"``), not from a package index, so
``pip install 'szformat[gpu]'`` would send a user to a distribution that is not there. The hint names the packages
of the extra themselves, read from the installed metadata, so it cannot drift from ``pyproject.toml``.
"""

from __future__ import annotations

import re
from importlib import metadata

_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def install_hint(extra: str) -> str:
    """``pip install 'triton>=3.2'`` for ``"gpu"``: the requirements of szformat's extra ``extra``, quoted for a
    shell, with the extra named so a user installing from the source tree can write ``pip install -e ".[gpu]"``."""
    try:
        requirements = metadata.requires("szformat") or []
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        requirements = []
    wanted = []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        found = _EXTRA.search(marker)
        if found and found.group(1) == extra:
            wanted.append(name.strip().replace(" ", ""))
    if not wanted:
        return f"pip install -e \".[{extra}]\" in szformat's source tree"
    packages = " ".join(f"'{r}'" for r in wanted)
    return f"pip install {packages} (szformat's {extra} extra: pip install -e \".[{extra}]\" from its source tree)"
