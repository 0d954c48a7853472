"""`engine: sglang`: an SGLang server per replica, driven over its HTTP API (`engine.py`), with the
typed bodies of that API (`client.py`) and the server process a replica launches (`server.py`).
Its options are in `options.py`."""
