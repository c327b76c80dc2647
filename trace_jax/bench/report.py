"""How every benchmark hands back its result: JSON on stdout and in a file (one function, one format)."""

from __future__ import annotations

import json
import os
import pathlib
import platform
from typing import Any

import jax


def emit(result: Any, out: str | pathlib.Path | None) -> Any:
    """Prints ``result`` as indented JSON, writes the same text to ``out`` (folders created; None: no file)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return result


def machine(**extra: Any) -> dict[str, Any]:
    """Where a benchmark ran: jax and its backend, CPU count, the 1-minute load at the end, Python (and ``extra``)."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        **extra,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }
