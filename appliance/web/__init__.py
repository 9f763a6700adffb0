"""The Litestar cockpit and API: reads the bus through ports, never governs it."""
