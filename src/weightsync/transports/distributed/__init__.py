"""Distributed transport: trainer-to-workers broadcast over torch.distributed (NCCL or gloo)."""

from __future__ import annotations

from .group import Group, create_group
from .layout import DEFAULT_BUCKET_BYTES, plan_chunks
from .trainer import Broadcaster, PushFailed
from .worker import GroupRegistry

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Broadcaster",
    "Group",
    "GroupRegistry",
    "PushFailed",
    "create_group",
    "plan_chunks",
]
