"""What depends on the broker's transport: its settings as the worker reads them, the
Redis channel's close after a broker crash, held messages put back, an ack's fate."""
