"""The server side: the middle layers behind a WebSocket endpoint, optionally attested and sealed."""
