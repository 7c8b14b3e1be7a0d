"""The runtime API's routers, one module per group of endpoints (`app.create_app` includes them)."""
