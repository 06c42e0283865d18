"""Delta updates: a delta checkpoint names its exact base, is applied all or nothing, and is
verified by a linear digest in O(changed elements) (see ``docs/delta.md``)."""
