"""The decode side: ``KVReceiver``, its I/O thread and outbox, the handshake, the engine's allocator."""
