"""How every benchmark hands back its result: JSON on stdout and in a file (one function, one format)."""

from __future__ import annotations

import json
import pathlib
from typing import Any


def emit(result: Any, out: str | pathlib.Path | None) -> Any:
    """Prints ``result`` as indented JSON, writes the same text to ``out`` (folders created; None: no file)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return result
