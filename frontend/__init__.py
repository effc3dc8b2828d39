"""The HTTP frontend (runs in the launcher's process): OpenAI-compatible API, validation, streaming."""
