"""LoRA adapters as a weight channel: read from disk in PEFT's layout and verified
(:func:`~.reader.read_adapter`), their tensors checked against the model (:mod:`.checks`)."""
