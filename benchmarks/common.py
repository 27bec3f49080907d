"""Helpers every benchmark script shares (imported as a sibling: scripts run from this folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(result: Any, out: Path | str) -> Path:
    """Write ``result`` as indented JSON to ``out`` (folders made), through a temporary file
    and a rename, so that an interrupted run never leaves half a file."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    return out
