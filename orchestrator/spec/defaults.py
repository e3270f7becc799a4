"""Where the site and user defaults files are, and reading them (the I/O of ``layers``).

The site file is `$ORCHESTRATE_SITE`, else /etc/orchestrate/defaults.yaml; the user file
is `defaults.yaml` in the orchestrate home (`--home`, else `$ORCHESTRATE_HOME`, else
~/.orchestrate). A default path with no file there is fine; a file named by
`$ORCHESTRATE_SITE` must exist (a typo there would silently drop the site's settings),
and an empty `ORCHESTRATE_SITE` means no site file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from orchestrator.contract import envvars
from orchestrator.errors import SpecError, SpecIssue
from orchestrator.spec import yamlsrc
from orchestrator.spec.layers import Layer, check
from orchestrator.spec.load import read_text

SITE_FILE = Path("/etc/orchestrate/defaults.yaml")
USER_FILE = "defaults.yaml"  # in the orchestrate home


def files(home: Path, environ: Mapping[str, str] = os.environ) -> list[tuple[str, Path, bool]]:
    """(layer, file, whether it must exist) of each defaults file, lowest first."""
    out = []
    site = environ.get(envvars.SITE)
    if site is None:
        out.append(("site", SITE_FILE, False))
    elif site:
        out.append(("site", Path(site).expanduser(), True))
    out.append(("user", Path(home) / USER_FILE, False))
    return out


def read_layers(home: Path, environ: Mapping[str, str] = os.environ) -> list[Layer]:
    """The defaults files that exist, read and checked (SpecError naming the file, line
    and key of every problem in the first bad one), lowest first."""
    layers = []
    for layer, path, required in files(home, environ):
        if not required and not path.exists():
            continue
        name = f"{layer} defaults file"
        what = f"the {name}"
        text = read_text(path, name)
        try:
            data, lines = yamlsrc.load_with_lines(text, str(path))
        except SpecError as exc:
            raise SpecError(exc.issues, what) from None
        if data is None:  # an empty file, or only comments
            continue
        if not isinstance(data, dict):
            raise SpecError([SpecIssue("", 1, f"a defaults file is a mapping of spec fields, not a {type(data).__name__}",
                                       str(path))], what)
        # a section whose lines are all commented out is null: it sets nothing
        data = {k: v for k, v in data.items() if v is not None}
        read = Layer(layer, str(path), data, lines, hashlib.sha256(text.encode()).hexdigest())
        issues = check(read)
        if issues:
            raise SpecError(issues, what)
        layers.append(read)
    return layers

