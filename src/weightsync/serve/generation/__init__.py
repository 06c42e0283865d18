"""The generation routes' parts: bodies parsed (:mod:`.fields`), requests run as the engine's
sequences (:mod:`.runs`), tokens as text (:mod:`.text`), OpenAI's reply shapes (:mod:`.openai`),
SGLang's ``/generate`` (:mod:`.sglang`) and server-sent events (:mod:`.sse`)."""
