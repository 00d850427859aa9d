"""dtrain bridge: HTTP/WebSocket front of a node (Training API v1, split inference)."""
