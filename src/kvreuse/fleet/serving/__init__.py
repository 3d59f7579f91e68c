"""A live fleet behind one OpenAI endpoint: the front, dispatch, forwarding, CLI."""
