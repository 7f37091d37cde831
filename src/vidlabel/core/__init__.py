"""Settings, identity, configuration and the I/O every stage shares."""
