"""The untrusted side: the middle layers behind a WebSocket endpoint."""
