"""Sharded, multi-source transfer plans on torch.distributed.

- :mod:`.protocol`: the wire protocol (store keys, manifests, the pieces' hashes);
- :mod:`.send`: a source's side (a trainer rank packs, sends and hashes its transfers);
- :mod:`.receive`: a worker rank's side (its place in the group, the manifests, the go, the
  receive and the verification of every piece);
- :mod:`.reader`, :mod:`.pull`: the plan channel of a one-process worker, receiving into its
  tensors or handing whole tensors to an engine that pulls them;
- :mod:`.pieces`, :mod:`.flight`, :mod:`.streams`: where a piece lies in a tensor's bytes, the
  operations in flight, and the hash of each served tensor taken as its pieces land.
"""
