"""Paths of the reference data shipped next to the repository (../shared/reference)."""

from __future__ import annotations

from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference"
SNAPSHOTS = sorted((REFERENCE / "snapshots").glob("*.pickle"))
MINIMALLOC = sorted((REFERENCE / "minimalloc").glob("*.csv"))
