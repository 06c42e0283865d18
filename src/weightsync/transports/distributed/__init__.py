"""Distributed transport: the worker side of a torch.distributed (NCCL or gloo) weight-update
group (the trainer side is :class:`weightsync.trainer.Broadcaster`).  Names load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightsync._lazy import lazy_dir, lazy_package

if TYPE_CHECKING:
    from weightsync.transports.distributed.group import Group as Group
    from weightsync.transports.distributed.group import create_group as create_group
    from weightsync.transports.distributed.layout import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
    from weightsync.transports.distributed.layout import plan_chunks as plan_chunks
    from weightsync.transports.distributed.worker import GroupRegistry as GroupRegistry

__all__, __getattr__ = lazy_package(
    __name__,
    {
        "DEFAULT_BUCKET_BYTES": ".layout",
        "Group": ".group",
        "GroupRegistry": ".worker",
        "create_group": ".group",
        "plan_chunks": ".layout",
    },
)
__dir__ = lazy_dir(globals(), __all__)
