"""Logging for a served worker or router: one configuration for uvicorn's loggers and weightsync's own
(``weightsync.events`` says what the worker did), as text or as one JSON object a line."""

from __future__ import annotations

import copy
import datetime
import json
import logging
from typing import Any, Final

import uvicorn
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG

LOG_FORMATS: Final = ("text", "json")

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD: Final = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    then the record's extra fields (a ``weightsync.events`` record's ``event`` dict is spread
    out as keys of their own), then ``exc_info`` as text when there is a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD or key in out:
                continue
            if key == "event" and isinstance(value, dict):
                out.update({k: v for k, v in value.items() if k not in ("ts", "level", "logger", "message")})
            else:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=repr, ensure_ascii=False)


def log_config(level: str = "warning", fmt: str = "text") -> dict[str, Any]:
    """A :func:`logging.config.dictConfig` for ``uvicorn.Config(log_config=...)``: uvicorn's
    own loggers as uvicorn sets them up, plus the ``weightsync`` logger at ``level`` on
    stderr; with ``fmt="json"`` every handler writes :class:`JsonFormatter` lines."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {fmt!r}")
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["weightsync"] = {
        "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
        "datefmt": "%Y-%m-%dT%H:%M:%S%z",
    }
    config["handlers"]["weightsync"] = {
        "formatter": "weightsync",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
    }
    config["loggers"]["weightsync"] = {
        "handlers": ["weightsync"],
        "level": LOG_LEVELS.get(level, logging.WARNING),
        "propagate": False,
    }
    if fmt == "json":
        for name in config["formatters"]:
            config["formatters"][name] = {"()": f"{__name__}.JsonFormatter"}
    return config


def server_config(
    app: Any, host: str, port: int, log_level: str, log_format: str, **options: Any
) -> uvicorn.Config:
    """The ``uvicorn.Config`` a worker or the router serves with: ``app`` on ``host:port``,
    its logging (:func:`log_config`) at ``log_level`` in ``log_format``, the app's lifespan on;
    ``options`` are the rest of uvicorn's (``access_log``, ``timeout_graceful_shutdown``...)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config(log_level, log_format),
        lifespan="on",
        **options,
    )
