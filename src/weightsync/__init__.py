"""weightsync: a weight-update control plane for reinforcement-learning inference workers."""

from __future__ import annotations

__version__ = "0.1.0"  # the one place the version lives; pyproject.toml reads it from here
