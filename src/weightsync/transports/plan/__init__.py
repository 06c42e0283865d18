"""Sharded, multi-source transfer plans on torch.distributed: the wire protocol, the worker's
receive and verify, the readers, and the trainer-side send."""
