"""The prefill side: ``KVSender`` and its I/O thread, its records and its frame pump."""
