"""Distributed transport: the worker side of a torch.distributed (NCCL or gloo) weight-update
group (the trainer side is :class:`weightsync.trainer.Broadcaster`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_exports

if TYPE_CHECKING:
    from weightsync.transports.distributed.group import Group, create_group
    from weightsync.transports.distributed.layout import DEFAULT_BUCKET_BYTES, plan_chunks
    from weightsync.transports.distributed.worker import GroupRegistry

_WHERE = {
    "Group": ".group", "create_group": ".group", "DEFAULT_BUCKET_BYTES": ".layout",
    "plan_chunks": ".layout", "GroupRegistry": ".worker",
}  # fmt: skip
__all__ = ["DEFAULT_BUCKET_BYTES", "Group", "GroupRegistry", "create_group", "plan_chunks"]
__getattr__ = lazy_exports(__name__, _WHERE)
